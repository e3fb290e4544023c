"""T2T-ViT-7 and TNT-T (and their LocalViT variants): the tokens-to-token geometry, the
performer against its formula, the fixed random features, the logit scales, TNT's per-patch
inner attention, and the authors' checkpoint layouts written by an independent inverse."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn

import lgvit
from lgvit.models.layers import LocalityFeedForward, Mlp
from lgvit.models.t2t import TokenPerformer, TokensToToken
from lgvit.models.tnt import TNTBlock

NAMES = ["t2t_vit_7", "localvit_t2t_vit_7", "tnt_tiny", "localvit_tnt_tiny"]


def _randomise(module: nn.Module, seed: int = 0) -> None:
    """Every float tensor random (BatchNorm variances positive); performer features kept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if name.endswith(".w") or not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith("pos_embed") and not t.requires_grad:
                continue  # the fixed sinusoid
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.05)


@pytest.mark.parametrize(
    "size, grid", [(224, (14, 14)), (64, (4, 4)), ((64, 96), (4, 6)), (16, (1, 1))]
)
def test_tokens_to_token_geometry(size, grid):
    # 224 -> 56 (7x7/4) -> 28 (3x3/2) -> 14 (3x3/2): one token a 16x16 area
    t2t = TokensToToken(224, 3, 32, token_dim=8)
    assert t2t.grid_for(size) == grid
    h, w = (size, size) if isinstance(size, int) else size
    tokens, hw = t2t(torch.randn(1, 3, h, w))
    assert hw == grid and tokens.shape == (1, grid[0] * grid[1], 32)


def test_tokens_to_token_rejects_a_too_small_input():
    with pytest.raises(ValueError, match="too small"):
        TokensToToken(224, 3, 32).grid_for(0)


def test_performer_is_linear_attention_with_positive_random_features():
    torch.manual_seed(0)
    p = TokenPerformer(12, 8, drop=0.0).double().eval()
    x = torch.randn(2, 10, 12, dtype=torch.double)
    k, q, v = p.kqv(p.norm1(x)).split(8, dim=-1)

    def phi(t):  # exp(w.t - |t|^2 / 2) / sqrt(m): E[phi(q).phi(k)] = exp(q.k)
        return torch.exp(t @ p.w.double().T - (t * t).sum(-1, keepdim=True) / 2) / math.sqrt(p.m)

    a = phi(q) @ phi(k).transpose(1, 2)  # (B, T, T) un-normalised kernel weights, all > 0
    assert (a > 0).all()
    y = v + p.proj((a / a.sum(-1, keepdim=True)) @ v)
    ref = y + p.mlp(p.norm2(y))
    # the features run in float32 (an exponential), whatever the input dtype
    torch.testing.assert_close(p(x, (2, 5)), ref, rtol=1e-5, atol=1e-6)
    assert p.m == 4 and p.w.shape == (4, 8)  # kernel ratio 0.5


def test_performer_attention_runs_in_float32_under_autocast():
    torch.manual_seed(0)
    p = TokenPerformer(12, 8)
    k, q, v = (2 * torch.randn(3, 1, 10, 8)).bfloat16()  # as the projection gives them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = p._attend(k, q, v)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, p._attend(k.float(), q.float(), v.float()), rtol=0, atol=0)


def test_performer_features_are_fixed_orthogonal_and_loaded_from_checkpoints(tmp_path):
    torch.manual_seed(0)
    a = lgvit.create_model("t2t_vit_7", img_size=64)
    torch.manual_seed(1)
    b = lgvit.create_model("t2t_vit_7", img_size=64)
    w = a.patch_embed.attention1.w
    assert not torch.equal(w, b.patch_embed.attention1.w)
    rows = w / w.norm(dim=1, keepdim=True)  # orthogonal rows scaled by sqrt(m)
    torch.testing.assert_close(rows @ rows.T, torch.eye(w.shape[0]), atol=1e-5, rtol=0)
    torch.save(a.state_dict(), tmp_path / "a.pth")
    c = lgvit.create_model("t2t_vit_7", img_size=64, checkpoint_path=str(tmp_path / "a.pth"))
    assert torch.equal(c.patch_embed.attention1.w, w)
    # fixed: buffers saved under the authors' keys, so every parameter trains and gets a grad
    fixed = {"pos_embed", "patch_embed.attention1.w", "patch_embed.attention2.w"}
    assert fixed == {n for n, _ in a.named_buffers()} & set(a.state_dict())
    assert all(p.requires_grad for p in a.parameters())
    a(torch.randn(1, 3, 64, 64)).sum().backward()
    assert all(p.grad is not None for p in a.parameters())


def test_performer_feed_forward_drops_out_once():
    p = TokenPerformer(12, 8, drop=0.1)
    drops = [m for m in p.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    assert len(drops) == 2  # after the attention projection and after the feed-forward


def test_logit_scales():
    with torch.device("meta"):
        t2t = lgvit.create_model("t2t_vit_7")
        local = lgvit.create_model("localvit_t2t_vit_7")
    # T2T-ViT-7's released weights were trained with 1/sqrt(embed dim); LocalViT-T2T with
    # the usual 1/sqrt(head dim)
    assert t2t.blocks[0].attn.qk_scale == pytest.approx(256**-0.5)
    assert local.blocks[0].attn.qk_scale in (None, pytest.approx(64**-0.5))
    assert local.blocks[0].attn.qkv.bias is None


def test_localvit_t2t_feed_forwards():
    with torch.device("meta"):
        m = lgvit.create_model("localvit_t2t_vit_7")
    perf = m.patch_embed.attention1.mlp
    assert isinstance(perf, LocalityFeedForward) and perf.attn is None
    assert perf.expand.out_channels == 64 and isinstance(perf.act1, nn.Hardswish)
    blk = m.blocks[0].mlp
    assert blk.expand.out_channels == 512 and blk.attn.fc[0].out_features == 512 // 128
    assert not hasattr(m.patch_embed.attention1, "norm2")


def test_tnt_inner_attention_stays_within_a_patch():
    torch.manual_seed(0)
    blk = TNTBlock(24, 6, 4, 3, 3, 4.0, 0.0).eval()
    pixels, patches = torch.randn(6, 4, 6), torch.randn(1, 7, 24)  # 2x3 patches + class token
    out, _ = blk((pixels, patches), (2, 3))
    changed = pixels.clone()
    changed[2] += 1.0  # the third patch's pixels only
    out2, _ = blk((changed, patches), (2, 3))
    diff = (out2 - out).abs().amax(dim=(1, 2))
    assert diff[2] > 0 and torch.equal(diff[[0, 1, 3, 4, 5]], torch.zeros(5))


def test_tnt_geometry():
    m = lgvit.create_model("tnt_tiny", img_size=64).eval()
    assert m.pixel_embed.pixels == 4 and m.blocks[0].inner.attn.num_heads == 3
    (pixels, patches), hw = m.forward_stem(torch.randn(2, 3, 64, 48))
    assert hw == (4, 3) and pixels.shape == (2 * 12, 16, 12) and patches.shape == (2, 13, 192)
    assert isinstance(m.blocks[0].outer.mlp, Mlp) and m.blocks[0].inner.attn.qkv.bias is None
    local = lgvit.create_model("localvit_tnt_tiny", img_size=64)
    ffn = local.blocks[0].outer.mlp
    assert isinstance(ffn, LocalityFeedForward) and ffn.attn.fc[0].out_features == 4
    assert not isinstance(local.blocks[0].inner.mlp, LocalityFeedForward)


# --- the authors' layouts, written from ours by an independent inverse --------------------


def _ffn_to_sequential(sd: dict, model: nn.Module) -> dict:
    out = {}
    for k, v in sd.items():
        m = re.fullmatch(r"(.*)\.mlp\.(expand|bn\d|dwconv|attn|project)\.(.*)", k)
        if m is None:
            out[k] = v
            continue
        ffn = model.get_submodule(f"{m[1]}.mlp")
        idx = ffn.layers().index(getattr(ffn, m[2]))
        block = m[1].replace(".outer", "")  # TNT: the outer feed-forward sits on the block
        out[f"{block}.conv.conv.{idx}.{m[3]}"] = v
    return out


def _t2t_authors(sd: dict, model: nn.Module) -> dict:
    out = {}
    for k, v in _ffn_to_sequential(sd, model).items():  # their qkv is ours
        k = k.replace("patch_embed.", "tokens_to_token.")
        k = re.sub(r"(attention\d)\.mlp\.fc1\.", r"\1.mlp.0.", k)
        k = re.sub(r"(attention\d)\.mlp\.fc2\.", r"\1.mlp.2.", k)
        out[k] = v
    if isinstance(model.patch_embed.attention1.mlp, LocalityFeedForward):
        for i in (1, 2):  # their local performers keep an unused LayerNorm
            out[f"tokens_to_token.attention{i}.norm2.weight"] = torch.ones(64)
            out[f"tokens_to_token.attention{i}.norm2.bias"] = torch.zeros(64)
    return out


def _tnt_authors(sd: dict, model: nn.Module) -> dict:
    names = {
        "inner.norm1": "norm_in", "inner.attn": "attn_in", "inner.norm2": "norm_mlp_in",
        "inner.mlp": "mlp_in", "outer.norm1": "norm_out", "outer.attn": "attn_out",
        "outer.norm2": "norm_mlp", "outer.mlp": "mlp",
    }  # fmt: skip
    out = {}
    for k, v in _ffn_to_sequential(sd, model).items():
        if ".attn.qkv." in k:  # theirs: qk (q rows, k rows) and v
            c = v.shape[0] // 3
            out[k.replace(".attn.qkv.", ".attn.qk.")] = v[: 2 * c]
            out[k.replace(".attn.qkv.", ".attn.v.")] = v[2 * c :]
            continue
        out[k] = v
    renamed = {}
    for k, v in out.items():
        for ours, theirs in names.items():
            k = k.replace(f".{ours}.", f".{theirs}.")
        renamed[k] = v
    return renamed


@pytest.mark.parametrize("name", NAMES)
def test_authors_layout_loads_with_identical_outputs(name, tmp_path):
    torch.manual_seed(0)
    m = lgvit.create_model(name, img_size=64).eval()
    _randomise(m)
    inverse = _t2t_authors if "t2t" in name else _tnt_authors
    theirs = inverse(m.state_dict(), m)
    marker = (
        "tokens_to_token.attention1.kqv.weight" if "t2t" in name else "blocks.0.attn_in.v.weight"
    )
    assert marker in theirs
    if name.startswith("localvit"):
        assert any(".conv.conv." in k for k in theirs)
    torch.save(theirs, tmp_path / "theirs.pth")
    loaded = lgvit.create_model(name, img_size=64, checkpoint_path=str(tmp_path / "theirs.pth"))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), m(x), rtol=0, atol=0)
