"""Deformable convolution (DCNv1) in pure PyTorch, and LIT's deformable token merging.

Sampling follows ``torchvision.ops.deform_conv2d``: output position ``p0``, tap ``k`` reads the
input at ``p0 * stride - padding + tap_k * dilation + offset_k``, bilinear, zero outside the
map; the offset channels are ``(dy, dx)`` per tap, taps row-major. Here that is one
``grid_sample`` building a "tap image" (every output position's k x k samples laid out as a
k x k patch), then a k x k stride-k convolution of it: exact, differentiable in the input,
the offsets and the weights, and it runs on any device. The sampling runs in float32 (under
autocast too, as the LIT authors' CUDA kernel did); the convolution in the autocast dtype.

Which kernel runs: on the CPU this pure path, which measured 2.2-5.5x faster than
``torchvision.ops.deform_conv2d`` forward and 4-9x forward + backward at LIT-Ti's three merge
shapes (``benchmarks/bench_deform.py``, AMD EPYC with AVX-512 bf16, torch 2.14.1, batch 32;
torchvision's CPU kernel is an im2col loop without bf16); it also exports to ONNX as
GridSample + Conv. On CUDA torchvision's kernel (the authors used a CUDA kernel too); not yet
measured against this path on a GPU. Under float16 autocast that kernel runs in float16 where it
takes it; under bfloat16 in float32 (a bf16 sample position is only within 1/4 pixel at 56).
``DeformConv2d(impl=...)`` (``deform_impl`` of the LIT models, :func:`set_deform_impl` on a
built model) chooses either explicitly.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.layers.helpers import Grid, autocast_dtype, check_grid, map_to_tokens, to_2tuple

# Which kernel a DeformConv2d runs -> deform_conv2d's ``use_torchvision``: "auto" is torchvision's
# on CUDA and the pure path elsewhere.
_USE_TORCHVISION: dict[str, bool | None] = {"auto": None, "torchvision": True, "pure": False}
DEFORM_IMPLS: tuple[str, ...] = tuple(_USE_TORCHVISION)


@functools.cache
def _torchvision_deform_conv2d():  # noqa: ANN202 - optional dependency
    try:
        from torchvision.ops import deform_conv2d
    except Exception:  # not installed, or built for another torch: the pure path is used
        return None
    return deform_conv2d


def deform_conv2d(
    x: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Grid = 1,
    padding: int | Grid = 0,
    dilation: int | Grid = 1,
    use_torchvision: bool | None = None,
) -> torch.Tensor:
    """DCNv1: ``x (B, C, H, W)``, ``offset (B, 2*kh*kw, Ho, Wo)``, ``weight (O, C, kh, kw)``.

    ``use_torchvision``: None = torchvision's kernel on CUDA (when it imports), this module's
    pure-PyTorch one on the CPU (faster there, see the module docstring); True/False forces
    either.
    """
    B, C, H, W = x.shape
    O, Cw, kh, kw = weight.shape
    if Cw != C:
        raise ValueError(f"weight expects {Cw} input channels, the input has {C}")
    sh, sw = to_2tuple(stride)
    ph, pw = to_2tuple(padding)
    dh, dw = to_2tuple(dilation)
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if offset.shape != (B, 2 * kh * kw, Ho, Wo):
        raise ValueError(f"offset {tuple(offset.shape)} should be {(B, 2 * kh * kw, Ho, Wo)}")
    # torchvision is only looked up where it would be used (no import attempt on CPU runs).
    want_tv = use_torchvision or (use_torchvision is None and x.is_cuda)
    tv = _torchvision_deform_conv2d() if want_tv else None
    if use_torchvision and tv is None:
        raise RuntimeError("use_torchvision=True but torchvision.ops.deform_conv2d does not import")
    if tv is not None:
        return _torchvision_call(tv, x, offset, weight, bias, (sh, sw), (ph, pw), (dh, dw))

    work = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 if given
    amp = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
    with torch.autocast(x.device.type, enabled=False) if amp else contextlib.nullcontext():
        off = offset.to(work).view(B, kh, kw, 2, Ho, Wo)
        rows = torch.arange(Ho, device=x.device, dtype=work) * sh - ph
        cols = torch.arange(Wo, device=x.device, dtype=work) * sw - pw
        ty = torch.arange(kh, device=x.device, dtype=work) * dh
        tx = torch.arange(kw, device=x.device, dtype=work) * dw
        # Sample positions (B, Ho, kh, Wo, kw): output row i, tap ky sits at tap-image row i*kh+ky.
        py = (
            rows[:, None, None, None]
            + ty[None, :, None, None]
            + off[:, :, :, 0].permute(0, 3, 1, 4, 2)
        )
        px = (
            cols[None, None, :, None]
            + tx[None, None, None, :]
            + off[:, :, :, 1].permute(0, 3, 1, 4, 2)
        )
        # Pixel -> grid_sample coordinates with align_corners=False: its pixel centres are at
        # (2p + 1) / size - 1, which stays defined for maps one pixel wide.
        grid = torch.stack([(2 * px + 1) / W - 1, (2 * py + 1) / H - 1], dim=-1)
        grid = grid.reshape(B, Ho * kh, Wo * kw, 2)
        taps = F.grid_sample(
            x.to(work), grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )
    taps = taps if amp else taps.to(x.dtype)  # under autocast the conv casts it itself
    return F.conv2d(taps, weight, bias, stride=(kh, kw))


# Autocast dtypes torchvision's kernel may run in: float16 places a sample within 1/32 pixel on
# maps up to 64 wide (1/16 up to 128); bfloat16 only within 1/4 at 56 (its 8-bit mantissa holds
# the sample's position too), so under bf16 autocast the kernel runs in float32, as
# torchvision's own autocast rule runs it always.
_KERNEL_AUTOCAST_DTYPES = (torch.float16,)


_KERNEL_TAKES: dict[tuple[str, torch.dtype], bool] = {}


def _kernel_takes(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torchvision's deform_conv2d kernel on ``device_type`` runs in ``dtype`` (its CPU
    kernel has float16 but no bfloat16; its CUDA kernel's types vary with the release): tried
    once, on a 3x3 map, outside a compiled graph (a graph being traced before any eager call
    keeps float32, which is always right)."""
    key = (device_type, dtype)
    if key in _KERNEL_TAKES or torch.compiler.is_compiling():
        return _KERNEL_TAKES.get(key, False)
    tv, dev = _torchvision_deform_conv2d(), "cuda" if device_type == "cuda" else "cpu"
    x = torch.zeros(1, 1, 3, 3, device=dev, dtype=dtype)
    try:
        with torch.autocast(device_type, enabled=False):
            tv(x, torch.zeros(1, 2, 3, 3, device=dev, dtype=dtype), x[:, :, :1, :1], padding=(0, 0))
        _KERNEL_TAKES[key] = True
    except (RuntimeError, NotImplementedError):
        _KERNEL_TAKES[key] = False
    return _KERNEL_TAKES[key]


def _torchvision_call(
    tv, x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    stride: Grid, padding: Grid, dilation: Grid,
) -> torch.Tensor:  # fmt: skip
    """torchvision's kernel in one dtype for all its arguments: under autocast the compute dtype
    where the kernel takes it and samples precisely in it (float16), else float32 (float64 if
    any argument is); the output in the compute dtype, or the input's without autocast."""
    args = (x, offset, weight) + (() if bias is None else (bias,))
    dev = x.device.type
    half = autocast_dtype(dev)
    amp = half is not None
    if half in _KERNEL_AUTOCAST_DTYPES and _kernel_takes(dev, half):
        work = half
    else:
        work = torch.float64 if any(t.dtype == torch.float64 for t in args) else torch.float32
    x, offset, weight, *rest = (t.to(work) for t in args)
    # torchvision's own autocast rule would cast everything back to float32
    with torch.autocast(dev, enabled=False) if amp else contextlib.nullcontext():
        out = tv(x, offset, weight, rest[0] if rest else None, stride, padding, dilation)
    return out if work == half else out.to(args[0].dtype)


# torch.fx: one graph node each (the kernel is chosen, and the shapes checked, at run time).
torch.fx.wrap("deform_conv2d")
torch.fx.wrap("check_grid")


def check_deform_impl(impl: object) -> str:
    """``impl`` if it names a kernel (:data:`DEFORM_IMPLS`) that can run here, else a one-line
    ``ValueError``."""
    if not isinstance(impl, str) or impl not in _USE_TORCHVISION:
        raise ValueError(f"deform_impl {impl!r}: one of {', '.join(DEFORM_IMPLS)}")
    if impl == "torchvision" and _torchvision_deform_conv2d() is None:
        raise ValueError("deform_impl 'torchvision': torchvision.ops.deform_conv2d does not import")
    return impl


def set_deform_impl(model: nn.Module, impl: str) -> int:
    """Every :class:`DeformConv2d` in ``model`` runs ``impl`` from now on (the weights are the
    same for each); returns how many there are."""
    impl = check_deform_impl(impl)
    convs = [m for m in model.modules() if isinstance(m, DeformConv2d)]
    for m in convs:
        m.impl = impl
    return len(convs)


class DeformConv2d(nn.Module):
    """A DCNv1 convolution's parameters (``weight``, ``bias``, initialised as ``nn.Conv2d``);
    ``forward(x, offset)``.

    ``impl``: which kernel runs (:data:`DEFORM_IMPLS`): ``"auto"`` (torchvision's on CUDA,
    the pure-PyTorch one elsewhere), ``"torchvision"`` or ``"pure"`` on any device. A plain
    attribute, not in the state dict: checkpoints load under either.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
        padding: int = 0, bias: bool = True, impl: str = "auto",
    ) -> None:  # fmt: skip
        super().__init__()
        self.impl = check_deform_impl(impl)
        k = to_2tuple(kernel_size)
        self.stride, self.padding = to_2tuple(stride), to_2tuple(padding)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, *k))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_channels * k[0] * k[1])
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return deform_conv2d(
            x, offset, self.weight, self.bias, self.stride, self.padding,
            use_torchvision=_USE_TORCHVISION[self.impl],
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, stride={self.stride}, impl={self.impl!r}"


class DeformableTokenMerging(nn.Module):
    """LIT's deformable token merging: offsets from a ``k x k`` stride-``k`` conv (zero-
    initialised, so it starts as plain ``k x k`` patch merging) -> deformable ``k x k``
    stride-``k`` conv (C_in -> C_out) -> BatchNorm -> GELU. ``forward(x, hw) -> (x, hw)``.

    The offset conv's weight trains at a fraction of the learning rate (``offset_lr_factor``
    in the training config; its name ``offset_conv`` is how the optimizer finds it).
    ``impl``: the deformable kernel (:class:`DeformConv2d`).
    """

    def __init__(self, in_dim: int, out_dim: int, kernel_size: int = 2, impl: str = "auto") -> None:
        super().__init__()
        k = kernel_size
        self.offset_conv = nn.Conv2d(in_dim, 2 * k * k, k, stride=k)
        nn.init.zeros_(self.offset_conv.weight)
        nn.init.zeros_(self.offset_conv.bias)
        self.conv = DeformConv2d(in_dim, out_dim, k, stride=k, impl=impl)
        self.norm = nn.BatchNorm2d(out_dim)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, hw: Grid) -> tuple[torch.Tensor, Grid]:
        # Tokens are the channels-last layout of the map: a view, no copy; grid_sample and the
        # convs run faster on it (no copy into NCHW first).
        m = _channels_last_map(x, hw)
        y = self.conv(m, self.offset_conv(m))
        return map_to_tokens(self.act(self.norm(y)))

    def offsets(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        """The sampling offsets ``(B, 2*k*k, Ho, Wo)`` it would use (for visualisation)."""
        return self.offset_conv(_channels_last_map(x, hw))


def _channels_last_map(x: torch.Tensor, hw: Grid) -> torch.Tensor:
    """``(B, H*W, C)`` tokens as a ``(B, C, H, W)`` channels-last map, without a copy."""
    B, _, C = x.shape
    return check_grid(x, hw).reshape(B, hw[0], hw[1], C).permute(0, 3, 1, 2)
