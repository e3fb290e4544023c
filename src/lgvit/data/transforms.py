"""Batched DeiT training augmentations on in-memory image tensors (airbench-style).

Images are ``(B, 3, H, W)`` tensors: ``uint8`` for the geometric/colour stage, ``float32``
(normalised) for random erasing and mixup/cutmix. Every random function takes an explicit
``torch.Generator``; random *parameters* are drawn on the generator's device and then moved
to the images' device, so the same code runs on CPU or GPU tensors and a run is reproducible.
Those moves are non-blocking: a blocking host-to-GPU copy waits for all the work already
queued (the training step), so a recipe on the GPU would stall the host at every op.

The semantics follow timm / torchvision (``RandomCrop``, ``RandomResizedCrop``,
``rand-m9-mstd0.5-inc1`` RandAugment, ``RandomErasing``, ``Mixup``); deviations are noted
in the individual docstrings. RandAugment and its ops live in :mod:`lgvit.data.randaugment`
(re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF

from lgvit.core.constants import CROP_PCT, IMAGENET_MEAN, IMAGENET_STD
from lgvit.core.errors import LgvitError
from lgvit.data.randaugment import (
    RAND_INCREASING_TRANSFORMS,
    RAND_TRANSFORMS,
    _check_images,
    _filled,
    _rand,
    _sync_free,
    adjust_brightness,
    adjust_color,
    adjust_contrast,
    adjust_sharpness,
    affine,
    auto_contrast,
    equalize,
    invert,
    posterize,
    rand_augment,
    rotate,
    shear_x,
    shear_y,
    solarize,
    solarize_add,
    translate_x,
    translate_y,
)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "RAND_INCREASING_TRANSFORMS",
    "RAND_TRANSFORMS",
    "adjust_brightness",
    "adjust_color",
    "adjust_contrast",
    "adjust_sharpness",
    "affine",
    "auto_contrast",
    "equalize",
    "invert",
    "mean_to_fill",
    "mixup_cutmix",
    "normalize",
    "one_hot_smooth",
    "posterize",
    "rand_augment",
    "random_crop_flip",
    "random_erasing",
    "random_resized_box",
    "random_resized_crop",
    "INTERPOLATIONS",
    "resize_center_crop",
    "rotate",
    "shear_x",
    "shear_y",
    "soft_target_cross_entropy",
    "solarize",
    "solarize_add",
    "translate_x",
    "translate_y",
]


# --------------------------------------------------------------------------- helpers


def _randint(low: int, high: torch.Tensor | int, shape: tuple[int, ...], gen: torch.Generator):
    """Uniform integers in [low, high) with a per-element ``high`` (torch.randint can't)."""
    u = _rand(shape, gen)
    return (low + (u * (high - low)).floor()).long()


def _device_gen(gen: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` whose seed comes from ``gen`` (CPU generators can't fill GPU
    tensors, and drawing big noise tensors on the CPU then copying would be slow)."""
    if gen.device == device:
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
    return torch.Generator(device=device).manual_seed(seed)


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    # Round (not truncate) after resampling, as PIL's resize does.
    return x.round_().clamp_(0, 255).to(torch.uint8)


def mean_to_fill(mean: Sequence[float]) -> tuple[int, ...]:
    """timm's ``img_mean`` fill colour for RandAugment: round(255 * mean), capped at 255."""
    return tuple(min(255, round(255 * m)) for m in mean)


# --------------------------------------------------------------------------- crops / resize


def random_crop_flip(
    x: torch.Tensor,
    size: int,
    padding: int = 4,
    flip: bool | torch.Tensor = True,
    *,
    gen: torch.Generator,
) -> torch.Tensor:
    """torchvision ``RandomCrop(size, padding)`` (zero padding) + ``RandomHorizontalFlip(0.5)``.

    Vectorised: the batch is padded once and all crops are taken with two ``gather`` calls.
    Draw order from ``gen`` (all on ``gen.device``): ``top = randint(0, Hp - size + 1, (B,))``,
    ``left = randint(0, Wp - size + 1, (B,))``, then (if ``flip``) ``flipped = rand(B) < 0.5``.
    ``flip`` may instead be a (B,) bool tensor saying which images to mirror (nothing is drawn
    for it): the loader's alternating flips.
    """
    _check_images(x, "random_crop_flip", uint8=None)
    b, c, h, w = x.shape
    hp, wp = h + 2 * padding, w + 2 * padding
    if hp < size or wp < size:
        raise LgvitError(f"random_crop_flip: crop {size} larger than padded image {hp}x{wp}")
    top = torch.randint(0, hp - size + 1, (b,), generator=gen, device=gen.device)
    left = torch.randint(0, wp - size + 1, (b,), generator=gen, device=gen.device)
    ar = torch.arange(size, device=gen.device)
    cols = ar.expand(b, size)
    flipped = _flip_mask(flip, b, gen)
    if flipped is not None:
        # Folding the flip into the column index costs nothing extra.
        cols = torch.where(flipped[:, None], size - 1 - ar, ar)
    if padding == 0 and (h, w) == (size, size):  # nothing to crop (a streamed batch): flips
        return _flip_only(x, flipped)
    rows = (top[:, None] + ar).to(x.device, non_blocking=True)
    cols = (left[:, None] + cols).to(x.device, non_blocking=True)
    xp = F.pad(x, (padding,) * 4) if padding > 0 else x
    # Two gathers (rows, then columns) beat one 4-D advanced index by ~2x on CPU.
    xr = xp.gather(2, rows.view(b, 1, size, 1).expand(b, c, size, wp))
    return xr.gather(3, cols.view(b, 1, 1, size).expand(b, c, size, size))


def _flip_only(x: torch.Tensor, flipped: torch.Tensor | None) -> torch.Tensor:
    """``x`` with the images ``flipped`` mirrored, as a new tensor (the gathers' bytes, at a
    fraction of their cost: 8 ms instead of 28 for 128 images of 224 px on 2 CPU cores)."""
    if flipped is None:
        return x.clone()
    flipped = flipped.to(x.device, non_blocking=True)
    if x.device.type != "cpu":  # no host sync: the mask stays on the device
        return torch.where(flipped.view(-1, 1, 1, 1), x.flip(3), x)
    out, chosen = x.clone(), flipped.nonzero().flatten()
    out[chosen] = x[chosen].flip(3)
    return out


def _flip_mask(flip: bool | torch.Tensor, b: int, gen: torch.Generator) -> torch.Tensor | None:
    """Which of ``b`` images to mirror: given as a (B,) bool tensor, drawn with p=0.5, or none."""
    if isinstance(flip, torch.Tensor):
        if flip.shape != (b,) or flip.dtype != torch.bool:
            raise LgvitError(f"flip mask: expected a ({b},) bool tensor, got {flip.dtype} "
                             f"{tuple(flip.shape)}")  # fmt: skip
        return flip.to(gen.device, non_blocking=True)
    return (torch.rand(b, generator=gen, device=gen.device) < 0.5) if flip else None


def _crop_theta(
    top: torch.Tensor,
    left: torch.Tensor,
    ch: torch.Tensor,
    cw: torch.Tensor,
    in_hw: tuple[int, int],
    flip: torch.Tensor | None,
) -> torch.Tensor:
    """affine_grid theta (align_corners=False) that maps the output square onto a crop box."""
    h, w = in_hw
    top, left, ch, cw = (t.to(torch.float64) for t in (top, left, ch, cw))
    # Normalised input coordinate x_in = (cw / W) * x_out + (2 * left + cw) / W - 1.
    sx, sy = cw / w, ch / h
    tx, ty = (2 * left + cw) / w - 1, (2 * top + ch) / h - 1
    if flip is not None:
        sx = torch.where(flip, -sx, sx)
    zero = torch.zeros_like(sx)
    theta = torch.stack([torch.stack([sx, zero, tx], -1), torch.stack([zero, sy, ty], -1)], 1)
    return theta.to(torch.float32)


def random_resized_crop(
    x: torch.Tensor,
    size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    *,
    gen: torch.Generator,
    flip: bool | torch.Tensor = True,
) -> torch.Tensor:
    """torchvision ``RandomResizedCrop(size, scale, ratio, bicubic)`` + horizontal flip, uint8.

    ``flip``: True (each image mirrored with p=0.5), False, or a (B,) bool tensor of the
    images to mirror.

    Box sampling follows torchvision exactly (10 attempts, then the centre-crop fallback),
    vectorised over the batch. The resize is a single bicubic ``grid_sample`` over the batch
    with per-sample affine grids (border padding), so, unlike torchvision, pixels just outside
    the crop box can contribute to its edge and there is no antialiasing when a crop is
    shrunk (irrelevant for CIFAR, where crops are always enlarged).
    """
    _check_images(x, "random_resized_crop", uint8=None)
    b, _, h, w = x.shape
    area = h * w
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    target_area = area * (scale[0] + (scale[1] - scale[0]) * _rand((b, 10), gen))
    aspect = torch.exp(log_r[0] + (log_r[1] - log_r[0]) * _rand((b, 10), gen))
    cw = torch.sqrt(target_area * aspect).round()
    ch = torch.sqrt(target_area / aspect).round()
    ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = ok.to(torch.int8).argmax(1, keepdim=True)  # first successful attempt
    found = ok.any(1)
    cw, ch = cw.gather(1, first).squeeze(1), ch.gather(1, first).squeeze(1)
    # torchvision's fallback: centre crop clamped to the allowed aspect-ratio range.
    in_ratio = w / h
    if in_ratio < min(ratio):
        fw, fh = w, round(w / min(ratio))
    elif in_ratio > max(ratio):
        fw, fh = round(h * max(ratio)), h
    else:
        fw, fh = w, h
    cw = torch.where(found, cw, torch.full_like(cw, fw))
    ch = torch.where(found, ch, torch.full_like(ch, fh))
    top = (_rand((b,), gen) * (h - ch + 1)).floor()
    left = (_rand((b,), gen) * (w - cw + 1)).floor()
    top = torch.where(found, top, torch.full_like(top, (h - fh) // 2))
    left = torch.where(found, left, torch.full_like(left, (w - fw) // 2))
    flipped = _flip_mask(flip, b, gen)
    theta = _crop_theta(top, left, ch, cw, (h, w), flipped).to(x.device, non_blocking=True)
    grid = F.affine_grid(theta, [b, 3, size, size], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bicubic", padding_mode="border", align_corners=False)
    return _to_uint8(out)


# timm's interpolation names that torchvision's tensor resize has (PIL-only lanczos/box/hamming
# are not among them).
INTERPOLATIONS = {
    "bicubic": TF.InterpolationMode.BICUBIC,
    "bilinear": TF.InterpolationMode.BILINEAR,
    "nearest": TF.InterpolationMode.NEAREST_EXACT,  # PIL's nearest (timm's), not legacy torch's
}


def random_resized_box(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: Any
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (left, top, right, bottom): 10 tries, then center.
    One image's, drawn with a ``random.Random`` where its file is decoded (a streamed split's
    workers, a shard's); :func:`random_resized_crop` draws a whole batch's."""
    area = width * height
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_r))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.randint(0, height - h), rng.randint(0, width - w)
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _resize(x: torch.Tensor, hw: tuple[int, int], interpolation: str = "bicubic") -> torch.Tensor:
    """Antialiased, uint8 in and out: torchvision's resize, whose uint8 kernel stays within one
    level of PIL's (timm's eval transform) where float interpolation + rounding was up to 4 off,
    and ran 3.8-5.5x faster (four runs of ``benchmarks/bench_decode.py``)."""
    if tuple(x.shape[-2:]) == hw:
        return x
    mode = INTERPOLATIONS[interpolation]
    return TF.resize(x, list(hw), interpolation=mode, antialias=mode != INTERPOLATIONS["nearest"])


def resize_center_crop(
    x: torch.Tensor, size: int, crop_pct: float = CROP_PCT, interpolation: str = "bicubic"
) -> torch.Tensor:
    """Eval transform: resize the shorter side to ``floor(size / crop_pct)`` (``interpolation``:
    one of ``INTERPOLATIONS``), then centre-crop ``size`` (timm's eval recipe), uint8 in and out.

    Images that are already ``size x size`` are returned unchanged: they are taken to be
    pre-cropped at the training resolution (CIFAR at 32 px), where the 0.875 resize-then-crop
    would only throw away the border.
    """
    _check_images(x, "resize_center_crop", uint8=True)
    h, w = x.shape[-2:]
    if h == w == size:
        return x
    if not 0 < crop_pct <= 1:
        raise LgvitError(f"resize_center_crop: crop_pct must be in (0, 1], got {crop_pct}")
    if interpolation not in INTERPOLATIONS:
        raise LgvitError(
            f"resize_center_crop: interpolation {interpolation!r} is not one of "
            f"{', '.join(INTERPOLATIONS)}"
        )
    scale_size = math.floor(size / crop_pct)
    # torchvision Resize(int): shorter side -> scale_size, longer side truncated.
    if h <= w:
        nh, nw = scale_size, int(scale_size * w / h)
    else:
        nh, nw = int(scale_size * h / w), scale_size
    x = _resize(x, (nh, nw), interpolation)
    top = int(round((nh - size) / 2.0))
    left = int(round((nw - size) / 2.0))
    return x[:, :, top : top + size, left : left + size].contiguous()


# --------------------------------------------------------------------------- float stage


def normalize(
    x: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> torch.Tensor:
    """(x / 255 - mean) / std as float32; mean/std in [0, 1] units, one value per channel."""
    _check_images(x, "normalize", uint8=None)
    c = x.shape[1]
    if len(mean) != c or len(std) != c:
        raise LgvitError(f"normalize: need {c} mean/std values, got {len(mean)}/{len(std)}")
    # One multiply-add instead of three elementwise passes; the constants are filled in on the
    # device (float64 arithmetic, then float32, as torch's own).
    scale = _filled([1.0 / (255.0 * v) for v in std], x.device, torch.float32).view(1, c, 1, 1)
    shift = _filled([m / v for m, v in zip(mean, std, strict=True)], x.device, torch.float32)
    shift = shift.view(1, c, 1, 1)
    # In place on the float copy: the same values, one large allocation instead of two (42 ms
    # instead of 70 for 128 images of 224 px on 2 CPU cores).
    out = x.to(torch.float32, copy=True)
    return torch.addcmul(-shift, out, scale, out=out)


def random_erasing(
    x: torch.Tensor,
    gen: torch.Generator,
    prob: float = 0.25,
    mode: str = "pixel",
    min_area: float = 0.02,
    max_area: float = 1 / 3,
    min_aspect: float = 0.3,
    max_aspect: float | None = None,
    min_count: int = 1,
    max_count: int = 1,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """timm ``RandomErasing`` (batch applied per sample) on normalised float images.

    Per image with probability ``prob``: ``count`` rectangles (random in [min_count,
    max_count]), each from up to 10 attempts with area fraction ~ U(min_area, max_area) / count
    and log-uniform aspect ratio; a box is used only if it fits strictly inside the image.
    Fill: 'pixel' per-pixel N(0, 1), 'rand' per-channel N(0, 1), 'const' zeros.
    Returns a new tensor. ``sync_free`` (default: off the CPU) masks every image instead of
    picking the erased ones on the host: the same boxes from the same draws, but noise is drawn
    for every image, so 'pixel' and 'rand' fills differ from the picking path's.
    """
    _check_images(x, "random_erasing", uint8=False)
    if mode not in ("pixel", "rand", "const"):
        raise LgvitError(f"random_erasing: unknown mode {mode!r} (use 'pixel', 'rand', 'const')")
    b, c, h, w = x.shape
    area = h * w
    max_aspect = 1.0 / min_aspect if max_aspect is None else max_aspect
    log_a = (math.log(min_aspect), math.log(max_aspect))
    do = _rand((b,), gen) < prob
    if min_count == max_count:
        count = torch.full((b,), min_count, dtype=torch.float64, device=gen.device)
    else:
        count = _randint(min_count, max_count + 1, (b,), gen).to(torch.float64)
    out = x.clone()
    noise_gen = _device_gen(gen, x.device)
    ys = torch.arange(h, device=x.device).view(1, 1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, 1, w)
    for i in range(max_count):
        target = (min_area + (max_area - min_area) * _rand((b, 10), gen)) * area / count[:, None]
        aspect = torch.exp(log_a[0] + (log_a[1] - log_a[0]) * _rand((b, 10), gen))
        eh = torch.sqrt(target * aspect).round()
        ew = torch.sqrt(target / aspect).round()
        ok = (ew < w) & (eh < h)
        first = ok.to(torch.int8).argmax(1, keepdim=True)
        eh, ew = eh.gather(1, first).squeeze(1), ew.gather(1, first).squeeze(1)
        top = (_rand((b,), gen) * (h - eh + 1)).floor()  # random.randint(0, h - eh)
        left = (_rand((b,), gen) * (w - ew + 1)).floor()
        active = do & (count > i) & ok.any(1)
        if _sync_free(x, sync_free):
            out = _erase_all(out, active, (top, left, eh, ew), mode, noise_gen)
            continue
        rows = active.nonzero().view(-1)
        if rows.numel() == 0:
            continue
        t, le, eh, ew = (
            v[rows].to(x.device, non_blocking=True).view(-1, 1, 1, 1) for v in (top, left, eh, ew)
        )
        mask = (ys >= t) & (ys < t + eh) & (xs >= le) & (xs < le + ew)
        n = rows.numel()
        if mode == "pixel":
            fill = torch.randn((n, c, h, w), generator=noise_gen, device=x.device, dtype=x.dtype)
        elif mode == "rand":
            fill = torch.randn((n, c, 1, 1), generator=noise_gen, device=x.device, dtype=x.dtype)
        else:
            fill = torch.zeros((), device=x.device, dtype=x.dtype)
        r = rows.to(x.device, non_blocking=True)
        out[r] = torch.where(mask, fill, out[r])
    return out


def _erase_all(
    x: torch.Tensor, active: torch.Tensor, box: tuple[torch.Tensor, ...], mode: str, gen
) -> torch.Tensor:
    """One round of erasing as a mask over the whole batch (``active``: which images get their
    box ``(top, left, height, width)``), with no host decision."""
    b, c, h, w = x.shape
    t, le, eh, ew = (v.to(x.device, non_blocking=True).view(b, 1, 1, 1) for v in box)
    ys = torch.arange(h, device=x.device).view(1, 1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, 1, w)
    mask = (ys >= t) & (ys < t + eh) & (xs >= le) & (xs < le + ew)
    mask &= active.to(x.device, non_blocking=True).view(b, 1, 1, 1)
    if mode == "const":
        return torch.where(mask, torch.zeros((), device=x.device, dtype=x.dtype), x)
    shape = (b, c, h, w) if mode == "pixel" else (b, c, 1, 1)
    return torch.where(mask, torch.randn(shape, generator=gen, device=x.device, dtype=x.dtype), x)


def one_hot_smooth(y: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """timm's smoothed one-hot: off = smoothing / K everywhere, on = 1 - smoothing + off."""
    off = smoothing / num_classes
    on = 1.0 - smoothing + off
    t = torch.full((y.shape[0], num_classes), off, dtype=torch.float32, device=y.device)
    return t.scatter_(1, y.view(-1, 1).long(), on)


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of sum(-targets * log_softmax(logits)) (timm SoftTargetCrossEntropy)."""
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


def _rand_bbox(
    rs: np.random.RandomState, h: int, w: int, lam: np.ndarray
) -> tuple[np.ndarray, ...]:
    """timm ``rand_bbox`` (no margin), vectorised over a vector of lambdas."""
    ratio = np.sqrt(1.0 - lam)
    cut_h, cut_w = (h * ratio).astype(np.int64), (w * ratio).astype(np.int64)
    cy = rs.randint(0, h, size=lam.shape)
    cx = rs.randint(0, w, size=lam.shape)
    yl, yh = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + cut_h // 2, 0, h)
    xl, xh = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + cut_w // 2, 0, w)
    return yl, yh, xl, xh


def mixup_cutmix(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    gen: torch.Generator,
    mixup_alpha: float = 0.8,
    cutmix_alpha: float = 1.0,
    switch_prob: float = 0.5,
    prob: float = 1.0,
    label_smoothing: float = 0.1,
    mode: str = "batch",
    correct_lam: bool = True,
    sync_free: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """timm ``Mixup`` ('batch' or 'elem' mode): returns (mixed images, soft targets (B, K)).

    Each image is mixed with its mirror in the batch (``x.flip(0)``). 'batch': one
    lambda/box for the whole batch; 'elem': one per sample. With probability ``prob`` mixing
    happens: cutmix (chance ``switch_prob`` when both alphas > 0) or mixup, lam ~
    Beta(alpha, alpha); cutmix lam is corrected to the pasted box's area. Targets are
    ``lam * smooth(y) + (1 - lam) * smooth(y.flip(0))``. timm's numpy draws are reproduced
    with a ``numpy.random.RandomState`` seeded from ``gen``. Batch size must be even.
    ``sync_free`` (default: off the CPU) draws the same distributions with torch on ``gen``'s
    device instead (:func:`_mix_draws`) and decides nothing on the host.
    """
    _check_images(x, "mixup_cutmix", uint8=False)
    b, _, h, w = x.shape
    if b % 2:
        raise LgvitError(f"mixup_cutmix: batch size must be even, got {b}")
    if mode not in ("batch", "elem"):
        raise LgvitError(f"mixup_cutmix: unsupported mode {mode!r} (use 'batch' or 'elem')")
    args = (mixup_alpha, cutmix_alpha, switch_prob, prob, correct_lam)
    if _sync_free(x, sync_free):
        lam, cut, *box = _mix_draws(gen, 1 if mode == "batch" else b, h, w, *args)
        lam, cut, *box = (v.to(x.device, non_blocking=True).expand(b) for v in (lam, cut, *box))
        return _mixed(x, y, num_classes, label_smoothing, lam.to(torch.float32), cut, box)
    seed = int(torch.randint(0, 2**32 - 1, (1,), generator=gen, device=gen.device))
    rs = np.random.RandomState(seed)
    n = 1 if mode == "batch" else b
    lam = np.ones(n, dtype=np.float64)
    use_cutmix = np.zeros(n, dtype=bool)
    if mixup_alpha > 0 or cutmix_alpha > 0:
        if mixup_alpha > 0 and cutmix_alpha > 0:
            use_cutmix = rs.rand(n) < switch_prob
            lam_mix = np.where(
                use_cutmix,
                rs.beta(cutmix_alpha, cutmix_alpha, size=n),
                rs.beta(mixup_alpha, mixup_alpha, size=n),
            )
        elif mixup_alpha > 0:
            lam_mix = rs.beta(mixup_alpha, mixup_alpha, size=n)
        else:
            use_cutmix = np.ones(n, dtype=bool)
            lam_mix = rs.beta(cutmix_alpha, cutmix_alpha, size=n)
        lam = np.where(rs.rand(n) < prob, lam_mix, lam)
    use_cutmix &= lam != 1.0
    yl, yh, xl, xh = _rand_bbox(rs, h, w, lam)
    if correct_lam:
        box_lam = 1.0 - (yh - yl) * (xh - xl) / float(h * w)
        lam = np.where(use_cutmix, box_lam, lam)
    out = x
    if mode == "batch":
        if lam[0] != 1.0:
            if use_cutmix[0]:
                box = (slice(None), slice(None), slice(yl[0], yh[0]), slice(xl[0], xh[0]))
                out = x.clone()
                out[box] = x.flip(0)[box]
            else:
                out = x * float(lam[0]) + x.flip(0) * (1.0 - float(lam[0]))
        lam_t = torch.full((b, 1), float(lam[0]), dtype=torch.float32, device=x.device)
        return out, _mixed_targets(y, num_classes, label_smoothing, lam_t, x.device)

    def on_device(v: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(v).to(x.device, non_blocking=True)

    lam_t = on_device(lam).to(torch.float32)
    box = [on_device(v) for v in (yl, yh, xl, xh)]
    return _mixed(x, y, num_classes, label_smoothing, lam_t, on_device(use_cutmix), box)


def _mix_draws(
    gen: torch.Generator,
    n: int,
    h: int,
    w: int,
    mixup_alpha: float,
    cutmix_alpha: float,
    switch_prob: float,
    prob: float,
    correct_lam: bool,
) -> tuple[torch.Tensor, ...]:
    """timm's Mixup draws for ``n`` lambdas with torch on ``gen``'s device: (lam float64,
    cutmix? bool, the box's top, bottom, left, right)."""
    f64 = dict(dtype=torch.float64, device=gen.device)

    def beta(alpha: float) -> torch.Tensor:
        # Beta(a, a) as a 2-way Dirichlet: torch.distributions takes no generator.
        return torch._sample_dirichlet(torch.full((n, 2), alpha, **f64), generator=gen)[:, 0]

    lam = torch.ones(n, **f64)
    cut = torch.zeros(n, dtype=torch.bool, device=gen.device)
    if mixup_alpha > 0 or cutmix_alpha > 0:
        if mixup_alpha > 0 and cutmix_alpha > 0:
            cut = _rand((n,), gen) < switch_prob
            lam_mix = torch.where(cut, beta(cutmix_alpha), beta(mixup_alpha))
        else:
            cut = torch.full((n,), mixup_alpha <= 0, device=gen.device)
            lam_mix = beta(mixup_alpha if mixup_alpha > 0 else cutmix_alpha)
        lam = torch.where(_rand((n,), gen) < prob, lam_mix, lam)
    cut &= lam != 1.0
    # timm's rand_bbox (no margin): a box of area about (1 - lam) centred at a random pixel.
    ratio = torch.sqrt(1.0 - lam)
    cut_h, cut_w = (h * ratio).long(), (w * ratio).long()
    cy, cx = (_rand((n,), gen) * h).long(), (_rand((n,), gen) * w).long()
    yl, yh = (cy - cut_h // 2).clamp(0, h), (cy + cut_h // 2).clamp(0, h)
    xl, xh = (cx - cut_w // 2).clamp(0, w), (cx + cut_w // 2).clamp(0, w)
    if correct_lam:
        lam = torch.where(cut, 1.0 - ((yh - yl) * (xh - xl)).double() / (h * w), lam)
    return lam, cut, yl, yh, xl, xh


def _mixed(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    smoothing: float,
    lam: torch.Tensor,
    cut: torch.Tensor,
    box: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image: its box ``(top, bottom, left, right)`` of its mirror pasted in (``cut``) or
    a blend with its mirror, weight ``lam`` (float32, (B,)); and the mixed soft targets."""
    b, _, h, w = x.shape
    yl, yh, xl, xh = (v.view(b, 1, 1, 1) for v in box)
    ys = torch.arange(h, device=x.device).view(1, 1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, 1, w)
    in_box = (ys >= yl) & (ys < yh) & (xs >= xl) & (xs < xh)
    flipped = x.flip(0)
    lam4 = lam.view(b, 1, 1, 1).to(x.dtype)
    mixed = x * lam4 + flipped * (1.0 - lam4)
    out = torch.where(cut.view(b, 1, 1, 1), torch.where(in_box, flipped, x), mixed)
    return out, _mixed_targets(y, num_classes, smoothing, lam.view(b, 1), x.device)


def _mixed_targets(
    y: torch.Tensor, num_classes: int, smoothing: float, lam: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """``lam * smooth(y) + (1 - lam) * smooth(y.flip(0))``, on ``device``."""
    y1 = one_hot_smooth(y, num_classes, smoothing).to(device, non_blocking=True)
    y2 = one_hot_smooth(y.flip(0), num_classes, smoothing).to(device, non_blocking=True)
    return y1 * lam + y2 * (1.0 - lam)
