"""LSA's shifted copies of an image as one im2col gather index (no Python loop over shifts)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lgvit.models.layers.helpers import conv_out_size


def _shifted_coords(coord: torch.Tensor, shift: torch.Tensor, size: int, mode: str) -> torch.Tensor:
    """Where shifted-image coordinate ``coord`` reads from in the original image.

    Copy t at (i, j) reads the image at (i - dy_t, j - dx_t), like ``torch.roll(img, (dy, dx))``:
    ``circular`` wraps around the edges (the paper; ``pad`` too: see :func:`shift_patch_index`);
    ``reflect`` mirrors them (the ablation's image translation with reflection padding).
    """
    src = coord - shift
    # The size as a 0-dim tensor: a symbolic size (dynamic-size export) must not be a scalar
    # operand, which the ONNX exporter cannot translate for remainder.
    n = torch.scalar_tensor(size, dtype=src.dtype)
    if mode in ("circular", "pad"):
        return torch.remainder(src, n)
    src = torch.where(src < 0, -src, src)
    return torch.where(src >= n, 2 * (n - 1) - src, src)


def shift_patch_index(
    shifts: Sequence[tuple[int, int]],
    height: int,
    width: int,
    kernel: int,
    stride: int,
    padding: int,
    channels: int,
    mode: str = "circular",
) -> tuple[torch.Tensor, tuple[int, int]]:
    """im2col index of the T shifted copies: ``(T, N, channels*kernel*kernel)``.

    Entry (t, n, (c, ky, kx)) is the flat index into ``x.flatten(1)`` (C*H*W values, then one
    zero) of the pixel that tap (ky, kx) of output position n reads in copy t, after zero
    padding by ``padding`` -- exactly what ``conv2d(shift(x, t), padding=padding)`` sees.
    ``pad``: the copy is ``F.pad(x, (dx, 0, dy, 0), "circular")``, (H+dy) x (W+dx), whose taps
    past the bottom/right edge read on around the image where a roll's read the zero padding.
    """
    if mode == "reflect" and max(abs(v) for s in shifts for v in s) >= min(height, width):
        raise ValueError(f"a shift as large as the image ({height}x{width}) cannot reflect")
    if mode == "pad" and min(v for s in shifts for v in s) < 0:
        raise ValueError(f"'pad' shifts pad the top/left, so none may be negative: {shifts}")
    sh = torch.tensor(shifts, dtype=torch.long)
    h = conv_out_size(height, kernel, stride, padding)
    w = conv_out_size(width, kernel, stride, padding)
    k = torch.arange(kernel)
    rows = torch.arange(h)[:, None] * stride - padding + k[None]  # (h, K) in the padded frame
    cols = torch.arange(w)[:, None] * stride - padding + k[None]  # (w, K)
    g_r, g_c = (sh[:, 0, None, None], sh[:, 1, None, None]) if mode == "pad" else (0, 0)
    r_ok = (rows >= 0) & (rows < height + g_r)  # (h, K); padded: (T, h, K), dy rows more
    c_ok = (cols >= 0) & (cols < width + g_c)
    r_hi, c_hi = (None, None) if mode == "pad" else (height - 1, width - 1)
    r = _shifted_coords(rows.clamp(0, r_hi)[None], sh[:, 0, None, None], height, mode)
    c = _shifted_coords(cols.clamp(0, c_hi)[None], sh[:, 1, None, None], width, mode)
    # (T, h, w, C, K, K): channel offset + row * W + col, or the trailing zero when padded.
    flat = (
        torch.arange(channels)[None, None, None, :, None, None] * (height * width)
        + r[:, :, None, None, :, None] * width
        + c[:, None, :, None, None, :]
    )
    ok = r_ok[..., :, None, None, :, None] & c_ok[..., None, :, None, None, :]
    flat = torch.where(ok, flat, channels * height * width)
    return flat.reshape(len(shifts), h * w, channels * kernel * kernel), (h, w)
