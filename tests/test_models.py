"""The LSA family: parameter counts, interface, and the blocks against direct references."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import lgvit
from lgvit.models import create_model
from lgvit.models.layers import as_written, resize_pos_embed
from lgvit.models.lsa import CIFAR_SHIFTS, LocalShiftAttention, ShiftEmbedding
from lgvit.tools.measure import count_macs, count_params

# (name, paper params in M): the papers' parameter counts (docs/models.md, per family).
PAPER_PARAMS = {
    "lsa_tiny_cifar": 10.2,
    "lsa_small_cifar": 36.2,
    "lsa_base_cifar": 115.8,
    "lsa_tiny_224": 9.9,
    "lsa_small_224": 22.0,
    "lsa_tiny_cifar_a": 6.8,
    "lsa_tiny_cifar_b": 8.4,
    "lsa_tiny_cifar_c": 6.8,
    "lsa_tiny_cifar_d": 10.1,
}


def meta_model(name: str, **kw):
    with torch.device("meta"):
        return lgvit.create_model(name, **kw)


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS))
def test_param_count_matches_paper(name):
    n = count_params(meta_model(name)) / 1e6
    assert abs(n - PAPER_PARAMS[name]) / PAPER_PARAMS[name] < 0.01, f"{name}: {n:.3f}M"


def test_ablation_e_measured_and_extras_sane():
    # Paper says 7.6M for E, which its own arithmetic does not give: conv per variant (18 x
    # 5376) + one shared position embedding (1024 x 192) on top of ablation A's body.
    a = count_params(meta_model("lsa_tiny_cifar_a"))
    e = count_params(meta_model("lsa_tiny_cifar_e"))
    assert e - a == 17 * (3 * 9 * 192 + 192)
    assert 0.3e6 <= count_params(meta_model("lsa_micro_cifar")) <= 1.6e6


def test_tiny_cifar_is_multi_query_with_three_heads():
    m = meta_model("lsa_tiny_cifar")
    att = m.local_block.attn
    assert (att.num_heads, att.kv_heads) == (3, 1)
    assert m.stages[1].blocks[0].attn.kv_heads == 1
    assert m.patch_embed.num_variants == 18 and m.pos_embed.shape == (18, 1024, 192)


def test_macs_match_spec():
    # Measured MACs: lsa_tiny_224 3.62G, lsa_small_224 7.70G (the paper's FLOPs count one of
    # the T embedding convs; docs/models.md).
    for name, want in (("lsa_tiny_224", 3.62), ("lsa_small_224", 7.70)):
        got = count_macs(meta_model(name), (3, 224, 224)) / 1e9
        assert abs(got - want) / want < 0.01, f"{name}: {got:.3f}G"


@pytest.mark.parametrize("name", ["lsa_tiny_cifar", "lsa_tiny_cifar_d", "lsa_micro_cifar"])
def test_batch_of_one_matches_batch(name):
    torch.manual_seed(0)
    m = lgvit.create_model(name).eval()
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        full = m(x)
        singles = torch.cat([m(x[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(singles, full, rtol=1e-4, atol=1e-5)


def test_shift_embedding_matches_roll_and_conv_per_variant():
    torch.manual_seed(0)
    emb = ShiftEmbedding(CIFAR_SHIFTS, 3, 8, kernel_size=3, stride=1, padding=1)
    x = torch.randn(2, 3, 7, 6)
    x0, out, grid = emb(x)
    out = out.materialize()
    assert grid == (7, 6) and out.shape == (18, 2, 42, 8)
    for t, (dy, dx) in enumerate(CIFAR_SHIFTS):
        w, b = emb.conv_weight(t)
        ref = F.conv2d(torch.roll(x, (dy, dx), (2, 3)), w, b, padding=1)
        torch.testing.assert_close(out[t], ref.flatten(2).transpose(1, 2))
    torch.testing.assert_close(x0, out[0])


def test_shift_embedding_stride_matches_reference():
    torch.manual_seed(0)
    shifts = ((0, 0), (1, 0), (3, 3), (0, 2))
    emb = ShiftEmbedding(shifts, 3, 4, kernel_size=9, stride=7, padding=1)
    x = torch.randn(1, 3, 30, 30)
    x0, out, grid = emb(x)
    out = out.materialize()
    for t, s in enumerate(shifts):
        w, b = emb.conv_weight(t)
        ref = F.conv2d(torch.roll(x, s, (2, 3)), w, b, stride=7, padding=1)
        torch.testing.assert_close(out[t], ref.flatten(2).transpose(1, 2))


def test_shift_index_cached_under_inference_mode_is_not_reused_by_autograd():
    """The cached gather index: one built inside ``inference_mode`` cannot be saved for backward,
    so a later call that needs input gradients (saliency; torch.compile's bf16 training graph)
    must get its own."""
    torch.manual_seed(0)
    model = create_model("lsa_micro_cifar").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = model(x)
    x.requires_grad_(True)
    out = model(x)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected)
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_reflection_shift_embedding_matches_reference():
    torch.manual_seed(0)
    emb = ShiftEmbedding(CIFAR_SHIFTS, 3, 5, conv_per_variant=False)
    x = torch.randn(2, 3, 8, 8)
    x0, out, _ = emb(x)
    out = out.materialize()
    w, b = emb.conv_weight(0)
    for t, (dy, dx) in enumerate(CIFAR_SHIFTS):
        # Translate by (dy, dx) with reflection padding: pad by 2 (reflect), crop the window.
        p = F.pad(x, (2, 2, 2, 2), mode="reflect")
        shifted = p[:, :, 2 - dy : 2 - dy + 8, 2 - dx : 2 - dx + 8]
        ref = F.conv2d(shifted, w, b, padding=1)
        torch.testing.assert_close(out[t], ref.flatten(2).transpose(1, 2))


def _random_affine(model: torch.nn.Module) -> None:
    """Non-trivial biases and LayerNorm affines (they are zeros and ones at init)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.3)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("lsa_tiny_cifar", {}),  # one K/V head, conv and position embedding per variant
        ("lsa_tiny_cifar", {"kv_heads": 3}),
        ("lsa_tiny_cifar_c", {}),  # one shared conv, one shared position embedding
        ("lsa_micro_cifar", {"img_size": 20}),  # stride 2, 9 shifts, 2 heads
    ],
)
def test_folded_local_block_matches_the_architecture_as_written(name, kwargs):
    """The folded key/value projection (LayerNorm statistics from Gram matrices, the norm and
    projection folded into the conv weight, offsets as logit bias and value correction) gives
    the outputs and the gradients of the architecture as written, in float64."""
    torch.manual_seed(0)
    kwargs = {"img_size": 12, "drop_path_rate": 0.0, **kwargs}
    m = create_model(name, **kwargs).double()
    _random_affine(m)
    x = torch.randn(3, 3, *m.img_size, dtype=torch.float64)
    grads = []
    for ctx in (contextlib.nullcontext(), as_written()):
        m.zero_grad()
        with ctx:
            y = m(x)
            (y.square().sum() + y[:, 0].sum()).backward()
        grads.append((y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (y, g), (y_ref, g_ref) = grads
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    for n, ref in g_ref.items():
        torch.testing.assert_close(g[n], ref, rtol=1e-9, atol=1e-12, msg=n)


def test_a_patch_wider_than_the_embedding_builds_the_variants():
    # lsa_tiny_224: 9x9 RGB patches (243 values) for 192 channels -- folding would cost more.
    torch.manual_seed(0)
    m = create_model("lsa_tiny_224", img_size=30).eval()
    x = torch.randn(2, 3, 30, 30)
    with torch.no_grad():
        variants = m.patch_embed(x)[1]
        assert variants.patches.shape[-1] == 243
        assert variants.fold(m.local_block.norm1, m.local_block.attn.kv) is None
        y = m(x)
        with as_written():
            torch.testing.assert_close(m(x), y)


def test_folded_local_block_under_bf16_autocast_stays_close():
    torch.manual_seed(0)
    m = create_model("lsa_tiny_cifar", img_size=16).eval()
    _random_affine(m)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        y = m(x).float()
        with as_written():
            y_ref = m(x).float()
    with torch.no_grad():
        y32 = m(x)
    # bf16 rounds both ways alike: each is as far from float32 as the other.
    assert (y - y32).abs().max() <= 2 * (y_ref - y32).abs().max() + 1e-3


def test_folded_projection_executes_fewer_macs_than_the_architecture():
    m = meta_model("lsa_tiny_cifar")
    x = torch.zeros(64, 3, 32, 32, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        m(x)
    executed = counter.get_total_flops() // 2 / 64
    counted = count_macs(m, (3, 32, 32))  # the architecture's
    # The variants' 18 embedding convs (27 x 192) and K/V projection (192 x 128) per token
    # become a 27 x 128 matmul and 27 x 27 statistics: 2.82G -> 2.37G per image at batch 64
    # (the offsets' projection, once per batch, is 0.45G).
    assert counted > 2.8e9 and executed < counted - 0.4e9


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_local_attention_matches_per_position_softmax(kv_heads):
    torch.manual_seed(0)
    att = LocalShiftAttention(12, num_heads=3, kv_heads=kv_heads).eval()
    v = torch.randn(4, 2, 5, 12)  # (T, B, N, C)
    out = att(v[0], v)
    hd = 4
    q = att.q(v[0]).view(2, 5, 3, hd)
    kv = att.kv(v.permute(1, 2, 0, 3)).view(2, 5, 4, 2, kv_heads, hd)
    ref = torch.empty(2, 5, 3, hd)
    for b in range(2):
        for n in range(5):
            for h in range(3):
                g = h // (3 // kv_heads)
                k, val = kv[b, n, :, 0, g], kv[b, n, :, 1, g]  # (T, hd)
                w = torch.softmax(k @ q[b, n, h] / math.sqrt(hd), dim=0)  # softmax over T
                ref[b, n, h] = w @ val
    ref = att.proj(ref.reshape(2, 5, 12))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_global_attention_grouped_heads_match_reference():
    from lgvit.models.layers import Attention

    torch.manual_seed(0)
    att = Attention(16, num_heads=4, kv_heads=2).eval()
    x = torch.randn(2, 6, 16)
    wq, wkv = att.qkv.weight.split([16, 16])  # the fused projection's rows: q, then k and v
    bq, bkv = att.qkv.bias.split([16, 16])
    q = F.linear(x, wq, bq).view(2, 6, 4, 4).transpose(1, 2)
    k, v = F.linear(x, wkv, bkv).view(2, 6, 2, 2, 4).permute(2, 0, 3, 1, 4)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v
    ref = att.proj(ref.transpose(1, 2).reshape(2, 6, 16))
    torch.testing.assert_close(att(x), ref, rtol=1e-5, atol=1e-5)


def test_forward_intermediates_shapes_and_feature_info():
    m = lgvit.create_model("lsa_tiny_cifar", depths=(1, 1, 1, 1)).eval()
    x = torch.randn(2, 3, 32, 32)
    final, maps = m.forward_intermediates(x)
    assert [tuple(f.shape) for f in maps] == [
        (2, 192, 32, 32), (2, 192, 16, 16), (2, 192, 8, 8), (2, 192, 4, 4)
    ]  # fmt: skip
    assert [f["reduction"] for f in m.feature_info] == [1, 2, 4, 8]
    assert [f["num_chs"] for f in m.feature_info] == [192] * 4
    torch.testing.assert_close(final, m.forward_features(x))
    last = m.forward_intermediates(x, indices=1, intermediates_only=True)
    assert len(last) == 1 and torch.equal(last[0], maps[-1])
    m224 = meta_model("lsa_small_224")
    assert [f["reduction"] for f in m224.feature_info] == [4, 8, 16]
    assert [f["num_chs"] for f in m224.feature_info] == [64, 192, 384]


def test_head_interface():
    m = lgvit.create_model("lsa_micro_cifar", num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = m.forward_features(x)
    assert m.output_fmt == "NHWC" and feats.shape == (2, 4, 4, 160)  # the final map, as timm's Swin
    assert m.forward_head(feats, pre_logits=True).shape == (2, 160)
    torch.testing.assert_close(m.forward_head(feats), m(x))
    m.reset_classifier(3)
    assert m(x).shape == (2, 3)
    m.reset_classifier(0)
    assert m(x).shape == (2, 160)
    nwd = m.no_weight_decay()
    assert "pos_embed" in nwd and "stages.1.pos_embed" in nwd
    names = dict(m.named_parameters())
    assert all(n in names for n in nwd)


def test_pos_embed_resize_at_construction_and_on_load():
    torch.manual_seed(0)
    m32 = lgvit.create_model("lsa_micro_cifar")
    m64 = lgvit.create_model("lsa_micro_cifar", img_size=64)
    assert m64.pos_embed.shape == (9, 32 * 32, 64)
    missing = m64.load_state_dict(m32.state_dict())  # different grid: resized on load
    assert not missing.missing_keys and not missing.unexpected_keys
    want = resize_pos_embed(m32.pos_embed.detach(), (16, 16), (32, 32))
    torch.testing.assert_close(m64.pos_embed.detach(), want)
    assert m64(torch.randn(1, 3, 64, 64)).shape == (1, 10)
    # Resizing to the same grid is the identity; bicubic there and back stays close.
    same = resize_pos_embed(m32.pos_embed.detach(), (16, 16), (16, 16))
    assert torch.equal(same, m32.pos_embed.detach())


def test_wrong_input_size_is_a_clear_error_unless_dynamic():
    m = lgvit.create_model("lsa_micro_cifar")
    with pytest.raises(ValueError, match="built for 32x32"):
        m(torch.randn(1, 3, 48, 48))
    d = lgvit.create_model("lsa_micro_cifar", dynamic_img_size=True).eval()
    assert d(torch.randn(1, 3, 48, 48)).shape == (1, 10)
    with pytest.raises(ValueError, match=r"expected input \(B, 3, H, W\)"):
        m(torch.randn(1, 1, 32, 32))


def test_deterministic_under_fixed_seed():
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        m = lgvit.create_model("lsa_micro_cifar").train()
        x = torch.randn(4, 3, 32, 32)
        outs.append(m(x))  # train mode: drop path randomness is seeded too
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.manual_seed(124)
    other = lgvit.create_model("lsa_micro_cifar")
    assert not torch.equal(other.pos_embed, m.pos_embed)


def test_registry_errors_and_listing():
    assert "lsa_tiny_cifar" in lgvit.list_models("lsa_*")
    assert lgvit.list_models("lsa_tiny_cifar_?") == [f"lsa_tiny_cifar_{c}" for c in "abcde"]
    with pytest.raises(ValueError, match="unknown model"):
        lgvit.create_model("lsa_nope")
    cfg = lgvit.get_model_config("lsa_tiny_224")
    assert cfg.input_size == (3, 224, 224) and cfg.paper["params_m"] == 9.9


def test_bf16_autocast_close_to_fp32():
    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar").eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = m(x).float()
    assert (low - ref).abs().max() < 0.05 * ref.abs().max() + 0.05
