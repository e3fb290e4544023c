"""Decoding image files to uint8 RGB: one file, or many into a ``.npy`` with a process pool."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from lgvit.errors import LgvitError

__all__ = [
    "STATUS_BAD",
    "STATUS_MISMATCH",
    "STATUS_OK",
    "decode_to_npy",
    "pil_resize_center_crop",
    "probe_size",
    "read_image_rgb",
    "to_rgb",
]

# Per-file decode outcome: decoded, unreadable, or (native-size passes) another size.
STATUS_OK, STATUS_BAD, STATUS_MISMATCH = 0, 1, 2
# Below this many images a process pool costs more (worker start-up) than it saves.
_POOL_MIN_IMAGES = 2000


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB.

    16-bit/32-bit integer greyscale is scaled (``>> 8``, i.e. 65535 -> 255), not clipped. Alpha
    (RGBA, LA, P with transparency) is dropped, keeping the stored colour: the same choice as
    torchvision's ImageFolder loader (``img.convert('RGB')``), so numbers stay comparable.
    """
    mode = img.mode
    if mode.startswith("I"):  # I;16, I;16B, I;16L, I;16N and 32-bit I from 16-bit sources
        arr = np.asarray(img).astype(np.int64)
        img = Image.fromarray((np.clip(arr, 0, 65535) >> 8).astype(np.uint8))
    elif mode == "F":
        img = Image.fromarray(np.clip(np.asarray(img), 0, 255).round().astype(np.uint8))
    return img if img.mode == "RGB" else img.convert("RGB")


def pil_resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Resize the shorter side to ``size`` (bicubic), then centre-crop ``size`` x ``size``."""
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def _decode_image(
    path: str, expect: tuple[int, int] | None, resize: int | None
) -> tuple[int, np.ndarray | None]:
    """Decode one file to HWC uint8 RGB: ``(STATUS_OK, array)``, ``(STATUS_BAD, None)`` or
    ``(STATUS_MISMATCH, None)`` when ``expect`` (W, H) is given and the image has another size."""
    try:
        with Image.open(path) as img:
            if expect is not None and img.size != expect:
                return STATUS_MISMATCH, None
            if resize is not None and img.format == "JPEG":
                img.draft(None, (resize, resize))  # DCT-domain downscale: big JPEGs decode fast
            img.load()  # open() only reads the header; load() finds truncated data
            rgb = to_rgb(img)
            if resize is not None:
                rgb = pil_resize_center_crop(rgb, resize)
            return STATUS_OK, np.asarray(rgb, dtype=np.uint8)
    except Exception:  # PIL raises many types for corrupt files (OSError, SyntaxError, ...)
        return STATUS_BAD, None


def read_image_rgb(path: str | os.PathLike) -> torch.Tensor:
    """One image file as uint8 ``(3, H, W)`` RGB (any mode PIL reads); LgvitError if unreadable."""
    if not Path(path).is_file():
        raise LgvitError(f"{path}: no such image file")
    status, arr = _decode_image(str(path), None, None)
    if status != STATUS_OK or arr is None:
        raise LgvitError(f"{path}: not a readable image (empty, truncated or not an image)")
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def _decode_chunk(
    job: tuple[int, list[str], tuple[int, int] | None, int | None, tuple[int, int]],
) -> tuple[int, np.ndarray, np.ndarray]:
    """Decode a run of files into one (k, 3, H, W) block; stops at the first size mismatch."""
    start, paths, expect, resize, (h, w) = job
    out = np.zeros((len(paths), 3, h, w), dtype=np.uint8)
    status = np.full(len(paths), STATUS_BAD, dtype=np.uint8)
    for i, path in enumerate(paths):
        status[i], arr = _decode_image(path, expect, resize)
        if status[i] == STATUS_OK:
            out[i] = arr.transpose(2, 0, 1)
        elif status[i] == STATUS_MISMATCH:
            break
    return start, out, status


def _num_workers() -> int:
    # Respect CPU affinity (containers, taskset) where the OS exposes it.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds; spawn/forkserver would re-import torch in each one
    # (seconds), which is most of the decode time for 60k small JPEGs. The workers only run PIL.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def decode_to_npy(
    paths: list[str],
    expect: tuple[int, int] | None,
    resize: int | None,
    hw: tuple[int, int],
    out_path: Path,
    desc: str,
) -> np.ndarray | None:
    """Decode ``paths`` into a new ``.npy`` at ``out_path`` (one row per path, zeros where bad).

    Returns the per-image status, or None when a native-size pass met an image of another size.
    """
    n, (h, w) = len(paths), hw
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.uint8, shape=(n, 3, h, w))
    status = np.full(n, STATUS_BAD, dtype=np.uint8)
    # ~4 MB per chunk: big enough to amortise IPC, small enough to keep memory flat.
    chunk = int(np.clip(4_000_000 // (3 * h * w), 16, 512))
    jobs = [(s, paths[s : s + chunk], expect, resize, hw) for s in range(0, n, chunk)]
    workers = _num_workers()

    def consume(
        results: Iterable[tuple[int, np.ndarray, np.ndarray]], out: np.ndarray, bar: tqdm
    ) -> bool:
        for start, block, st in results:
            out[start : start + len(st)] = block
            status[start : start + len(st)] = st
            bar.update(len(st))
            if (st == STATUS_MISMATCH).any():
                return False
        return True

    with tqdm(total=n, desc=desc, unit="img", disable=None) as bar:
        if workers > 1 and n > _POOL_MIN_IMAGES:
            with _pool_context().Pool(workers) as pool:
                complete = consume(pool.imap_unordered(_decode_chunk, jobs), out, bar)
        else:
            complete = consume(map(_decode_chunk, jobs), out, bar)
    out.flush()
    del out
    return status if complete else None


def probe_size(paths: list[str]) -> tuple[int, int] | None:
    """(W, H) of the first file whose header PIL can read."""
    for path in paths:
        try:
            with Image.open(path) as img:
                return img.size
        except Exception:  # unreadable: the decode pass will count it
            continue
    return None
