"""The shared model core: layers against direct computations, and timm's interface."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lgvit
from lgvit.checkpoints.files import save_checkpoint
from lgvit.core.errors import LgvitError
from lgvit.inference import load_model
from lgvit.models.layers import (
    Attention,
    Block,
    Mlp,
    RelativePositionBias,
    Stage,
    WindowAttention,
    drop_path_schedule,
    feature_take_indices,
    resize_pos_embed,
    resize_rel_pos_table,
)


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LEGACY = Path(__file__).parent / "fixtures" / "lsa_legacy.json"
LEGACY_MAKER = _load_module(LEGACY.with_name("make_lsa_legacy.py"))


def _reference_attention(q, k, v, heads, bias=None):
    """softmax(q k^T / sqrt(d) + bias) v per head, written out."""
    B, N, C = q.shape
    d = C // heads
    q = q.view(B, N, heads, d).transpose(1, 2)
    k = k.view(B, k.shape[1], heads, d).transpose(1, 2)
    v = v.view(B, v.shape[1], heads, d).transpose(1, 2)
    a = q @ k.transpose(-1, -2) / math.sqrt(d)
    if bias is not None:
        a = a + bias
    return (a.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C)


def _q_kv(att, x):
    """An attention's queries and keys/values of ``x``, as two matmuls from its weights: the
    fused ``qkv``'s rows are q's, then kv's (the layout lgvit stored as ``q`` and ``kv``)."""
    if not att.fused:
        return att.q(x), att.kv(x)
    c = att.num_heads * att.head_dim
    w, b = att.qkv.weight, att.qkv.bias
    return F.linear(x, w[:c], None if b is None else b[:c]), F.linear(
        x, w[c:], None if b is None else b[c:]
    )


def _old_layout(model):
    """``model``'s state dict as lgvit wrote it before the fused projection: every attention's
    ``qkv`` as ``q`` (its first num_heads * head_dim rows) and ``kv`` (the rest)."""
    out = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, Attention) and m.fused:
            for part in ("weight", "bias"):
                fused = out.pop(f"{name}.qkv.{part}", None)
                if fused is not None:
                    c = m.num_heads * m.head_dim
                    out[f"{name}.q.{part}"], out[f"{name}.kv.{part}"] = fused[:c], fused[c:]
    return out


# ------------------------------------------------------------------------------ layers


def test_spatial_reduction_attention_matches_reference():
    torch.manual_seed(0)
    att = Attention(16, 2, sr_ratio=2).eval()
    x = torch.randn(2, 6 * 4, 16)
    m = x.transpose(1, 2).reshape(2, 16, 6, 4)
    red = att.norm(att.sr(m).flatten(2).transpose(1, 2))  # (2, 3*2, 16)
    k, v = att.kv(red).split(16, dim=-1)
    ref = att.proj(_reference_attention(att.q(x), k, v, 2))
    torch.testing.assert_close(att(x, (6, 4)), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="grid"):
        att(x)


def test_relative_position_bias_matches_explicit_offsets():
    torch.manual_seed(0)
    H, W, heads = 3, 4, 2
    rpb = RelativePositionBias((H, W), heads)
    table = rpb.relative_position_bias_table
    bias = rpb()
    for i in range(H * W):
        for j in range(H * W):
            dy = i // W - j // W
            dx = i % W - j % W
            row = (dy + H - 1) * (2 * W - 1) + (dx + W - 1)
            torch.testing.assert_close(bias[:, i, j], table[row])
    att = Attention(8, heads, rel_pos_grid=(H, W)).eval()
    x = torch.randn(2, H * W, 8)
    q, kv = _q_kv(att, x)
    k, v = kv.split(8, dim=-1)
    ref = att.proj(_reference_attention(q, k, v, heads, att.rel_pos()))
    torch.testing.assert_close(att(x, (H, W)), ref, rtol=1e-5, atol=1e-5)


def test_fused_query_key_value_projection_equals_separate_projections():
    # One stored qkv Linear (grouped heads: kv narrower than q) against the two projections
    # lgvit stored before (q, then kv, each its own matmul): the same outputs, and the fused
    # weight's gradient is the separate weights' gradients stacked.
    torch.manual_seed(0)
    att = Attention(12, 6, kv_heads=2).double()
    assert att.fused and not hasattr(att, "q") and att.qkv.weight.shape == (12 + 8, 12)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    out = att(x)
    out.square().sum().backward()
    wq, wkv = (t.detach().clone().requires_grad_() for t in att.qkv.weight.split([12, 8]))
    bq, bkv = (t.detach().clone().requires_grad_() for t in att.qkv.bias.split([12, 8]))
    k, v = (
        t.view(2, 5, 2, 2).repeat_interleave(3, 2).reshape(2, 5, 12)
        for t in F.linear(x, wkv, bkv).split(4, dim=-1)
    )  # query head h reads kv head h // 3
    ref = att.proj(_reference_attention(F.linear(x, wq, bq), k, v, 6))
    torch.testing.assert_close(out, ref)
    ref.square().sum().backward()
    torch.testing.assert_close(att.qkv.weight.grad, torch.cat([wq.grad, wkv.grad]))
    torch.testing.assert_close(att.qkv.bias.grad, torch.cat([bq.grad, bkv.grad]))


@pytest.mark.parametrize("name", ["deit_tiny", "swin_tiny", "lit_ti", "pvt_tiny", "tnt_tiny",
                                  "t2t_vit_7", "localvit_tiny", "lsa_micro_cifar"])  # fmt: skip
def test_a_seed_gives_the_weights_it_gave_before_the_fusion(name, monkeypatch):
    # Built with separate q and kv (as lgvit did before), the same seed draws the same values
    # into them and leaves the random stream where the fused model leaves it.
    import lgvit

    torch.manual_seed(0)
    fused = lgvit.create_model(name).state_dict()
    after = torch.get_rng_state()
    monkeypatch.setattr(Attention, "fuse_qkv", False)
    torch.manual_seed(0)
    model = lgvit.create_model(name)
    assert torch.equal(torch.get_rng_state(), after)
    separate = model.state_dict()
    assert any(k.endswith(".q.weight") for k in separate) and fused.keys() != separate.keys()
    for k, v in fused.items():
        head, _, part = k.rpartition(".qkv.")
        want = (torch.cat([separate[f"{head}.q.{part}"], separate[f"{head}.kv.{part}"]])
                if head else separate[k])  # fmt: skip
        assert torch.equal(v, want), k


def test_either_qkv_layout_loads_into_either_attention():
    # The load hook: lgvit's older q + kv into the fused qkv, and a fused qkv (timm's, the
    # authors') into spatial-reduction attention, which keeps q and kv (other tokens).
    torch.manual_seed(0)
    fused, reduced = Attention(12, 6, kv_heads=2), Attention(12, 6, kv_heads=2, sr_ratio=2)
    assert not reduced.fused and not hasattr(reduced, "qkv")
    sd = fused.state_dict()
    old = {k: v for k, v in sd.items() if not k.startswith("qkv.")}
    for part in ("weight", "bias"):
        old[f"q.{part}"], old[f"kv.{part}"] = sd[f"qkv.{part}"].split([12, 8])
    again = Attention(12, 6, kv_heads=2)
    again.load_state_dict(old)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in sd.items())
    theirs = {k: v for k, v in reduced.state_dict().items() if k[:2] not in ("q.", "kv")}
    reduced.load_state_dict({**theirs, "qkv.weight": sd["qkv.weight"], "qkv.bias": sd["qkv.bias"]})
    assert torch.equal(torch.cat([reduced.q.weight, reduced.kv.weight]), sd["qkv.weight"])
    assert torch.equal(torch.cat([reduced.q.bias, reduced.kv.bias]), sd["qkv.bias"])


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("deit_tiny", {"img_size": 32}),
        ("localvit_tiny", {"img_size": 32}),
        ("swin_tiny", {"depths": (2, 2, 2, 2)}),
        ("lit_ti", {"img_size": 64}),
        ("lit_s", {"depths": (1, 1, 2, 1)}),
        ("pvt_tiny", {"img_size": 64}),  # q + kv in stages 1-3, qkv in stage 4
        ("tnt_tiny", {"img_size": 32}),
        ("lsa_tiny_cifar", {}),  # multi-query global attention, q + kv in the local block
    ],
)
def test_checkpoints_with_separate_q_and_kv_load_with_identical_outputs(name, kwargs):
    # lgvit's checkpoints before the fused projection: same parameter count, same outputs.
    torch.manual_seed(0)
    m = lgvit.create_model(name, num_classes=5, **kwargs).eval()
    old = _old_layout(m)
    assert any(".attn.q." in k for k in old), name
    torch.manual_seed(1)
    again = lgvit.create_model(name, num_classes=5, **kwargs).eval()
    again.load_state_dict(old)
    size = m.pretrained_cfg["input_size"][1:]
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        assert torch.equal(again(x), m(x)), name
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in m.parameters())


def test_relative_table_resized_on_load():
    torch.manual_seed(0)
    small, big = RelativePositionBias(4, 2), RelativePositionBias(6, 2)
    big.load_state_dict(small.state_dict())
    want = resize_rel_pos_table(small.relative_position_bias_table.detach(), (4, 4), (6, 6))
    torch.testing.assert_close(big.relative_position_bias_table.detach(), want)
    assert want.shape == (11 * 11, 2)


def test_window_attention_matches_per_window_reference_and_caches_mask():
    torch.manual_seed(0)
    H = W = 8
    w, s, heads, C = 4, 2, 2, 8
    att = WindowAttention(C, heads, window=w, shift=s).eval()
    x = torch.randn(2, H * W, C)
    out = att(x, (H, W))
    # Reference: roll, then for every window attend among its tokens, masking tokens that came
    # from different regions of the un-rolled map; roll back.
    xr = torch.roll(x.view(2, H, W, C), (-s, -s), (1, 2))
    region = torch.zeros(H, W, dtype=torch.long)
    for a, hs in enumerate((slice(0, -w), slice(-w, -s), slice(-s, None))):
        for b, ws in enumerate((slice(0, -w), slice(-w, -s), slice(-s, None))):
            region[hs, ws] = 3 * a + b
    ref = torch.empty_like(xr)
    bias = att.rel_pos()
    for i in range(0, H, w):
        for j in range(0, W, w):
            t = xr[:, i : i + w, j : j + w].reshape(2, w * w, C)
            r = region[i : i + w, j : j + w].reshape(-1)
            mask = (r[:, None] != r[None, :]).float() * -100.0
            q, kv = _q_kv(att, t)
            k, v = kv.split(C, dim=-1)
            y = att.proj(_reference_attention(q, k, v, heads, bias + mask))
            ref[:, i : i + w, j : j + w] = y.view(2, w, w, C)
    ref = torch.roll(ref, (s, s), (1, 2)).reshape(2, H * W, C)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert att._mask((H, W), x.device) is att._mask((H, W), x.device)  # built once


def test_masks_and_bias_indices_are_built_once_per_grid(monkeypatch):
    # Swin's shift mask and a relative-position index of another grid (LIT's whole-map bias
    # at another input size): built once for two forwards, the outputs as when rebuilt.
    import lgvit.models.layers.attention as attention
    import lgvit.models.layers.window as window

    built = {"mask": 0, "index": 0}

    def spy(name, fn):
        def counted(*args):
            built[name] += 1
            return fn(*args)

        return counted

    torch.manual_seed(0)
    win = WindowAttention(8, 2, window=4, shift=2).eval()
    glob = Attention(8, 2, rel_pos_grid=(3, 4)).eval()
    x, y = torch.randn(2, 64, 8), torch.randn(2, 20, 8)
    want = win(x, (8, 8)), glob(y, (4, 5))  # rebuilt: a fresh module's first call
    win._masks.clear(), glob.rel_pos._indices.clear()
    monkeypatch.setattr(window, "shifted_window_mask", spy("mask", window.shifted_window_mask))
    monkeypatch.setattr(
        attention, "relative_position_index", spy("index", attention.relative_position_index)
    )
    for _ in range(2):
        assert torch.equal(win(x, (8, 8)), want[0]) and torch.equal(glob(y, (4, 5)), want[1])
    assert built == {"mask": 1, "index": 1}
    assert not any("_indices" in k or "_masks" in k for k in glob.state_dict())


def test_a_mask_per_window_repeats_over_the_images_in_every_attention_path():
    # Swin hands one mask per window (P, 1, N, N) for B = images x P windows, image-major.
    from lgvit.models.layers.attention import attention_probs, multihead_sdpa, per_sample_mask

    torch.manual_seed(0)
    B, P, N, heads, d = 6, 3, 5, 2, 4
    q, k, v = (torch.randn(B, N, heads * d, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(P, 1, N, N, dtype=torch.float64)
    split = [t.view(B, N, heads, d).transpose(1, 2) for t in (q, k, v)]
    want = torch.stack([
        F.scaled_dot_product_attention(*(t[b] for t in split), attn_mask=mask[b % P])
        for b in range(B)
    ]).transpose(1, 2).reshape(B, N, heads * d)  # fmt: skip
    torch.testing.assert_close(multihead_sdpa(q, k, v, heads, attn_mask=mask), want)  # explicit
    fused = F.scaled_dot_product_attention(*split, attn_mask=per_sample_mask(mask, B))
    torch.testing.assert_close(fused.transpose(1, 2).reshape(B, N, heads * d), want)
    probs = attention_probs(q, k, heads, attn_mask=mask)
    logits = split[0] @ split[1].transpose(-1, -2) / d**0.5
    want_p = torch.stack([(logits[b] + mask[b % P]).softmax(-1) for b in range(B)])
    torch.testing.assert_close(probs.double(), want_p, rtol=1e-5, atol=1e-6)
    assert per_sample_mask(mask[:1], B) is not None and per_sample_mask(None, B) is None


def test_mlp_only_block_and_feed_forward_without_norm():
    torch.manual_seed(0)
    blk = Block(8, attn_layer=None, mlp_ratio=2)
    assert blk.attn is None
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(blk(x), x + blk.mlp(blk.norm2(x)))

    class GridFeedForward(Mlp):
        pre_norm = False
        drop_path = False

        def forward(self, x, hw=None):
            assert hw == (1, 5)
            return super().forward(x)

    blk = Block(8, 2, mlp_layer=GridFeedForward, drop_path=0.5).train()
    assert isinstance(blk.norm2, nn.Identity) and isinstance(blk.drop_path2, nn.Identity)
    blk(x, (1, 5))


def test_resize_pos_embed_keeps_prefix_tokens():
    pos = torch.randn(1 + 16, 4)
    out = resize_pos_embed(pos, (4, 4), (8, 6), num_prefix_tokens=1, mode="bilinear")
    assert out.shape == (1 + 48, 4)
    torch.testing.assert_close(out[0], pos[0])
    grid = pos[1:].reshape(1, 4, 4, 4).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(8, 6), mode="bilinear", align_corners=False)
    torch.testing.assert_close(out[1:], want.permute(0, 2, 3, 1).reshape(48, 4))


def test_feature_indices_and_drop_path_schedule():
    assert feature_take_indices(4) == [0, 1, 2, 3]
    assert feature_take_indices(4, 2) == [2, 3]
    assert feature_take_indices(4, [0, -1]) == [0, 3]
    for bad in ([4], [-5], 5, 0):
        with pytest.raises(ValueError, match="out of range|asks for"):
            feature_take_indices(4, bad)
    sched = drop_path_schedule(0.3, [1, 2, 1])
    assert [len(s) for s in sched] == [1, 2, 1]
    assert sched[0][0] == 0.0 and sched[-1][-1] == pytest.approx(0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drop_path_zeroes_whole_samples_and_scales_the_rest_by_exactly_one_over_keep(dtype):
    from lgvit.models.layers.drop import drop_path

    torch.manual_seed(0)
    x = (torch.rand(4000, 3, 16) + 0.5).to(dtype)
    out = drop_path(x, 0.1, training=True)
    kept = out.flatten(1).ne(0).all(1)
    assert torch.equal(out.flatten(1).eq(0).all(1), ~kept)  # whole samples, nothing partial
    assert 0.08 < 1 - kept.float().mean() < 0.12
    ratio = out[kept].double() / x[kept].double()
    # unbiased: 1/0.9 in bf16 (1.109375) would sit 0.16% low; rounding is 2^-9 per element
    assert abs(ratio.mean().item() * 0.9 - 1) < 2e-4, ratio.mean()
    assert drop_path(x, 0.1, training=False) is x


def _unfused_block(blk, x, hw=None):
    """The block as lgvit wrote it before the fused residual: ``x + drop_path(branch)``."""
    if blk.attn is not None:
        x = x + blk.drop_path1(blk.attn(blk.norm1(x), hw))
    return x + blk.drop_path2(blk.mlp(blk.norm2(x), hw))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_fused_residual_and_drop_path_equal_the_unfused_form(train, amp):
    # The same random draws (one seed), the same outputs and gradients, train and eval, in
    # float32 and under bf16 autocast (there the residual stream stays float32).
    from lgvit.models.layers import residual_add

    torch.manual_seed(0)
    blk = Block(16, 2, drop_path=0.5).train(train)
    x0 = torch.randn(8, 5, 16)
    outs, grads = [], []
    for form in (blk.forward, lambda x: _unfused_block(blk, x)):
        x = x0.clone().requires_grad_()
        blk.zero_grad()
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
            out = form(x)
        assert out.dtype == torch.float32
        out.square().sum().backward()
        outs.append(out)
        grads.append([x.grad, *(p.grad for p in blk.parameters())])
    # bf16: the unfused form rounded the scaled branch to bf16 (x * mask / keep); the fused
    # one scales in float32
    tol = {} if amp is None else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():  # training: the drop path acted (equal outputs: the same draws)
        plain = _unfused_block(blk.eval(), x0)
    assert train != torch.allclose(outs[0], plain, rtol=0.05, atol=0.05)
    y = torch.randn(8, 5, 16, dtype=torch.bfloat16)
    torch.manual_seed(2)
    fused = residual_add(x0, y, 0.5, True)
    torch.manual_seed(2)
    mask = torch.empty(8, 1, 1, dtype=torch.bfloat16).bernoulli_(0.5)  # drawn as drop_path does
    torch.testing.assert_close(fused, x0 + y.float() * mask.float() / 0.5)  # exact scale
    assert fused.dtype == torch.float32 and torch.equal(residual_add(x0, y, 0.5, False), x0 + y)


class _BatchNormBlock(nn.Module):
    """A block with BatchNorm inside, called (x, hw) like every block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x, hw=None):
        return x + self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2)


def test_checkpointing_counts_batchnorm_statistics_once():
    torch.manual_seed(0)
    stages = []
    for enable in (False, True):
        torch.manual_seed(0)
        st = Stage([_BatchNormBlock(6), _BatchNormBlock(6)]).train()
        st.grad_checkpointing = enable
        x = torch.randn(4, 5, 6, requires_grad=True)
        st(x, (1, 5))[0].sum().backward()
        stages.append(st)
    for a, b in zip(stages[0].modules(), stages[1].modules(), strict=True):
        if isinstance(a, nn.BatchNorm1d):
            torch.testing.assert_close(b.running_mean, a.running_mean)
            torch.testing.assert_close(b.running_var, a.running_var)
            assert a.num_batches_tracked == b.num_batches_tracked == 1


def test_grad_checkpointing_keeps_fewer_activations():
    def saved_bytes(model, x):
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in seen:
                seen.add(key)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum().backward()
        return total[0]

    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar").train()
    x = torch.randn(8, 3, 32, 32)
    plain = saved_bytes(m, x)
    m.set_grad_checkpointing(True)
    ckpt = saved_bytes(m, x)
    assert ckpt < 0.8 * plain, (ckpt, plain)


# ------------------------------------------------------------------------- checkpoints


def test_checkpoints_from_before_the_core_load_with_identical_outputs():
    # Recorded from lgvit before the shared core (tests/fixtures/make_lsa_legacy.py): the old key
    # names and shapes of six small LSA configurations, and their float64 logits with weights
    # filled from an integer hash. Today's models take the old keys and give the same logits.
    fixture = json.loads(LEGACY.read_text())
    models = fixture["models"]
    assert len(models) == 6
    x = LEGACY_MAKER.legacy_input()
    for name, rec in models.items():
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in rec["kwargs"].items()}
        m = lgvit.create_model(name, num_classes=fixture["num_classes"], **kwargs).double().eval()
        old = {k: LEGACY_MAKER.fill(k, s, d, i) for i, (k, s, d) in enumerate(rec["keys"])}
        res = m.load_state_dict(old)
        assert not res.missing_keys and not res.unexpected_keys, name
        with torch.no_grad():
            y = m(x)
        want = torch.tensor(rec["logits"], dtype=torch.float64)
        torch.testing.assert_close(y, want, rtol=1e-9, atol=1e-10, msg=name)


def test_create_model_checkpoint_path_carries_normalisation(tmp_path):
    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar", num_classes=3, img_size=16).eval()
    meta = {
        "model": "lsa_micro_cifar", "img_size": "16", "classes": json.dumps(["a", "b", "c"]),
        "mean": json.dumps([0.5, 0.5, 0.5]), "std": json.dumps([0.5, 0.5, 0.5]),
    }  # fmt: skip
    save_checkpoint(tmp_path / "best", m.state_dict(), {"step": 0}, metadata=meta)
    loaded = lgvit.create_model("lsa_micro_cifar", checkpoint_path=str(tmp_path / "best"))
    cfg = loaded.pretrained_cfg
    assert cfg["mean"] == (0.5, 0.5, 0.5) and cfg["label_names"] == ["a", "b", "c"]
    assert cfg["input_size"] == (3, 16, 16) and cfg["num_classes"] == 3
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), m(x))
    ready = load_model(str(tmp_path / "best"), device="cpu")
    assert not ready.training and ready.pretrained_cfg["std"] == (0.5, 0.5, 0.5)
    with pytest.raises(LgvitError, match="no released classification weights to download"):
        lgvit.create_model("lsa_micro_cifar", pretrained=True)
    with pytest.raises(LgvitError, match="3-class head"):
        lgvit.create_model(
            "lsa_micro_cifar", num_classes=10, checkpoint_path=str(tmp_path / "best")
        )
    torch.save({"model": {"nope": torch.zeros(1)}}, tmp_path / "bad.pth")
    with pytest.raises(LgvitError, match=r"bad.pth does not fit model lsa_micro_cifar"):
        lgvit.create_model("lsa_micro_cifar", checkpoint_path=str(tmp_path / "bad.pth"))
    with pytest.raises(LgvitError, match="no model name"):
        load_model(str(tmp_path / "bad.pth"))
    if not torch.cuda.is_available():
        with pytest.raises(LgvitError, match="CUDA is not available"):
            load_model(str(tmp_path / "best"), device="cuda")


# ------------------------------------------------------------------- timm's interface


def test_forward_intermediates_full_signature():
    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = m.forward_intermediates(x)
        assert [tuple(f.shape) for f in maps] == [(2, 64, 16, 16), (2, 128, 8, 8), (2, 160, 4, 4)]
        nhwc = m.forward_intermediates(
            x, indices=[0, -1], output_fmt="NHWC", intermediates_only=True
        )
        torch.testing.assert_close(nhwc[0], maps[0].permute(0, 2, 3, 1))
        early = m.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        torch.testing.assert_close(early[0], maps[1])
        normed = m.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)
        want = m.norm(maps[-1].flatten(2).transpose(1, 2)).transpose(1, 2).reshape(2, 160, 4, 4)
        torch.testing.assert_close(normed[0], want)
    with pytest.raises(ValueError, match="out of range"):
        m.forward_intermediates(x, indices=[3])
    with pytest.raises(ValueError, match="output_fmt"):
        m.forward_intermediates(x, output_fmt="NCWH")


def test_prune_intermediate_layers():
    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar").eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        want = m.forward_intermediates(x, indices=[1], intermediates_only=True)
    assert m.prune_intermediate_layers([1], prune_norm=True) == [1]
    assert len(m.stages) == 2 and isinstance(m.head, nn.Identity)
    with torch.no_grad():
        got = m.forward_intermediates(x, indices=[1], intermediates_only=True)
    torch.testing.assert_close(got[0], want[0])


def test_explicit_attention_path_matches_the_fused_kernel(monkeypatch):
    # bf16 on the CPU takes the explicit matmul path in training (faster backward) and, without
    # AMX, in inference too; with AMX inference stays fused. Same maths.
    from lgvit.models.layers import attention as A
    from lgvit.models.layers.attention import _explicit_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(1, 3, 7, 7, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(_explicit_attention(q, k, v, mask, 0.0, 0.3), want)
    att = Attention(16, 4, kv_heads=2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train = att(x)  # grad enabled, bf16: the explicit path
        with torch.no_grad():
            monkeypatch.setattr(A, "_amx", lambda: True)
            infer = att(x)  # the fused kernel
            monkeypatch.setattr(A, "_amx", lambda: False)
            assert torch.equal(att(x), train.detach())  # explicit, as in training
    torch.testing.assert_close(train.float(), infer.float(), rtol=0.02, atol=0.02)
    assert not torch.equal(train.detach(), infer)  # the two paths did run
