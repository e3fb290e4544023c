"""Decoding image files to uint8 RGB: one file, or many into a ``.npy`` with a process pool."""

from __future__ import annotations

import contextlib
import errno
import io
import math
import multiprocessing
import os
import re
import shutil
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from tqdm import tqdm

from lgvit.core.errors import LgvitError, Preempted

__all__ = [
    "EXIF_ORIENTATION",
    "MAX_ASPECT",
    "STATUS_BAD",
    "STATUS_MISMATCH",
    "STATUS_OK",
    "TURNED_ORIENTATIONS",
    "decode_to_npy",
    "exif_orientation",
    "jpeg_header",
    "load_rgb",
    "no_space_error",
    "npy_writer",
    "pil_resize_center_crop",
    "probe_size",
    "read_image_rgb",
    "to_rgb",
]

# Per-file decode outcome: decoded, unreadable, or (native-size passes) another size.
STATUS_OK, STATUS_BAD, STATUS_MISMATCH = 0, 1, 2
# Below this many images a process pool costs more (worker start-up) than it saves.
_POOL_MIN_IMAGES = 2000
# Output bytes per decode chunk: big enough to amortise IPC, small enough to keep memory flat
# and to notice a SIGTERM within a fraction of a second.
_CHUNK_BYTES = 4_000_000
# Longest side over shortest side. Resizing the short side of a 5000x1 image to 256 asks for a
# 1,280,000 x 256 intermediate (5 GB); at most 100:1 it stays under 100 * 256^2 pixels. No photo
# a classifier is trained on is thinner.
MAX_ASPECT = 100
EXIF_ORIENTATION = 0x0112  # the EXIF tag
# EXIF orientations stored turned by 90 degrees: width and height swap.
TURNED_ORIENTATIONS = frozenset({5, 6, 7, 8})


class _Refused(Exception):
    """An image PIL could open but lgvit will not decode; the message says why."""


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
    """Resize the shorter side to ``size`` (bicubic), then centre-crop ``size`` x ``size``.

    The intermediate has at most ``MAX_ASPECT * size**2`` pixels: thinner images are refused
    when opened (:func:`_open`)."""
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def _open(path: str | bytes) -> Image.Image:
    """``Image.open`` of a file or of an encoded image's bytes, with Pillow's decompression-bomb
    warning and error (more than ``Image.MAX_IMAGE_PIXELS`` pixels: a 20000x20000 PNG) raised
    as :class:`_Refused`."""
    with warnings.catch_warnings():
        # The warning band (1-2x the limit) would decode gigabytes and print a warning per file.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(io.BytesIO(path) if isinstance(path, bytes) else path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            found = re.search(r"(\d+) pixels", str(e))
            pixels = f"{int(found.group(1)):,} pixels, " if found else ""
            raise _Refused(
                f"too large to decode ({pixels}more than PIL.Image.MAX_IMAGE_PIXELS = "
                f"{Image.MAX_IMAGE_PIXELS:,}: a possible decompression bomb)"
            ) from None


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1 = stored upright)."""
    try:
        value = img.getexif().get(EXIF_ORIENTATION, 1)
        return value if isinstance(value, int) and 1 <= value <= 8 else 1
    except Exception:  # a damaged EXIF block: use the pixels as stored
        return 1


def _upright_size(img: Image.Image, orientation: int) -> tuple[int, int]:
    """(W, H) once EXIF orientation is applied; :class:`_Refused` when too thin to resize."""
    w, h = img.size
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise _Refused(f"too thin to use ({w}x{h} pixels: one side over {MAX_ASPECT}x the other)")
    return (h, w) if orientation in TURNED_ORIENTATIONS else (w, h)


def _load(
    path: str | bytes, expect: tuple[int, int] | None, draft: int | None, upright: bool = True
) -> Image.Image | None:
    """One file as an upright RGB image (``upright=False``: as stored, its EXIF orientation
    ignored); None when ``expect`` (W, H) is given and the image has another size. Raises
    :class:`_Refused` or whatever PIL raises for a damaged file."""
    with _open(path) as img:
        orientation = _orientation(img) if upright else 1
        size = _upright_size(img, orientation)  # refuses one too thin to resize
        if expect is not None and size != expect:
            return None
        if draft is not None and img.format == "JPEG":
            img.draft(None, (draft, draft))  # DCT-domain downscale: big JPEGs decode fast
        img.load()  # open() only reads the header; load() finds truncated data
        if orientation != 1:  # a phone's portrait JPEG: stored sideways, turned by its EXIF
            img = ImageOps.exif_transpose(img)
        return to_rgb(img)


def load_rgb(path: str | bytes, upright: bool = True) -> Image.Image:
    """One image file (or an encoded image's bytes: a dataset's image column) as an upright RGB
    PIL image (EXIF orientation applied; ``upright=False``: as stored). Raises on a file that is
    unreadable, too large or too thin (the streaming loader counts those as bad)."""
    img = _load(path, None, None, upright)
    assert img is not None  # only a size expectation returns None
    return img


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(upright width, upright height, EXIF orientation) of an encoded JPEG whose pixels a JPEG
    decoder gives as PIL does (greyscale or YCbCr/RGB: ``L`` or ``RGB`` to PIL), read from its
    header alone; None for any other image (PNG, CMYK JPEG, ...): PIL decodes those. Raises, as
    :func:`load_rgb` does, on an unreadable header and on images too large or too thin."""
    with _open(data) as img:
        if img.format != "JPEG" or img.mode not in ("L", "RGB"):
            return None
        orientation = _orientation(img)
        return (*_upright_size(img, orientation), orientation)


def _decode_image(
    path: str, expect: tuple[int, int] | None, resize: int | None
) -> tuple[int, np.ndarray | None]:
    """Decode one file to HWC uint8 RGB: ``(STATUS_OK, array)``, ``(STATUS_BAD, None)`` or
    ``(STATUS_MISMATCH, None)`` when ``expect`` (W, H) is given and the image has another size.
    Too large or too thin images count as bad, as unreadable ones do."""
    try:
        rgb = _load(path, expect, resize)
        if rgb is None:
            return STATUS_MISMATCH, None
        if resize is not None:
            rgb = pil_resize_center_crop(rgb, resize)
        return STATUS_OK, np.asarray(rgb, dtype=np.uint8)
    except Exception:  # PIL raises many types for corrupt files (OSError, SyntaxError, ...)
        return STATUS_BAD, None


def read_image_rgb(path: str | os.PathLike, upright: bool = True) -> torch.Tensor:
    """One image file as uint8 ``(3, H, W)`` RGB (any mode PIL reads, EXIF orientation applied;
    ``upright=False``: the pixels as stored, as segmentation reads an image beside its mask);
    LgvitError if unreadable, too large or too thin."""
    if not Path(path).is_file():
        raise LgvitError(f"{path}: no such image file")
    try:
        arr = np.asarray(load_rgb(str(path), upright), dtype=np.uint8)
    except _Refused as e:
        raise LgvitError(f"{path}: {e}") from None
    except Exception as e:  # PIL raises many types for corrupt files
        if isinstance(e, OSError) and e.errno is not None:  # the system's error, not PIL's
            why = "permission denied" if isinstance(e, PermissionError) else e.strerror
            raise LgvitError(f"{path}: cannot read it ({why})") from None
        raise LgvitError(
            f"{path}: not a readable image (empty, truncated or not an image)"
        ) from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def exif_orientation(path: str | os.PathLike) -> int:
    """The EXIF orientation of an image file (1: stored upright, or no tag, or unreadable)."""
    try:
        with _open(str(path)) as img:
            return _orientation(img)
    except Exception:  # unreadable or refused: reading its pixels says why
        return 1


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


def _chunk_rows(h: int, w: int) -> int:
    return int(np.clip(_CHUNK_BYTES // (3 * h * w), 16, 512))


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


def _worker_signals() -> None:
    # Forked workers inherit the parent's handlers (training's RunControl only notes SIGTERM),
    # so Pool.terminate() could not stop them. The parent alone acts on Ctrl-C.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _noting_signals() -> Iterator[list[int]]:
    """SIGTERM/SIGINT received inside the block, in order. Each is also passed to the handler
    it replaces (training's RunControl notes it; Python's SIGINT handler raises
    KeyboardInterrupt at once), so the decode loop can stop between chunks instead of after the
    whole pass, or instead of dying with its temp file (SIGTERM's default)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # signal() would raise
        yield got
        return
    before: dict[int, Any] = {}
    owner = os.getpid()

    def note(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a pool worker forked before its initializer ran: just end
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        got.append(signum)
        if callable(before[signum]):
            before[signum](signum, frame)

    for sig in (signal.SIGTERM, signal.SIGINT):
        old = signal.getsignal(sig)
        if old not in (signal.SIG_IGN, None):  # ignored (nohup-like) or set outside Python: keep
            before[sig] = old
            signal.signal(sig, note)
    try:
        yield got
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def _stopped(signum: int) -> LgvitError:
    name = signal.Signals(signum).name
    return Preempted(
        f"stopped by {name} while decoding images into the cache (before any training or "
        "evaluation); the partial cache file was removed: run the same command again to go on",
        signum,
    )


def no_space_error(folder: Path, need: int | None = None, free: int | None = None) -> LgvitError:
    """The one-line error for a full disk under the decoded cache in ``folder``."""
    sizes = ""
    if need is not None and free is not None:
        sizes = f" (needs {math.ceil(need / 1e6)} MB, {free // 1_000_000} MB free)"
    return LgvitError(
        f"no space left in {folder} for the decoded cache{sizes}: free some space there or "
        "pass --cache-dir on a larger disk"
    )


def _npy_header(shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    fields = {"descr": np.dtype(np.uint8).str, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, fields)
    return buf.getvalue()


@contextlib.contextmanager
def npy_writer(path: Path, shape: tuple[int, ...]) -> Iterator[Callable[[int, np.ndarray], None]]:
    """Create the uint8 ``.npy`` ``path`` of ``shape``; the block yields ``put(first_row, rows)``.

    Plain ``write`` calls, not a memory map: on a full disk a mapped write is a SIGBUS that
    kills the process, a write is an ENOSPC we can report. The free space is checked first
    (a pass can take minutes), rows never put read as zeros, and on any failure (or a signal)
    the file is removed.
    """
    header = _npy_header(shape)
    row = int(np.prod(shape[1:], dtype=np.int64))
    size = len(header) + shape[0] * row
    folder = path.parent
    path.unlink(missing_ok=True)  # a native-size pass's file, replaced: its space is free
    free = shutil.disk_usage(folder).free
    if free < size:
        raise no_space_error(folder, size, free)
    try:
        with open(path, "wb") as f:
            f.write(header)

            def put(start: int, rows: np.ndarray) -> None:
                f.seek(len(header) + start * row)  # pool results arrive out of order
                f.write(np.ascontiguousarray(rows, dtype=np.uint8).data)

            yield put
            f.truncate(size)  # unwritten rows at the end: zeros (a hole, not disk space)
    except BaseException as e:
        path.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise no_space_error(folder) from None
        raise


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
    A full disk is one LgvitError; SIGTERM/SIGINT stop it between chunks (``Preempted``, exit
    code 128 + the signal). Either way ``out_path`` is removed.
    """
    n, (h, w) = len(paths), hw
    status = np.full(n, STATUS_BAD, dtype=np.uint8)
    chunk = _chunk_rows(h, w)
    jobs = [(s, paths[s : s + chunk], expect, resize, hw) for s in range(0, n, chunk)]
    workers = _num_workers()

    def consume(
        results: Iterable[tuple[int, np.ndarray, np.ndarray]],
        put: Callable[[int, np.ndarray], None],
        signals: list[int],
        bar: tqdm,
    ) -> bool:
        for start, block, st in results:
            if signals:  # leaving the pool's block terminates its workers
                raise _stopped(signals[0])
            put(start, block)
            status[start : start + len(st)] = st
            bar.update(len(st))
            if (st == STATUS_MISMATCH).any():
                return False
        return True

    with (
        npy_writer(out_path, (n, 3, h, w)) as put,
        _noting_signals() as signals,
        tqdm(total=n, desc=desc, unit="img", disable=None) as bar,
    ):
        if workers > 1 and n > _POOL_MIN_IMAGES:
            with _pool_context().Pool(workers, initializer=_worker_signals) as pool:
                complete = consume(pool.imap_unordered(_decode_chunk, jobs), put, signals, bar)
        else:
            complete = consume(map(_decode_chunk, jobs), put, signals, bar)
        if signals:  # one that came with the last chunk
            raise _stopped(signals[0])
    return status if complete else None


def probe_size(paths: list[str]) -> tuple[int, int] | None:
    """Upright (W, H) of the first file whose header PIL can read and lgvit would decode."""
    for path in paths:
        try:
            with _open(path) as img:
                return _upright_size(img, _orientation(img))
        except Exception:  # unreadable, too large or too thin: the decode pass will count it
            continue
    return None
