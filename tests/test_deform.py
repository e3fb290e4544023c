"""The pure-PyTorch deformable convolution against a direct per-position reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lgvit.models.layers import DeformableTokenMerging, deform_conv2d


def _bilinear(img: torch.Tensor, y: float, x: float) -> torch.Tensor:
    """torchvision's DCN sampling: zero outside (-1, size), bilinear with zero corners."""
    C, H, W = img.shape
    out = torch.zeros(C, dtype=img.dtype)
    if y <= -1 or y >= H or x <= -1 or x >= W:
        return out
    y0, x0 = math.floor(y), math.floor(x)
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < H and 0 <= xx < W:
                out = out + wy * wx * img[:, yy, xx]
    return out


def reference_deform_conv2d(x, offset, weight, bias, stride, padding):
    """DCNv1 written out: one output position and one tap at a time."""
    B, C, H, W = x.shape
    O, _, kh, kw = weight.shape
    Ho, Wo = offset.shape[-2:]
    out = torch.zeros(B, O, Ho, Wo, dtype=x.dtype)
    for b in range(B):
        for i in range(Ho):
            for j in range(Wo):
                acc = bias.clone()
                for ky in range(kh):
                    for kx in range(kw):
                        k = ky * kw + kx
                        y = i * stride - padding + ky + offset[b, 2 * k, i, j].item()
                        xx = j * stride - padding + kx + offset[b, 2 * k + 1, i, j].item()
                        acc = acc + weight[:, :, ky, kx] @ _bilinear(x[b], y, xx)
                out[b, :, i, j] = acc
    return out


CASES = [  # (B, C, H, W, kernel, stride, padding)
    (3, 2, 6, 5, 2, 2, 0),  # DTM's shape, odd batch, odd width
    (5, 3, 4, 4, 3, 1, 1),  # 3x3 with padding
    (1, 2, 1, 6, 2, 1, 1),  # a map one pixel high
    (2, 1, 5, 1, 2, 2, 1),  # a map one pixel wide
]


@pytest.mark.parametrize("B, C, H, W, k, s, p", CASES)
def test_matches_per_position_reference(B, C, H, W, k, s, p):
    g = torch.Generator().manual_seed(B * 100 + H)
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    Ho, Wo = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    # Offsets of a few pixels: many taps leave the map (partly or wholly).
    offset = 2.5 * torch.randn(B, 2 * k * k, Ho, Wo, generator=g, dtype=torch.float64)
    weight = torch.randn(4, C, k, k, generator=g, dtype=torch.float64)
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    got = deform_conv2d(x, offset, weight, bias, s, p, use_torchvision=False)
    want = reference_deform_conv2d(x, offset, weight, bias, s, p)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_zero_offsets_are_a_plain_strided_conv():
    x = torch.randn(3, 4, 8, 6)
    w, b = torch.randn(5, 4, 2, 2), torch.randn(5)
    got = deform_conv2d(x, torch.zeros(3, 8, 4, 3), w, b, 2, 0, use_torchvision=False)
    torch.testing.assert_close(got, F.conv2d(x, w, b, stride=2), rtol=1e-5, atol=1e-5)


def test_gradcheck_input_offsets_weights():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    # Offsets away from integer positions: bilinear sampling is not differentiable at the
    # grid lines themselves.
    off = 0.37 + 0.8 * torch.randn(2, 8, 2, 1, generator=g, dtype=torch.float64)
    off.requires_grad_(True)
    w = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)

    def f(x, off, w, b):
        return deform_conv2d(x, off, w, b, 2, 0, use_torchvision=False)

    assert torch.autograd.gradcheck(f, (x, off, w, b), eps=1e-6, atol=1e-6)


def test_bf16_autocast_samples_in_float32():
    torch.manual_seed(0)
    dtm = DeformableTokenMerging(8, 16).eval()
    with torch.no_grad():
        dtm.offset_conv.weight.normal_(0, 0.3)
    x = torch.randn(2, 6 * 4, 8)
    with torch.no_grad():
        ref, hw = dtm(x, (6, 4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low, _ = dtm(x, (6, 4))
    assert hw == (3, 2) and low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max() + 0.02


def test_sampling_runs_in_float32_under_bf16_autocast(monkeypatch):
    seen = []
    grid_sample = F.grid_sample

    def spy(x, grid, *args, **kwargs):
        seen.append((x.dtype, grid.dtype))
        return grid_sample(x, grid, *args, **kwargs)

    monkeypatch.setattr(F, "grid_sample", spy)
    x, off = torch.randn(1, 4, 6, 6), torch.randn(1, 8, 3, 3)
    w, b = torch.randn(5, 4, 2, 2), torch.randn(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = deform_conv2d(x.bfloat16(), off.bfloat16(), w, b, 2, 0, use_torchvision=False)
    assert seen == [(torch.float32, torch.float32)] and y.dtype == torch.bfloat16


def test_token_merging_starts_as_patch_merging():
    torch.manual_seed(0)
    dtm = DeformableTokenMerging(4, 6).eval()
    assert not dtm.offset_conv.weight.any() and not dtm.offset_conv.bias.any()
    x = torch.randn(2, 4 * 6, 4)
    out, hw = dtm(x, (4, 6))
    m = x.transpose(1, 2).reshape(2, 4, 4, 6)
    y = F.conv2d(m, dtm.conv.weight, dtm.conv.bias, stride=2)
    bn = dtm.norm
    y = F.gelu(F.batch_norm(y, bn.running_mean, bn.running_var, bn.weight, bn.bias, eps=bn.eps))
    torch.testing.assert_close(out, y.flatten(2).transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert hw == (2, 3)


def test_torchvision_parity():
    import torchvision.ops as tv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 7, 6, generator=g, requires_grad=True)
    off = (2 * torch.randn(3, 8, 3, 3, generator=g)).requires_grad_(True)
    w = torch.randn(5, 4, 2, 2, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g)
    want = tv.deform_conv2d(x, off, w, b, stride=2)
    got = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True), want)
    cot = torch.randn(want.shape, generator=g)
    want_g = torch.autograd.grad(want, (x, off, w), cot)
    got_g = torch.autograd.grad(got, (x, off, w), cot)
    for a, e in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_cpu_default_is_the_pure_path_and_torchvision_takes_bf16(monkeypatch):
    import lgvit.models.layers.deform as deform

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6, 6, generator=g)
    off = torch.randn(2, 8, 3, 3, generator=g)
    w = torch.randn(5, 4, 2, 2, generator=g)
    b = torch.randn(5, generator=g)
    want = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    # bf16 tensors (no autocast): torchvision's CPU kernel has no bf16; it runs in float32.
    got = deform_conv2d(*(t.bfloat16() for t in (x, off, w, b)), 2, 0, use_torchvision=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.1)

    def no_torchvision():  # the CPU default must not reach torchvision's kernel (slower)
        raise AssertionError("torchvision's kernel was called on the CPU by default")

    monkeypatch.setattr(deform, "_torchvision_deform_conv2d", no_torchvision)
    torch.testing.assert_close(deform_conv2d(x, off, w, b, 2, 0), want, rtol=1e-4, atol=1e-4)


def _deform_case(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 12, 12, generator=g, requires_grad=True)
    off = (3 * torch.randn(2, 8, 6, 6, generator=g)).requires_grad_(True)
    w = torch.randn(5, 4, 2, 2, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    return x, off, w, b


def test_torchvision_kernel_runs_in_float16_under_float16_autocast():
    """The compute dtype where the kernel takes it (CPU kernel: float16), within float16's
    rounding of the float32 result, forward and backward; a float32 input under autocast."""
    x, off, w, b = _deform_case()
    # offsets float16 can hold: a sample crossing a pixel edge would change the offsets'
    # gradient by a step, which is the offsets' rounding, not the kernel's arithmetic
    off = off.detach().half().float().requires_grad_(True)
    want = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    want_g = torch.autograd.grad(want, (x, off, w, b), cot)
    with torch.autocast("cpu", dtype=torch.float16):
        got = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    assert got.dtype == torch.float16
    scale = want.abs().max()
    torch.testing.assert_close(got.float() / scale, want / scale, rtol=0, atol=1e-2)
    grads = torch.autograd.grad(got.float(), (x, off, w, b), cot)
    for name, a, e in zip("x off w b".split(), grads, want_g, strict=True):
        assert a.dtype == torch.float32  # the leaves' own dtype
        err = ((a - e) / e.abs().max()).abs()
        if name == "off":  # a sample within float16's rounding of a pixel edge: bilinear
            assert float((err > 1e-2).float().mean()) < 0.01, err.max()  # sampling's slope steps
        else:
            assert float(err.max()) < 1e-2, (name, err.max())


def test_torchvision_kernel_samples_in_float32_under_bf16_autocast():
    """bf16 would place samples within 1/4 pixel only: the kernel runs in float32, the result
    is exactly the float32 call's, in the input's dtype (as before)."""
    x, off, w, b = _deform_case()
    want = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = deform_conv2d(x, off.bfloat16().float(), w, b, 2, 0, use_torchvision=True)
        low = deform_conv2d(x, off.bfloat16(), w, b, 2, 0, use_torchvision=True)
    assert got.dtype == low.dtype == torch.float32
    torch.testing.assert_close(low, got, rtol=0, atol=0)  # offsets widened, then float32
    ref = deform_conv2d(x, off.bfloat16().float(), w, b, 2, 0, use_torchvision=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert want.shape == got.shape


def test_a_kernel_without_the_dtype_runs_in_float32(monkeypatch):
    import lgvit.models.layers.deform as deform

    monkeypatch.setattr(deform, "_kernel_takes", lambda device, dtype: False)
    x, off, w, b = _deform_case()
    want = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    with torch.autocast("cpu", dtype=torch.float16):
        got = deform_conv2d(x, off, w, b, 2, 0, use_torchvision=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
