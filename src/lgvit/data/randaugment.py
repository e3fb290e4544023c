"""timm's RandAugment on uint8 image batches, its ops, and the checks and draws every batched
op shares.

Images are ``(B, 3, H, W)`` uint8 tensors and every random function takes an explicit
``torch.Generator`` (see :mod:`lgvit.data.transforms`, which builds the rest of the recipe on
this module and re-exports its public names).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from lgvit.core.errors import LgvitError

# timm's magnitude scale: levels run 0..10.
_LEVEL_DENOM = 10.0

# Same order as timm's _RAND_TRANSFORMS / _RAND_INCREASING_TRANSFORMS.
RAND_TRANSFORMS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "SolarizeAdd",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
RAND_INCREASING_TRANSFORMS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)

Scalar = float | int | torch.Tensor


# --------------------------------------------------------------------------- helpers


def _check_images(x: torch.Tensor, name: str, *, uint8: bool | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise LgvitError(f"{name}: expected images of shape (B, C, H, W), got {shape}")
    if uint8 is True and x.dtype != torch.uint8:
        raise LgvitError(f"{name}: expected uint8 images, got {x.dtype}")
    if uint8 is False and not x.is_floating_point():
        raise LgvitError(f"{name}: expected floating point images, got {x.dtype}")


def _rand(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device, dtype=torch.float64)


def _sync_free(x: torch.Tensor, sync_free: bool | None) -> bool:
    """Whether a random op takes its sync-free path (``None``: off the CPU, where reading a
    drawn value back to the host would wait for all the work queued on the device)."""
    return x.device.type != "cpu" if sync_free is None else sync_free


def _filled(values: Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small constant vector made on ``device`` by filling, not copied from Python data (a
    tensor built from a list reaches a GPU by a blocking copy)."""
    return torch.stack([torch.full((), float(v), dtype=dtype, device=device) for v in values])


def _per_sample(v: Scalar, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Broadcast a scalar or (n,) tensor parameter to a (n, 1, 1, 1) tensor."""
    if not isinstance(v, torch.Tensor):  # a number: filled in on the device, not copied there
        return torch.full((n, 1, 1, 1), v, dtype=dtype, device=device)
    t = v.to(dtype).to(device, non_blocking=True)
    if t.dim() == 0:
        t = t.expand(n)
    if t.shape != (n,):
        raise LgvitError(f"per-sample parameter must be a scalar or have shape ({n},)")
    return t.view(n, 1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """PIL's RGB -> L conversion (ITU-R 601-2, fixed point with rounding), int32 (B,1,H,W)."""
    xi = x.to(torch.int32)
    return (xi[:, 0:1] * 19595 + xi[:, 1:2] * 38470 + xi[:, 2:3] * 7471 + 0x8000) >> 16


# --------------------------------------------------------------------------- RandAugment ops
# Each op takes uint8 (B, 3, H, W) and returns uint8; parameters are scalars or (B,) tensors.
# The point ops are lookup tables (per image and channel) and the enhance ops are blends with
# a "degenerate" image, so rand_augment can run all images of a category as one gather / one
# blend / one grid_sample, whatever op each image drew.


def _apply_lut(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Map every pixel through its image's and channel's table: lut is (B, C, 256)."""
    n, c, h, w = x.shape
    idx = x.reshape(n, c, h * w).long()
    return lut.to(torch.uint8).expand(n, c, 256).gather(2, idx).view(n, c, h, w)


def _levels(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(256, device=device).expand(n, 1, 256)


def _invert_lut(n: int, device: torch.device) -> torch.Tensor:
    return 255 - _levels(n, device)


def _posterize_lut(bits: Scalar, n: int, device: torch.device) -> torch.Tensor:
    bits = _per_sample(bits, n, device, torch.int64).view(n, 1, 1).clamp(0, 8)
    return _levels(n, device) & ((0xFF << (8 - bits)) & 0xFF)


def _solarize_lut(threshold: Scalar, n: int, device: torch.device) -> torch.Tensor:
    thr = _per_sample(threshold, n, device, torch.int64).view(n, 1, 1)
    lv = _levels(n, device)
    return torch.where(lv >= thr, 255 - lv, lv)


def _solarize_add_lut(add: Scalar, threshold: Scalar, n: int, device: torch.device):
    add = _per_sample(add, n, device, torch.int64).view(n, 1, 1)
    thr = _per_sample(threshold, n, device, torch.int64).view(n, 1, 1)
    lv = _levels(n, device)
    return torch.where(lv < thr, (lv + add).clamp(0, 255), lv)


def _auto_contrast_lut(x: torch.Tensor) -> torch.Tensor:
    flat = x.flatten(2)
    lo = flat.amin(2, keepdim=True).to(torch.float64)
    hi = flat.amax(2, keepdim=True).to(torch.float64)
    span = (hi - lo).clamp(min=1)
    # Same float64 arithmetic as PIL's Python LUT so the truncation lands on the same integers.
    # Not ``255.0 / span``: torch evaluates that as 255 * (1 / span), which rounds differently.
    scale = torch.full_like(span, 255.0) / span
    lv = torch.arange(256, device=x.device, dtype=torch.float64)
    lut = (lv * scale + (-lo * scale)).trunc().clamp(0, 255).long()
    return torch.where(hi > lo, lut, lv.long())


def _equalize_lut(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    flat = x.reshape(b * c, h * w).long()
    # Per-image histograms by scatter_add_: bincount reads its size back from a GPU.
    hist = torch.zeros((b * c, 256), dtype=torch.int64, device=x.device)
    hist.scatter_add_(
        1, flat, torch.ones((1, 1), dtype=torch.int64, device=x.device).expand_as(flat)
    )
    nonzero = hist > 0
    # Count in the last non-empty bin (PIL excludes it from the step computation).
    last = 255 - nonzero.flip(1).to(torch.int8).argmax(1, keepdim=True)
    # Current Pillow divides by 255 (older releases used 256).
    step = (h * w - hist.gather(1, last)) // 255
    cum = hist.cumsum(1) - hist  # exclusive cumulative count: PIL's running ``n``
    lut = ((step // 2 + cum) // step.clamp(min=1)).clamp(0, 255)
    identity = (nonzero.sum(1, keepdim=True) <= 1) | (step == 0)
    lut = torch.where(identity, torch.arange(256, device=x.device), lut)
    return lut.view(b, c, 256)


def invert(x: torch.Tensor) -> torch.Tensor:
    """PIL ``ImageOps.invert``: 255 - x."""
    return 255 - x


def posterize(x: torch.Tensor, bits: Scalar) -> torch.Tensor:
    """PIL ``ImageOps.posterize``: keep the top ``bits`` bits (0 bits -> black, >= 8 -> same)."""
    return _apply_lut(x, _posterize_lut(bits, x.shape[0], x.device))


def solarize(x: torch.Tensor, threshold: Scalar) -> torch.Tensor:
    """PIL ``ImageOps.solarize``: invert every pixel >= threshold."""
    return _apply_lut(x, _solarize_lut(threshold, x.shape[0], x.device))


def solarize_add(x: torch.Tensor, add: Scalar, threshold: Scalar = 128) -> torch.Tensor:
    """timm ``solarize_add``: pixels below threshold get ``+add`` (saturating at 255)."""
    return _apply_lut(x, _solarize_add_lut(add, threshold, x.shape[0], x.device))


def auto_contrast(x: torch.Tensor) -> torch.Tensor:
    """PIL ``ImageOps.autocontrast`` (cutoff 0): per-channel min..max -> 0..255 stretch."""
    return _apply_lut(x, _auto_contrast_lut(x))


def equalize(x: torch.Tensor) -> torch.Tensor:
    """PIL ``ImageOps.equalize``: per-channel histogram equalisation with PIL's LUT rule
    (``step = (count - count_of_last_used_level) // 255``, as in current Pillow)."""
    return _apply_lut(x, _equalize_lut(x))


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: Scalar) -> torch.Tensor:
    """PIL ``Image.blend(degenerate, x, factor)`` in float32, truncating like PIL's C code."""
    f = _per_sample(factor, x.shape[0], x.device, torch.float32)
    d = degenerate.to(torch.float32)
    out = d + f * (x.to(torch.float32) - d)
    return out.clamp_(0, 255).to(torch.uint8)  # values are >= 0, so the cast truncates


def _brightness_degenerate(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((x.shape[0], 1, 1, 1), device=x.device)


def _color_degenerate(x: torch.Tensor) -> torch.Tensor:
    return _gray(x).to(torch.float32)


def _contrast_degenerate(x: torch.Tensor) -> torch.Tensor:
    g = _gray(x)
    mean = (g.flatten(1).sum(1).to(torch.float64) / g[0].numel() + 0.5).floor()
    return mean.to(torch.float32).view(-1, 1, 1, 1)


def _sharpness_degenerate(x: torch.Tensor) -> torch.Tensor:
    xf = x.to(torch.float32)
    h, w = x.shape[-2:]
    if h < 3 or w < 3:
        return xf
    # Separable 3x3 box sum from shifted slices (much cheaper than conv2d on tiny batches),
    # plus 4x the centre for the kernel's 5.
    rows = xf[:, :, :-2] + xf[:, :, 1:-1] + xf[:, :, 2:]
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]
    degenerate = xf.clone()
    degenerate[:, :, 1:-1, 1:-1] = ((box + 4.0 * xf[:, :, 1:-1, 1:-1]) / 13.0).round_()
    return degenerate


def adjust_brightness(x: torch.Tensor, factor: Scalar) -> torch.Tensor:
    """PIL ``ImageEnhance.Brightness``: blend with black."""
    return _blend(_brightness_degenerate(x), x, factor)


def adjust_color(x: torch.Tensor, factor: Scalar) -> torch.Tensor:
    """PIL ``ImageEnhance.Color``: blend with the image's own grayscale (L) version."""
    return _blend(_color_degenerate(x), x, factor)


def adjust_contrast(x: torch.Tensor, factor: Scalar) -> torch.Tensor:
    """PIL ``ImageEnhance.Contrast``: blend with the (rounded) mean grey level of each image."""
    return _blend(_contrast_degenerate(x), x, factor)


def adjust_sharpness(x: torch.Tensor, factor: Scalar) -> torch.Tensor:
    """PIL ``ImageEnhance.Sharpness``: blend with ``ImageFilter.SMOOTH`` (3x3 kernel
    [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13) applied to interior pixels; the one-pixel border is
    left as is, as PIL's filter does."""
    return _blend(_sharpness_degenerate(x), x, factor)


def affine(
    x: torch.Tensor, matrix: torch.Tensor, fill: Sequence[int] | int = 0, mode: str = "bilinear"
) -> torch.Tensor:
    """Resample ``x`` with per-sample affine maps in PIL's convention.

    ``matrix`` is (B, 2, 3), mapping an *output* pixel position to the *input* position it
    samples, in continuous pixel coordinates (pixel ``i`` covers ``[i, i + 1)``), exactly like
    ``PIL.Image.transform(..., Image.AFFINE, data)``. Pixels sampled from outside the image get
    ``fill``. One ``grid_sample`` for the whole batch.
    """
    b, c, h, w = x.shape
    m = matrix.to(torch.float64)
    # Conjugate the pixel-space map with the pixel <-> [-1, 1] normalisation of
    # grid_sample(align_corners=False) to get each sample's normalised map theta, where the
    # map is (a GPU's maps never come back to the host).
    f64 = dict(device=m.device, dtype=torch.float64)
    to_norm = _filled([2.0 / w, 0, -1, 0, 2.0 / h, -1, 0, 0, 1], **f64).view(3, 3)
    from_norm = _filled([w / 2.0, 0, w / 2.0, 0, h / 2.0, h / 2.0, 0, 0, 1], **f64).view(3, 3)
    m3 = torch.cat([m, _filled([0.0, 0.0, 1.0], **f64).expand(b, 1, 3)], 1)
    theta = (to_norm @ m3 @ from_norm)[:, :2].to(torch.float32).to(x.device, non_blocking=True)
    # The grid theta @ (xn, yn, 1) built from two broadcast adds (affine_grid's bmm is
    # several times slower for these small images).
    xn = (torch.arange(w, device=x.device, dtype=torch.float32) * 2 + 1) / w - 1
    yn = (torch.arange(h, device=x.device, dtype=torch.float32) * 2 + 1) / h - 1
    grid = torch.empty((b, h, w, 2), device=x.device, dtype=torch.float32)
    for k in range(2):
        along_x = theta[:, k, 0:1, None] * xn + theta[:, k, 2:3, None]  # (b, 1, w)
        along_y = theta[:, k, 1:2, None] * yn.view(1, h, 1)  # (b, h, 1)
        torch.add(along_x, along_y, out=grid[..., k])
    out = F.grid_sample(
        x.to(torch.float32), grid, mode=mode, padding_mode="border", align_corners=False
    )
    # PIL: a sample point inside [0, W) x [0, H) is interpolated with edge-clamped
    # neighbours, one outside gets the fill colour (no blending of fill into the border).
    # The small margin puts float32 round-off at exactly the far edge outside, like PIL.
    ok = (grid >= -1.0) & (grid < 1.0 - 1e-5)
    inside = (ok[..., 0] & ok[..., 1]).unsqueeze(1)
    fill_t = _filled(fill if isinstance(fill, Sequence) else [fill], x.device, torch.float32)
    fill_t = fill_t.expand(c) if fill_t.numel() == 1 else fill_t
    out = torch.where(inside, out, fill_t.view(1, c, 1, 1))
    # PIL's bilinear transform truncates to uint8 rather than rounding; the 1e-3 keeps float32
    # round-off on exact integers (e.g. integer shifts) from truncating one level down.
    return out.add_(1e-3).clamp_(0, 255).to(torch.uint8)


def _rotate_matrix(degrees: torch.Tensor, h: int, w: int) -> torch.Tensor:
    t = torch.deg2rad(degrees.to(torch.float64))
    cos, sin = torch.cos(t), torch.sin(t)
    cx, cy = w / 2.0, h / 2.0
    # PIL Image.rotate: counter-clockwise about the image centre.
    row0 = torch.stack([cos, -sin, cx - cos * cx + sin * cy], -1)
    row1 = torch.stack([sin, cos, cy - sin * cx - cos * cy], -1)
    return torch.stack([row0, row1], 1)


def _shift_matrix(
    n: int, *, shx: Scalar = 0.0, shy: Scalar = 0.0, tx: Scalar = 0.0, ty: Scalar = 0.0
) -> torch.Tensor:
    """PIL affine data (1, shx, tx, shy, 1, ty) per sample (timm's shear/translate ops)."""
    cpu = torch.device("cpu")
    shx, shy, tx, ty = (_per_sample(v, n, cpu, torch.float64).view(n) for v in (shx, shy, tx, ty))
    one = torch.ones(n, dtype=torch.float64)
    return torch.stack([torch.stack([one, shx, tx], -1), torch.stack([shy, one, ty], -1)], 1)


def rotate(x: torch.Tensor, degrees: Scalar, fill: Sequence[int] | int = 0) -> torch.Tensor:
    """PIL ``Image.rotate(degrees)``: counter-clockwise about the centre, bilinear, ``fill``."""
    n, _, h, w = x.shape
    deg = _per_sample(degrees, n, torch.device("cpu"), torch.float64).view(n)
    return affine(x, _rotate_matrix(deg, h, w), fill)


def shear_x(x: torch.Tensor, factor: Scalar, fill: Sequence[int] | int = 0) -> torch.Tensor:
    """timm ``shear_x``: output (x, y) samples input (x + factor * y, y)."""
    return affine(x, _shift_matrix(x.shape[0], shx=factor), fill)


def shear_y(x: torch.Tensor, factor: Scalar, fill: Sequence[int] | int = 0) -> torch.Tensor:
    """timm ``shear_y``: output (x, y) samples input (x, y + factor * x)."""
    return affine(x, _shift_matrix(x.shape[0], shy=factor), fill)


def translate_x(x: torch.Tensor, pixels: Scalar, fill: Sequence[int] | int = 0) -> torch.Tensor:
    """timm ``translate_x_abs``: output (x, y) samples input (x + pixels, y)."""
    return affine(x, _shift_matrix(x.shape[0], tx=pixels), fill)


def translate_y(x: torch.Tensor, pixels: Scalar, fill: Sequence[int] | int = 0) -> torch.Tensor:
    """timm ``translate_y_abs``: output (x, y) samples input (x, y + pixels)."""
    return affine(x, _shift_matrix(x.shape[0], ty=pixels), fill)


# Categories of timm's RandAugment ops, by how rand_augment batches them.
_LUT_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Posterize",
    "PosterizeIncreasing",
    "Solarize",
    "SolarizeIncreasing",
    "SolarizeAdd",
)
_BLEND_OPS = {
    "Color": _color_degenerate,
    "Contrast": _contrast_degenerate,
    "Brightness": _brightness_degenerate,
    "Sharpness": _sharpness_degenerate,
}
_GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")


def _op_lut(name: str, x: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """(n, C, 256) table for a point op; timm's level-to-arg from ``frac`` = magnitude / 10."""
    n, c = x.shape[:2]
    if name == "AutoContrast":
        return _auto_contrast_lut(x)
    if name == "Equalize":
        return _equalize_lut(x)
    if name == "Invert":
        lut = _invert_lut(n, x.device)
    elif name == "Posterize":
        lut = _posterize_lut((frac * 4).floor(), n, x.device)
    elif name == "PosterizeIncreasing":
        lut = _posterize_lut(4 - (frac * 4).floor(), n, x.device)
    elif name == "Solarize":
        lut = _solarize_lut((frac * 256).floor().clamp(max=256), n, x.device)
    elif name == "SolarizeIncreasing":
        lut = _solarize_lut(256 - (frac * 256).floor().clamp(max=256), n, x.device)
    else:  # SolarizeAdd
        lut = _solarize_add_lut((frac * 110).floor().clamp(max=128), 128, n, x.device)
    return lut.expand(n, c, 256)


def _op_matrices(is_op: Callable[[str], torch.Tensor], lvl: torch.Tensor, h: int, w: int):
    """Pixel-space affine maps for a batch of geometric ops, with timm's level-to-arg; ``lvl``
    = signed magnitude / 10 and ``is_op(name)`` which samples run op ``name`` (bool, on lvl's
    device). Built in one vectorised pass: an angle of 0 gives the identity, and each sample has
    at most one non-zero term (none: the identity map)."""
    lvl = lvl.to(torch.float64)

    def only(name: str) -> torch.Tensor:
        return is_op(name).to(torch.float64) * lvl

    m = _rotate_matrix(only("Rotate") * 30.0, h, w)
    m[:, 0, 1] += only("ShearX") * 0.3
    m[:, 1, 0] += only("ShearY") * 0.3
    m[:, 0, 2] += only("TranslateXRel") * 0.45 * w
    m[:, 1, 2] += only("TranslateYRel") * 0.45 * h
    return m


_Segment = list[tuple[str, slice]]  # a category's ops: (name, its rows' slice of the category)


def _draw_layer(
    b: int, gen: torch.Generator, ops: Sequence[str], prob: float, mean: float, std: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's draws per image, in timm's order: op index, applied?, magnitude, sign."""
    op = torch.randint(len(ops), (b,), generator=gen, device=gen.device)
    applied = _rand((b,), gen) < prob
    f64 = dict(dtype=torch.float64, device=gen.device)
    if math.isinf(std):
        mag = _rand((b,), gen) * mean
    elif std > 0:
        mag = mean + std * torch.randn(b, generator=gen, **f64)
    else:
        mag = torch.full((b,), float(mean), **f64)
    # timm's _randomly_negate: negative when random() > 0.5.
    return op, applied, mag, torch.where(_rand((b,), gen) > 0.5, -1.0, 1.0)


def _group_applied_ops(
    names: Sequence[str], op: torch.Tensor, applied: torch.Tensor
) -> tuple[dict[str, _Segment], list[int]]:
    """Applied images by category and op, and the row order making each a contiguous slice."""
    groups: dict[int, list[int]] = {}
    for i, (k, a) in enumerate(zip(op.tolist(), applied.tolist(), strict=True)):
        if a:
            groups.setdefault(k, []).append(i)
    segs: dict[str, _Segment] = {"lut": [], "blend": [], "geo": []}
    rows: dict[str, list[int]] = {cat: [] for cat in segs}
    for k in sorted(groups):
        name = names[k]
        cat = "lut" if name in _LUT_OPS else "geo" if name in _GEOMETRIC else "blend"
        segs[cat].append((name, slice(len(rows[cat]), len(rows[cat]) + len(groups[k]))))
        rows[cat] += groups[k]
    return {c: g for c, g in segs.items() if g}, [i for cat in rows.values() for i in cat]


def _run_lut_ops(seg: _Segment, xs: torch.Tensor, frac: torch.Tensor, *_: object) -> torch.Tensor:
    """The point ops of a segment through one table lookup."""
    return _apply_lut(xs, torch.cat([_op_lut(n, xs[s], frac[s]) for n, s in seg]))


def _run_blend_ops(
    seg: _Segment, xs: torch.Tensor, frac: torch.Tensor, lvl: torch.Tensor, *_: object
) -> torch.Tensor:
    """The enhance ops of a segment (brightness, color, contrast, sharpness) as one blend."""
    degs = [_BLEND_OPS[n.removesuffix("Increasing")](xs[s]).expand(xs[s].shape) for n, s in seg]
    factors = [_blend_factor(n, frac[s], lvl[s]) for n, s in seg]
    return _blend(torch.cat(degs), xs, torch.cat(factors))


def _blend_factor(name: str, frac: torch.Tensor, lvl: torch.Tensor) -> torch.Tensor:
    """timm's enhance level-to-arg: 1 + 0.9 * signed level (increasing), else 0.1 to 1.9."""
    return (1.0 + 0.9 * lvl).clamp(min=0.1) if name.endswith("Increasing") else frac * 1.8 + 0.1


def _run_geometric_ops(
    seg: _Segment, xs: torch.Tensor, _: torch.Tensor, lvl: torch.Tensor, fill: Sequence[int] | int
) -> torch.Tensor:
    """The geometric ops of a segment through one ``grid_sample``."""
    kinds = [name for name, s in seg for _ in range(s.stop - s.start)]

    def is_op(name: str) -> torch.Tensor:
        return torch.tensor([k == name for k in kinds]).to(lvl.device, non_blocking=True)

    return affine(xs, _op_matrices(is_op, lvl, xs.shape[-2], xs.shape[-1]), fill)


def _layer_on_device(
    x: torch.Tensor,
    names: Sequence[str],
    op: torch.Tensor,
    applied: torch.Tensor,
    frac: torch.Tensor,
    lvl: torch.Tensor,
    fill: Sequence[int] | int,
) -> torch.Tensor:
    """One layer with no host decision: every point op's table, every enhance op's blend and
    every geometric op's map is made for every image, and each image takes its own op's result
    on the device. The same results as the batched path, which groups images by op on the
    host (reading the draws back, a sync per layer on a GPU), at about three times the work."""
    n, c = x.shape[:2]
    lut, deg, factor = _levels(n, x.device).expand(n, c, 256), x.to(torch.float32), frac
    is_lut, is_blend = torch.zeros_like(applied), torch.zeros_like(applied)
    for k, name in enumerate(names):
        mine = op == k
        if name in _LUT_OPS:
            lut = torch.where(mine.view(n, 1, 1), _op_lut(name, x, frac), lut)
            is_lut = is_lut | mine
        elif name not in _GEOMETRIC:
            base = _BLEND_OPS[name.removesuffix("Increasing")](x).expand(x.shape)
            deg = torch.where(mine.view(n, 1, 1, 1), base, deg)
            factor = torch.where(mine, _blend_factor(name, frac, lvl), factor)
            is_blend = is_blend | mine

    def is_op(name: str) -> torch.Tensor:
        return op == names.index(name)

    geo = affine(x, _op_matrices(is_op, lvl, x.shape[-2], x.shape[-1]), fill)
    is_lut, is_blend = (applied & is_lut).view(n, 1, 1, 1), (applied & is_blend).view(n, 1, 1, 1)
    out = torch.where(
        is_lut, _apply_lut(x, lut), torch.where(is_blend, _blend(deg, x, factor), geo)
    )
    return torch.where(applied.view(n, 1, 1, 1), out, x)


_RUN_CATEGORY = {"lut": _run_lut_ops, "blend": _run_blend_ops, "geo": _run_geometric_ops}


def rand_augment(
    x: torch.Tensor,
    gen: torch.Generator,
    num_ops: int = 2,
    magnitude: float = 9,
    magnitude_std: float = 0.5,
    increasing: bool = True,
    fill: Sequence[int] | None = (124, 116, 104),
    prob: float = 0.5,
    magnitude_max: float | None = None,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """timm RandAugment (default ``rand-m9-mstd0.5-inc1``) on a uint8 batch.

    Per image and per layer: one op drawn uniformly (with replacement) from timm's list,
    applied with probability ``prob``, magnitude ~ N(magnitude, magnitude_std) clipped to
    [0, magnitude_max or 10] (uniform(0, magnitude) when ``magnitude_std`` is inf), random
    sign for the signed ops. Per layer, all images whose op is a point op go through one
    table lookup, all enhance ops through one blend and all geometric ops through one
    ``grid_sample``. Geometric ops use bilinear interpolation (timm's DeiT setting picks
    bicubic) and ``fill`` (default: timm's ImageNet ``img_mean``; ``None`` means black).

    ``sync_free`` (default: off the CPU) computes every op for every image and selects on the
    device instead (:func:`_layer_on_device`): the same images from the same draws, with no
    value read back to the host; draw on a generator on the images' device for no copy either.
    """
    _check_images(x, "rand_augment", uint8=True)
    names = RAND_INCREASING_TRANSFORMS if increasing else RAND_TRANSFORMS
    upper = _LEVEL_DENOM if magnitude_max is None else float(magnitude_max)
    fill = 0 if fill is None else fill
    out = x.clone()
    for _ in range(num_ops):
        op, applied, mag, sign = _draw_layer(len(x), gen, names, prob, magnitude, magnitude_std)
        if _sync_free(x, sync_free):
            op, applied, mag, sign = (
                t.to(x.device, non_blocking=True) for t in (op, applied, mag, sign)
            )
            frac = mag.clamp(0.0, upper) / _LEVEL_DENOM
            out = _layer_on_device(out, names, op, applied, frac, frac * sign, fill)
            continue
        segs, order = _group_applied_ops(names, op, applied)
        if not order:
            continue
        perm = torch.tensor(order)
        frac = (mag.cpu()[perm].clamp(0.0, upper) / _LEVEL_DENOM).to(x.device, non_blocking=True)
        lvl = frac * sign.cpu()[perm].to(x.device, non_blocking=True)
        perm = perm.to(x.device, non_blocking=True)
        results, pos = [], 0
        for cat, seg in segs.items():  # one batched call per category present
            s = slice(pos, pos + seg[-1][1].stop)
            results.append(_RUN_CATEGORY[cat](seg, out[perm[s]], frac[s], lvl[s], fill))
            pos = s.stop
        out[perm] = torch.cat(results)
    return out
