"""LocalViT: the locality feed-forward against a direct computation, parameter counts and MACs
against the paper, the ablation keywords, and the authors' checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lgvit
from lgvit.models.layers import Block, LocalityFeedForward, Mlp
from lgvit.models.localvit import locality_ffn
from lgvit.tools.measure import count_macs, count_params

FIXTURE = Path(__file__).parent / "fixtures" / "localvit_authors_keys.json"
LOCALVIT = lgvit.list_models("localvit_*")
BASELINES = ["deit_tiny", "deit_small", "pvt_tiny", "swin_tiny", "t2t_vit_7", "tnt_tiny"]


def meta(name: str, **kw):
    with torch.device("meta"):
        return lgvit.create_model(name, **kw)


def _randomise(module: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)


@pytest.mark.parametrize("name", LOCALVIT + BASELINES)
def test_param_counts_match_the_paper(name):
    want = lgvit.get_model_config(name).paper["params_m"]
    got = count_params(meta(name)) / 1e6
    # within 1%, or equal at the paper's printed precision (T2T-ViT-7: 4.256M, printed 4.3M)
    assert abs(got - want) / want < 0.01 or round(got, 1) == want, f"{name}: {got:.3f}M vs {want}M"


@pytest.mark.parametrize(
    "name, macs_g",
    [("localvit_tiny", 1.27), ("localvit_small", 4.62), ("localvit_pvt_tiny", 1.98),
     ("localvit_t2t_vit_7", 1.15), ("localvit_tnt_tiny", 1.42), ("deit_tiny", 1.25),
     ("pvt_tiny", 1.93), ("t2t_vit_7", 1.15), ("tnt_tiny", 1.40)],
)  # fmt: skip
def test_macs_match(name, macs_g):
    got = count_macs(meta(name), (3, 224, 224)) / 1e9
    assert abs(got - macs_g) / macs_g < 0.01, f"{name}: {got:.3f}G"


def test_t2t_random_features_are_fixed():
    m = meta("localvit_t2t_vit_7")
    # fixed random features and positions: saved under the authors' keys, never trained, and
    # every parameter gets a gradient (timm's backward test asks that of every model)
    params = dict(m.named_parameters())
    assert all(p.requires_grad for p in params.values())
    fixed = {"pos_embed", "patch_embed.attention1.w", "patch_embed.attention2.w"}
    assert fixed <= set(m.state_dict()) and not fixed & set(params)
    assert isinstance(m.patch_embed.attention1.mlp, LocalityFeedForward)


def test_locality_feed_forward_matches_direct_convolutions():
    torch.manual_seed(0)
    C, g, H, W = 8, 4, 3, 5  # a non-square grid
    ffn = LocalityFeedForward(C, g * C, act="hswish", channel_attn="se", reduction=8).eval()
    _randomise(ffn)
    x = torch.randn(2, 1 + H * W, C)  # a class token in front
    out = ffn(x, (H, W))

    def bn(t, m):
        return F.batch_norm(t, m.running_mean, m.running_var, m.weight, m.bias, eps=m.eps)

    m = x[:, 1:].transpose(1, 2).reshape(2, C, H, W)
    h = F.hardswish(bn(F.conv2d(m, ffn.expand.weight), ffn.bn1))
    h = F.hardswish(bn(F.conv2d(h, ffn.dwconv.weight, padding=1, groups=g * C), ffn.bn2))
    fc1, fc2 = ffn.attn.fc[0], ffn.attn.fc[2]
    s = F.relu(h.mean((2, 3)) @ fc1.weight.T + fc1.bias) @ fc2.weight.T + fc2.bias
    h = h * (F.relu6(s + 3) / 6)[:, :, None, None]
    ref = bn(F.conv2d(h, ffn.project.weight), ffn.bn3).flatten(2).transpose(1, 2)
    torch.testing.assert_close(out[:, 1:], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))  # the class token skips it
    assert fc1.out_features == g * C // 8  # the reduction divides the expanded width


@pytest.mark.parametrize("attn", ["se", "eca", None])
def test_token_layout_equals_map_layout_in_training_and_eval(attn):
    # forward() runs on tokens (1x1 convs as matmuls, BatchNorm folded in eval); forward_map()
    # runs the layers as the authors' nn.Sequential does.
    torch.manual_seed(0)
    a = LocalityFeedForward(6, 24, channel_attn=attn, reduction=4)
    _randomise(a)
    b = LocalityFeedForward(6, 24, channel_attn=attn, reduction=4)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4 * 5, 6, requires_grad=True)
    for train in (True, False):
        a.train(train), b.train(train)
        y = a(x, (4, 5))
        ref = b.forward_map(x.transpose(1, 2).reshape(3, 6, 4, 5)).flatten(2).transpose(1, 2)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for ma, mb in zip(a.modules(), b.modules(), strict=True):
        if isinstance(ma, nn.BatchNorm2d):  # the same running statistics were kept
            torch.testing.assert_close(ma.running_var, mb.running_var)
    g1 = torch.autograd.grad(a.train()(x, (4, 5)).square().sum(), x)[0]
    g2 = torch.autograd.grad(
        b.train().forward_map(x.transpose(1, 2).reshape(3, 6, 4, 5)).square().sum(), x
    )[0]
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_channel_attention_options():
    eca = LocalityFeedForward(192, 768, channel_attn="eca")
    assert eca.attn.conv.kernel_size == (5,) and isinstance(eca.attn.gate, nn.Sigmoid)
    assert isinstance(LocalityFeedForward(8, 16, channel_attn="eca_hs").attn.gate, nn.Hardsigmoid)
    nodw = LocalityFeedForward(8, 16, channel_attn=None, depthwise=False, act="relu6")
    assert nodw.dwconv is None and nodw.attn is None and isinstance(nodw.act1, nn.ReLU6)
    assert len(nodw.layers()) == 5
    with pytest.raises(ValueError, match="channel_attn"):
        LocalityFeedForward(8, 16, channel_attn="cbam")


def test_block_with_locality_ffn_has_no_norm_or_drop_path_on_it():
    blk = Block(8, 2, mlp_layer=locality_ffn(reduction=4), drop_path=0.2)
    assert isinstance(blk.norm2, nn.Identity) and isinstance(blk.drop_path2, nn.Identity)
    assert not isinstance(blk.drop_path1, nn.Identity)


def test_ablation_keywords_reach_every_table():
    m = lgvit.create_model(
        "localvit_tiny", ffn_act="relu6", ffn_channel_attn=None, ffn_layers=range(0, 4),
        img_size=64,
    )  # fmt: skip
    kinds = [type(b.mlp) for b in m.blocks]
    assert kinds == [LocalityFeedForward] * 4 + [Mlp] * 8
    assert isinstance(m.blocks[0].mlp.act1, nn.ReLU6) and m.blocks[0].mlp.attn is None
    assert isinstance(m.blocks[0].norm2, nn.Identity) and isinstance(
        m.blocks[5].norm2, nn.LayerNorm
    )
    g6 = meta("localvit_tiny", ffn_expansion=6)
    assert g6.blocks[0].mlp.expand.out_channels == 6 * 192
    with pytest.raises(ValueError, match="ffn_layers"):
        lgvit.create_model("localvit_tiny", ffn_layers=[12], img_size=64)


def _authors_layout(sd: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Our DeiT-based LocalViT state dict written the way the authors' code stores it: one
    fused qkv (ours too), and the feed-forward as nn.Sequential indices (an independent
    inverse)."""
    out = {}
    for k, v in sd.items():
        if ".mlp." in k:
            blk, rest = k.split(".mlp.", 1)
            name, param = rest.split(".", 1)
            ffn = model.get_submodule(f"{blk}.mlp")
            idx = ffn.layers().index(getattr(ffn, name))
            out[f"{blk}.conv.conv.{idx}.{param}"] = v
        else:
            out[k] = v
    return out


def test_authors_layout_loads_with_identical_outputs(tmp_path):
    torch.manual_seed(0)
    m = lgvit.create_model("localvit_tiny", img_size=64).eval()
    _randomise(m)
    theirs = _authors_layout(m.state_dict(), m)
    assert "blocks.0.conv.conv.6.fc.0.weight" in theirs  # the SE layer sits at index 6
    torch.save(theirs, tmp_path / "localvit_tiny.pth")
    loaded = lgvit.create_model(
        "localvit_tiny", img_size=64, checkpoint_path=str(tmp_path / "localvit_tiny.pth")
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name", sorted(json.loads(FIXTURE.read_text())) if FIXTURE.exists() else []
)
def test_authors_key_names_and_shapes_load_strictly(name, tmp_path):
    # Facts taken from the authors' models (their code, built once): every key and shape of
    # their state dicts. A random state dict of exactly that layout must load into ours.
    keys = json.loads(FIXTURE.read_text())[name]
    g = torch.Generator().manual_seed(0)
    sd = {k: 0.02 * torch.randn(shape, generator=g) for k, shape in keys}
    for k in sd:
        if k.endswith("running_var"):
            sd[k] = sd[k].abs() + 0.5
        if k.endswith(("relative_position_index", "num_batches_tracked")):
            sd[k] = torch.zeros(dict(keys)[k], dtype=torch.long)
        if k.endswith("attn_mask"):
            sd[k] = torch.zeros(dict(keys)[k])
    torch.save(sd, tmp_path / f"{name}.pth")
    m = lgvit.create_model(name, checkpoint_path=str(tmp_path / f"{name}.pth")).eval()
    with torch.no_grad():
        assert torch.isfinite(m(torch.randn(1, 3, 224, 224))).all()
