"""Layers whose CUDA paths a CPU can check: fp16 token means that overflowed, the deformable
kernel's explicit choice (and its dtype off the CPU), and where SyncBatchNorm is applied."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import lgvit
import lgvit.models.layers.deform as deform
from lgvit.core.errors import LgvitError
from lgvit.core.runtime import Dist
from lgvit.models.layers import (
    DEFORM_IMPLS,
    DeformableTokenMerging,
    DeformConv2d,
    LocalityFeedForward,
    deform_conv2d,
    set_deform_impl,
)
from lgvit.models.layers.locality import _token_mean

# -- fp16 token means ---------------------------------------------------------------------------


def _big_fp16_tokens(seed: int, shape: tuple[int, ...] = (2, 197, 8)) -> torch.Tensor:
    """fp16 tokens of about 500 (196 of them sum past fp16's 65504)."""
    g = torch.Generator().manual_seed(seed)
    return (500 + 50 * torch.randn(shape, generator=g)).half()


def test_fp16_token_mean_does_not_overflow():
    x = _big_fp16_tokens(0)
    assert x.double().sum(1).abs().max() > torch.finfo(torch.float16).max  # it would overflow
    got = _token_mean(x)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), x.double().mean(1), rtol=1e-3, atol=0)


@pytest.mark.parametrize("attn", ["se", "eca"])
def test_fp16_locality_feed_forward_on_large_tokens_matches_fp64(attn):
    """The token path in fp16 (which pools the tokens for the channel attention) against the
    same module in float64; finite where it gave NaN."""
    torch.manual_seed(0)
    ff = LocalityFeedForward(8, 32, channel_attn=attn).eval()
    if attn == "eca":  # a gate off saturation, where a wrong mean shows
        nn.init.constant_(ff.attn.conv.weight, 1e-3)
    x = _big_fp16_tokens(1)
    want = ff.double()(x.double(), (14, 14))
    got = ff.half()(x, (14, 14))
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=4e-3 * scale)


# -- the deformable kernel's choice ---------------------------------------------------------------


def _dtm_pair() -> tuple[DeformableTokenMerging, DeformableTokenMerging]:
    """Two DTMs with the same weights (offsets not zero), torchvision's kernel and the pure one."""
    torch.manual_seed(0)
    tv = DeformableTokenMerging(4, 6, impl="torchvision")
    nn.init.normal_(tv.offset_conv.weight, std=0.5)  # sample off the grid
    pure = DeformableTokenMerging(4, 6, impl="pure")
    pure.load_state_dict(tv.state_dict())
    return tv, pure


def test_torchvision_and_pure_give_the_same_outputs_and_gradients():
    tv, pure = _dtm_pair()
    assert tv.state_dict().keys() == pure.state_dict().keys()  # the choice is not saved
    assert not any("impl" in k for k in tv.state_dict())
    x = torch.randn(3, 6 * 5, 4, generator=torch.Generator().manual_seed(2))
    outs, grads = [], []
    for m in (tv, pure):
        xi = x.clone().requires_grad_(True)
        y, hw = m(xi, (6, 5))
        assert hw == (3, 2)  # an odd width: the 2x2 stride-2 merge drops the last column
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad, *(p.grad for p in m.parameters())])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_torchvision_kernel_under_bf16_autocast_matches_the_pure_path():
    """Under autocast the offsets come in bf16 beside a float32 input: torchvision's kernel is
    given one dtype for all (it refused the mix: "expected scalar type Float")."""
    tv, pure = _dtm_pair()
    x = torch.randn(3, 6 * 5, 4, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_tv, _ = tv(x, (6, 5))
        y_pure, _ = pure(x, (6, 5))
    assert torch.isfinite(y_tv).all()
    torch.testing.assert_close(y_tv.float(), y_pure.float(), rtol=5e-2, atol=5e-2)


def _count_torchvision_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch torchvision's kernel with a counting wrapper; the list's length is the calls."""
    real = deform._torchvision_deform_conv2d()
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(deform, "_torchvision_deform_conv2d", lambda: counting)
    return calls


def test_lit_deform_impl_is_honoured_and_not_saved(monkeypatch):
    calls = _count_torchvision_calls(monkeypatch)
    x = torch.randn(1, 3, 32, 32)
    small = dict(img_size=32, depths=(1, 1, 1, 1), num_classes=3)
    model = lgvit.create_model("lit_ti", deform_impl="torchvision", **small).eval()
    convs = [m for m in model.modules() if isinstance(m, DeformConv2d)]
    assert len(convs) == 3 and {m.impl for m in convs} == {"torchvision"}
    assert "deform_impl" not in model.model_args  # save_pretrained writes no runtime choice
    with torch.no_grad():
        want = model(x)
    assert len(calls) == 3  # every merge ran torchvision's kernel
    assert set_deform_impl(model, "pure") == 3
    with torch.no_grad():
        got = model(x)
    assert len(calls) == 3  # none more: the pure path ran
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # auto on the CPU is the pure path (torchvision's on CUDA: only a GPU shows that)
    auto = lgvit.create_model("lit_s", img_size=32, depths=(1, 1, 1, 1), num_classes=3).eval()
    assert {m.impl for m in auto.modules() if isinstance(m, DeformConv2d)} == {"auto"}
    with torch.no_grad():
        auto(x)
    assert len(calls) == 3


@pytest.mark.parametrize("bad", ["fast", "", None, 1])
def test_a_bad_deform_impl_is_one_line(bad):
    with pytest.raises(LgvitError) as e:
        lgvit.create_model("lit_ti", deform_impl=bad)
    assert str(e.value) == f"deform_impl {bad!r}: one of {', '.join(DEFORM_IMPLS)}"
    with pytest.raises(ValueError, match="deform_impl"):
        DeformConv2d(4, 4, 2, impl=bad)
    with pytest.raises(ValueError, match="deform_impl"):
        set_deform_impl(nn.Sequential(), bad)


def test_torchvision_impl_without_torchvision_is_refused_at_build(monkeypatch):
    monkeypatch.setattr(deform, "_torchvision_deform_conv2d", lambda: None)
    with pytest.raises(LgvitError, match="^deform_impl 'torchvision': torchvision.ops"):
        lgvit.create_model("lit_ti", deform_impl="torchvision")


def test_torchvision_kernel_gets_float32_off_the_cpu_too(monkeypatch):
    """bf16 tensors (no autocast) on a device other than the CPU: torchvision's kernels have no
    bf16 (its CUDA kernel dispatches float, double and half), so it is given float32. The meta
    device stands in for CUDA, and a fake kernel records what it was given."""
    seen: list[torch.dtype] = []

    def fake(x, offset, weight, bias, stride, padding, dilation):
        seen.extend(t.dtype for t in (x, offset, weight, bias))
        return torch.empty(x.shape[0], weight.shape[0], 2, 2, device=x.device, dtype=x.dtype)

    monkeypatch.setattr(deform, "_torchvision_deform_conv2d", lambda: fake)
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, off = torch.empty(2, 4, 4, 4, **meta), torch.empty(2, 8, 2, 2, **meta)
    w, b = torch.empty(5, 4, 2, 2, **meta), torch.empty(5, **meta)
    y = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    assert seen == [torch.float32] * 4
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 2, 2)


# -- SyncBatchNorm ------------------------------------------------------------------------------


def _syncs(m: nn.Module) -> int:
    return sum(isinstance(x, nn.SyncBatchNorm) for x in m.modules())


@pytest.mark.parametrize(
    "dist, sync",
    [
        (Dist(), False),
        (Dist(rank=0, world_size=2), False),  # gloo on the CPU: no SyncBatchNorm there
        (Dist(device=torch.device("cuda", 0)), False),  # one process: nothing to sync
        (Dist(rank=1, world_size=2, local_rank=1, device=torch.device("cuda", 1)), True),
    ],
)
def test_sync_bn_only_when_distributed_on_cuda(dist, sync):
    """Segmentation training's choice (built on the CPU; the model moves to the device later)."""
    from lgvit.run.config import load_config
    from lgvit.tasks.segmentation.train import build_segmenter

    sets = ["task=segmentation", "data=segfolder", "model=lsa_micro_cifar", "img_size=32"]
    model, _ = build_segmenter(load_config(None, sets), 3, dist)
    assert (_syncs(model) > 0) == sync


def test_sync_bn_converts_the_head_only():
    """As mmseg's ``norm_cfg=SyncBN`` of the decode head: LIT's DTM BatchNorms in the backbone
    stay per process; the checkpoint keys are the same either way, and the converted model
    runs on the CPU in eval mode (the shape check before training does)."""
    from lgvit.dense.semfpn import create_segmenter

    kw = dict(img_size=32, depths=(1, 1, 1, 1))
    torch.manual_seed(0)
    plain = create_segmenter("lit_ti", 3, **kw)
    torch.manual_seed(0)
    synced = create_segmenter("lit_ti", 3, sync_bn=True, **kw)
    head_bns = [m for m in synced.decode_head.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert head_bns and _syncs(synced) == len(head_bns)
    assert _syncs(synced.backbone) == 0
    assert sum(isinstance(m, nn.BatchNorm2d) for m in synced.backbone.modules()) == 3
    assert synced.state_dict().keys() == plain.state_dict().keys()
    synced.load_state_dict(plain.state_dict())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(synced.eval()(x), plain.eval()(x))
