"""Image folders (``<root>/train/<class>/*`` and ``val/`` or ``test/``, or a ``.tar.gz`` of one)
decoded once into a memory-mapped uint8 ``.npy`` cache, or streamed from their files when the
cache would be too large (ImageNet).

A second run opens 60,000 CIFAR JPEGs from the cache in about a second. The cache key covers the
root, the storage size, every file's path, size and mtime and the first and last bytes of (a
sample of) the files; the ``.json`` beside the ``.npy`` is written last and marks a complete
entry. Building an entry removes the ones it supersedes (same root and size, older files) and
temp files of killed builds.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lgvit.core.atomic import atomic_write, atomic_write_json
from lgvit.core.constants import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CROP_PCT,
    IMAGE_EXTENSIONS,
    IMAGENET_MEAN,
    IMAGENET_STD,
)
from lgvit.core.errors import LgvitError, first_line
from lgvit.data import archives
from lgvit.data.cifar import CIFAR10_CLASSES
from lgvit.data.decode import (
    STATUS_BAD,
    STATUS_OK,
    decode_to_npy,
    no_space_error,
    npy_writer,
    probe_size,
)
from lgvit.data.splits import DatasetSplits, FileImageSet, ImageSet

__all__ = ["load_class_map", "load_imagefolder", "load_test_folder", "natural_key"]

# Bump when the decoded-cache layout or the decode/resize policy changes: old caches then miss.
# 2: class folders in natural order (``2`` before ``10``), as timm's ImageFolder.
# 3: the key covers the files' first and last bytes; EXIF orientation applied; thin images bad.
_CACHE_VERSION = 3
# Same-size files with a restored mtime (``cp -p``, ``rsync -t``, a re-extracted tar) keep their
# stat key, so the key also hashes the first and last _EDGE_BYTES of each file: all of a small
# image, and a header, palette or first rows plus the end of the data of a large one. Reading
# them costs an open() per file, as much as the stat again when the files are cached in memory
# but a disk seek each when not; so above _FINGERPRINT_FILES files only an evenly spaced sample
# is read (a same-size, same-mtime edit of an unsampled file, or in the middle of a large one,
# goes unseen: the price of a second run that does not read the whole data set).
_EDGE_BYTES = 4096
_FINGERPRINT_FILES = 4096
# Only the default: with images of mixed sizes and no img_size we store at 224 / 0.875 = 256.
_DEFAULT_IMG_SIZE = 224


def load_imagefolder(
    data_dir: Path,
    img_size: int | None,
    cache: Path,
    max_bad_fraction: float,
    stream: bool | None,
    stream_above: int,
) -> DatasetSplits:
    """The ``imagefolder`` dataset at ``data_dir`` (see :func:`lgvit.data.datasets.load_dataset`).

    ``stream`` None: stream when the images would be resized and the decoded cache would exceed
    ``stream_above`` bytes.
    """
    root = _imagefolder_root(data_dir, cache)
    train, val = _scan_splits(root)
    if stream is None:
        stream = _too_big_to_cache(train, val, img_size, stream_above)
    if stream:
        return _file_splits(train, val)
    return _cached_splits(root, train, val, img_size, cache, max_bad_fraction)


def _normalisation(
    classes: list[str],
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """CIFAR-10's mean/std for a folder of CIFAR-10's classes, else ImageNet's."""
    if tuple(classes) == CIFAR10_CLASSES:
        return CIFAR10_MEAN, CIFAR10_STD
    return IMAGENET_MEAN, IMAGENET_STD


def _store_side(img_size: int | None) -> int:
    """Side of the square images are resized to when not stored at their native size."""
    return round((img_size or _DEFAULT_IMG_SIZE) / CROP_PCT)


def _store_plan(first: tuple[int, int], img_size: int | None) -> tuple[int, int] | None:
    """Native (W, H) to try storing at, or None to go straight to resizing.

    Images are stored at their native size when they all share it and it is <= 2 * img_size
    (CIFAR-like data: augmentation upsamples later); otherwise resized to round(img_size/CROP_PCT)
    square (shorter side, then centre crop), as ImageNet evaluation crops do.
    """
    if img_size is None or max(first) <= 2 * img_size:
        return first
    return None


@dataclass
class _SplitFiles:
    dirname: str
    classes: list[str]
    paths: list[str]
    labels: list[int]
    stats: list[tuple[str, int, int]]  # (relative path, size, mtime_ns): the cache key


def _visible(name: str) -> bool:
    return not name.startswith(".")


def natural_key(name: str) -> tuple:
    """timm's ImageFolder order: case-folded, digit runs compared as numbers (``2`` before
    ``10``, so ImageNet-V2's folders ``0`` ... ``999`` are its class indices); the name itself
    breaks ties."""
    parts = re.split(r"(\d+)", name.lower())  # alternates text, number, text, ...
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


def _class_dirs(split_dir: Path) -> list[str]:
    names = [e.name for e in os.scandir(split_dir) if e.is_dir() and _visible(e.name)]
    return sorted(names, key=natural_key)


def read_text_lines(path: Path, what: str = "") -> list[str]:
    """A text list's lines, stripped (blank ones kept: line numbers count them), for every list
    of names lgvit reads (``--class-map``, a segfolder's ``classes.txt``): UTF-8 with or without
    a byte-order mark (an editor's BOM is not part of the first name). A file that cannot be read
    or is not UTF-8 is one line naming ``what`` and the file (and the offending byte's line)."""
    where = f"{what} {path}" if what else str(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise LgvitError(f"{where}: cannot read it ({first_line(e)})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        at = e.start + (3 if raw.startswith(b"\xef\xbb\xbf") else 0)  # e.start is past a BOM
        line = raw[:at].count(b"\n") + 1
        raise LgvitError(f"{where}: not UTF-8 text (byte 0x{raw[at]:02x} at offset {at}, "
                         f"line {line})") from None  # fmt: skip
    return [ln.strip() for ln in text.splitlines()]


def load_class_map(path: Path) -> dict[str, int]:
    """timm's ``--class-map`` text file: one class name per line (its index is the line's), or
    ``name index`` per line. Indices must be 0 ... n-1, each once."""
    lines = read_text_lines(path, "class map")
    rows = [(n, ln) for n, ln in enumerate(lines, 1) if ln]
    if not rows:
        raise LgvitError(f"class map {path}: no class names in it")
    pairs = [ln.rsplit(None, 1) for _, ln in rows]
    indexed = [len(p) == 2 and p[1].lstrip("-").isdigit() for p in pairs]
    if any(indexed) and not all(indexed):
        bad = next(r[0] for r, ix in zip(rows, indexed, strict=True) if ix != indexed[0])
        raise LgvitError(f"class map {path}, line {bad}: mixes 'name' lines and 'name index' lines")
    out: dict[str, int] = {}
    for (line_no, line), p in zip(rows, pairs, strict=True):
        name, idx = (p[0], int(p[1])) if indexed[0] else (line, len(out))
        if name in out:
            raise LgvitError(f"class map {path}, line {line_no}: class {name!r} listed twice")
        out[name] = idx
    if sorted(out.values()) != list(range(len(out))):
        raise LgvitError(
            f"class map {path}: the indices must be 0 ... {len(out) - 1}, each once "
            f"(found {min(out.values())} ... {max(out.values())}, "
            f"{len(set(out.values()))} distinct)"
        )
    return out


def _scan_split(split_dir: Path, class_map: dict[str, int] | None = None) -> _SplitFiles:
    folders = _class_dirs(split_dir)
    if not folders:
        raise LgvitError(f"no class folders in {split_dir} (expected {split_dir}/<class>/*)")
    if class_map is None:
        classes, label_of = folders, {c: i for i, c in enumerate(folders)}
    else:
        missing = [c for c in folders if c not in class_map]
        if missing:
            raise LgvitError(
                f"{len(missing)} class folder(s) in {split_dir} are not in the class map: "
                f"{', '.join(missing[:5])}"
            )
        classes, label_of = sorted(class_map, key=class_map.__getitem__), class_map
    paths: list[str] = []
    labels: list[int] = []
    stats: list[tuple[str, int, int]] = []
    empty: list[str] = []
    for cls in folders:
        label = label_of[cls]
        found = []
        for dirpath, dirnames, filenames in os.walk(split_dir / cls, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if _visible(d))  # deterministic, no .git
            for fname in filenames:
                if _visible(fname) and os.path.splitext(fname)[1].lower() in IMAGE_EXTENSIONS:
                    found.append(os.path.join(dirpath, fname))
        if not found:
            empty.append(cls)
        for path in sorted(found):
            st = os.stat(path)
            paths.append(path)
            labels.append(label)
            stats.append((os.path.relpath(path, split_dir), st.st_size, st.st_mtime_ns))
    if not paths:
        raise LgvitError(
            f"no images in {split_dir} (extensions: {' '.join(sorted(IMAGE_EXTENSIONS))})"
        )
    if empty:
        raise LgvitError(
            f"{len(empty)} class folder(s) in {split_dir} have no images: {', '.join(empty[:5])}"
        )
    return _SplitFiles(split_dir.name, classes, paths, labels, stats)


def _folder_or_archive(data_dir: Path, cache: Path) -> Path:
    """``data_dir`` itself, or the folder a ``.tar.gz`` of it is extracted to (once)."""
    if not data_dir.exists():
        raise LgvitError(f"imagefolder data dir not found: {data_dir}")
    if not data_dir.is_file():
        return data_dir
    if not archives.is_archive(data_dir):
        raise LgvitError(f"{data_dir} is a file but not a .tar.gz/.tgz/.tar archive")
    return archives.extract_cached(data_dir, cache)


def _imagefolder_root(data_dir: Path, cache: Path) -> Path:
    root = _folder_or_archive(data_dir, cache)
    if not (root / "train").is_dir():
        # An archive (or a parent folder) usually wraps the tree in a single top folder.
        subdirs = [e for e in os.scandir(root) if e.is_dir() and _visible(e.name)]
        if len(subdirs) == 1 and (Path(subdirs[0].path) / "train").is_dir():
            root = Path(subdirs[0].path)
        else:
            raise LgvitError(
                f"no train/ directory in {data_dir} (expected train/<class>/* and "
                "val/<class>/* or test/<class>/*)"
            )
    return root


def _test_dir(data_dir: Path, cache: Path) -> Path:
    """The folder of class folders to evaluate: ``val/`` (or ``test/``) of ``data_dir``, or
    ``data_dir`` itself when it holds the class folders (ImageNet-V2's layout); a single wrapper
    folder (as archives have) is looked through."""
    root = _folder_or_archive(data_dir, cache)
    for _ in range(2):  # the folder, then a lone wrapper folder in it
        for split in ("val", "test"):
            if (root / split).is_dir():
                return root / split
        if (root / "train").is_dir():
            raise LgvitError(
                f"{root} has train/ but no val/ or test/ to evaluate (or pass the folder of "
                "class folders itself)"
            )
        subdirs = _class_dirs(root)
        files = [e.name for e in os.scandir(root) if e.is_file() and _visible(e.name)]
        if len(subdirs) == 1 and not files and _class_dirs(root / subdirs[0]):
            root = root / subdirs[0]
        else:
            break
    return root


def load_test_folder(
    data_dir: Path, cache: Path, class_map: dict[str, int] | None = None
) -> FileImageSet:
    """The evaluation split of an image folder, as its files: ``val/`` or ``test/`` of
    ``data_dir`` (no ``train/`` needed) or ``data_dir`` itself as a folder of class folders.
    Classes in natural order, or the indices of ``class_map`` (:func:`load_class_map`)."""
    split = _scan_split(_test_dir(data_dir, cache), class_map)
    labels = torch.tensor(split.labels, dtype=torch.int64)
    return FileImageSet(split.paths, labels, list(split.classes))


def _source(root: Path, img_size: int | None) -> str:
    """What a cache entry is of: entries of the same source with another key are superseded."""
    return f"{os.path.realpath(root)}|{img_size}"


def _cache_key(root: Path, img_size: int | None, splits: list[_SplitFiles]) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}|{_source(root, img_size)}".encode())
    for sp in splits:
        h.update(f"|{sp.dirname}|{len(sp.stats)}".encode())
        for rel, size, mtime in sp.stats:
            h.update(f"\n{rel}\0{size}\0{mtime}".encode())
    paths = [p for sp in splits for p in sp.paths]
    step = max(1, -(-len(paths) // _FINGERPRINT_FILES))  # every file up to _FINGERPRINT_FILES
    for path in paths[::step]:
        h.update(_edges(path))
    return h.hexdigest()[:20]


def _edges(path: str) -> bytes:
    """The first and last ``_EDGE_BYTES`` of a file (all of a small one), length-prefixed."""
    try:
        with open(path, "rb") as f:
            data = f.read(_EDGE_BYTES)
            if len(data) == _EDGE_BYTES:
                f.seek(-min(_EDGE_BYTES, os.fstat(f.fileno()).st_size - _EDGE_BYTES), os.SEEK_END)
                data += f.read(_EDGE_BYTES)
    except OSError:  # unreadable now: the decode pass counts it
        data = b"?"
    return len(data).to_bytes(4, "little") + data


def _read_cache(base: Path) -> tuple[np.ndarray, dict] | None:
    npy, meta_path = base.with_suffix(".npy"), base.with_suffix(".json")
    if not meta_path.is_file() or not npy.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if not _cache_meta_ok(meta):
            return None
        # Copy-on-write map: torch needs a writable buffer, and writes must never reach the file.
        images = np.load(npy, mmap_mode="c")
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != len(meta["labels"]):
            return None
        return images, meta
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None  # damaged cache (a 0-byte or truncated .npy too): decode again


def _cache_meta_ok(meta: object) -> bool:
    """The cache's JSON has what :func:`_build_cache` writes: two splits' counts, totals and
    skipped files, the class names and one label per stored row."""
    if not isinstance(meta, dict):
        return False
    pairs = [meta.get(k) for k in ("counts", "totals", "skipped")]
    if not all(isinstance(v, list) and len(v) == 2 for v in pairs):
        return False
    labels, classes = meta.get("labels"), meta.get("classes")
    return (
        isinstance(labels, list)
        and isinstance(classes, list)
        and all(isinstance(c, int) and c >= 0 for c in meta["counts"])
        and sum(meta["counts"]) == len(labels)
        and all(isinstance(b, list) for b in meta["skipped"])
    )


def _scan_splits(root: Path) -> tuple[_SplitFiles, _SplitFiles]:
    """The train and val (or test) splits of ``root``, checked to have the same classes."""
    val_name = "val" if (root / "val").is_dir() else "test"
    if not (root / val_name).is_dir():
        raise LgvitError(f"no val/ or test/ directory in {root} (train/ is there)")
    train, val = _scan_split(root / "train"), _scan_split(root / val_name)
    if train.classes != val.classes:
        only_t = sorted(set(train.classes) - set(val.classes))
        only_v = sorted(set(val.classes) - set(train.classes))
        raise LgvitError(
            f"train/ and {val_name}/ class folders differ in {root}: only in train: "
            f"{', '.join(only_t) or '-'}; only in {val_name}: "
            f"{', '.join(only_v) or '-'}"
        )
    return train, val


def _too_big_to_cache(
    train: _SplitFiles, val: _SplitFiles, img_size: int | None, limit: int
) -> bool:
    """Whether the images would be resized and their decoded cache would exceed ``limit``."""
    first = probe_size(train.paths)
    side = _store_side(img_size)
    n = len(train.paths) + len(val.paths)
    big = n * 3 * side * side > limit
    return first is not None and _store_plan(first, img_size) is None and big


def _file_splits(train: _SplitFiles, val: _SplitFiles) -> DatasetSplits:
    classes = list(train.classes)
    mean, std = _normalisation(classes)
    return DatasetSplits(
        train=FileImageSet(train.paths, torch.tensor(train.labels, dtype=torch.int64), classes),
        test=FileImageSet(val.paths, torch.tensor(val.labels, dtype=torch.int64), classes),
        name="imagefolder",
        mean=mean,
        std=std,
        skipped=[],
    )


def _cached_splits(
    root: Path,
    train: _SplitFiles,
    val: _SplitFiles,
    img_size: int | None,
    cache: Path,
    max_bad_fraction: float,
) -> DatasetSplits:
    """The splits from the decoded cache, building it first on a miss."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", root.name) or "root"
    base = cache / "imagefolder" / f"{safe}-{_cache_key(root, img_size, [train, val])}"
    _remove_stale_temps(base.parent)
    cached = _read_cache(base)
    if cached is None:
        _build_cache(base, [train, val], img_size, _source(root, img_size))
        _prune_superseded(base, _source(root, img_size))
        cached = _read_cache(base)
        if cached is None:
            raise LgvitError(f"could not read back the decoded cache {base}.npy")
    images, meta = cached

    skipped: list[str] = []
    for sp, bad, total in zip((train, val), meta["skipped"], meta["totals"], strict=True):
        _check_bad(root / sp.dirname, bad, total, max_bad_fraction)
        skipped.extend(bad)
    n_train = meta["counts"][0]
    for sp, count in zip((train, val), meta["counts"], strict=True):
        if count == 0:  # only reachable with max_bad_fraction=1
            raise LgvitError(f"no readable images in {root / sp.dirname}")
    labels = torch.tensor(meta["labels"], dtype=torch.int64)
    classes = list(meta["classes"])
    mean, std = _normalisation(classes)
    return DatasetSplits(
        train=ImageSet(torch.from_numpy(images[:n_train]), labels[:n_train], classes),
        test=ImageSet(torch.from_numpy(images[n_train:]), labels[n_train:], list(classes)),
        name="imagefolder",
        mean=mean,
        std=std,
        skipped=skipped,
    )


def _decode_all(
    paths: list[str], img_size: int | None, out: Path
) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode ``paths`` into the ``.npy`` at ``out``: per-image status and the stored (H, W)."""
    first = probe_size(paths)
    if first is None:  # nothing readable at all: every row is bad
        with npy_writer(out, (len(paths), 3, 1, 1)):
            pass  # all zeros
        return np.full(len(paths), STATUS_BAD, dtype=np.uint8), (0, 0)
    native = _store_plan(first, img_size)
    if native is not None:
        hw = (native[1], native[0])
        status = decode_to_npy(paths, native, None, hw, out, "decoding")
        if status is not None:
            return status, hw
    # sizes differ, or too large to keep: resize everything
    side = _store_side(img_size)
    status = decode_to_npy(paths, None, side, (side, side), out, f"decoding+resizing to {side}")
    assert status is not None  # only a native-size pass stops early
    return status, (side, side)


def _keep_rows(scratch: Path, ok: np.ndarray, out: Path) -> None:
    """Move the ``.npy`` ``scratch`` to ``out``, or copy only its ``ok`` rows there."""
    if ok.all():
        os.replace(scratch, out)
        return
    # copying in blocks keeps memory flat; reading through a map is safe, writing is not
    src = np.load(scratch, mmap_mode="r")
    keep = np.flatnonzero(ok)
    with npy_writer(out, (len(keep), *src.shape[1:])) as put:
        for i in range(0, len(keep), 4096):
            put(i, src[keep[i : i + 4096]])
    del src


def _build_cache(base: Path, splits: list[_SplitFiles], img_size: int | None, source: str) -> None:
    """Decode every image of ``splits`` into ``base.npy`` (readable rows only) + ``base.json``.

    A full disk is one line; whatever stops the build (that, a signal, an error) removes its
    temp files, and a SIGKILL's are removed by the next build (:func:`_remove_stale_temps`)."""
    base.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write_cache(base, splits, img_size, source)
    except OSError as e:  # the writers report their own; fsync or rename may still meet it
        if e.errno == errno.ENOSPC:
            raise no_space_error(base.parent) from None
        raise


def _write_cache(base: Path, splits: list[_SplitFiles], img_size: int | None, source: str) -> None:
    paths = [p for sp in splits for p in sp.paths]
    labels = np.array([lab for sp in splits for lab in sp.labels], dtype=np.int64)
    split_of = np.concatenate([np.full(len(sp.paths), i) for i, sp in enumerate(splits)])
    scratch = base.with_name(f"{base.name}.tmp-{os.getpid()}.npy")  # _TEMP_NAME relies on it
    try:
        status, hw = _decode_all(paths, img_size, scratch)
        ok = status == STATUS_OK
        atomic_write(base.with_suffix(".npy"), lambda tmp: _keep_rows(scratch, ok, tmp))
        meta = {
            "version": _CACHE_VERSION,
            "classes": splits[0].classes,
            "splits": [sp.dirname for sp in splits],
            "counts": [int(ok[split_of == i].sum()) for i in range(len(splits))],
            "totals": [len(sp.paths) for sp in splits],
            "labels": labels[ok].tolist(),
            "skipped": [
                [p for p, s in zip(sp.paths, status[split_of == i], strict=True) if s != STATUS_OK]
                for i, sp in enumerate(splits)
            ],
            "store_hw": list(hw),
            "source": source,
        }
        # The json is written last: its presence marks a complete cache entry.
        atomic_write_json(base.with_suffix(".json"), meta)
    finally:
        scratch.unlink(missing_ok=True)


# Temp files of a cache build: ``<entry>.tmp-<pid>.npy`` (the decode pass) and lgvit.core.atomic's
# ``.<entry>.npy.tmp-<pid>`` / ``.<entry>.json.tmp-<pid>``.
_TEMP_NAME = re.compile(r"\.tmp-(\d+)(\.npy)?$")


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate it there: assume alive
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, OSError):  # not a pid this system can have
        return False
    return True


def _remove_stale_temps(folder: Path) -> list[str]:
    """Delete temp files of cache builds whose process is gone (SIGKILL, a crash, a power cut:
    up to the size of a whole cache each); returns their names. Builds running beside us keep
    theirs. A cache directory shared between hosts (NFS) could see another host's pid as gone:
    such a build then fails, and the next run rebuilds."""
    removed = []
    for name in _entries(folder):
        found = _TEMP_NAME.search(name)
        if found and not _pid_alive(int(found.group(1))):
            try:
                (folder / name).unlink()
                removed.append(name)
            except OSError:  # gone already (another run cleaning), or not ours to remove
                continue
    return removed


def _entries(folder: Path) -> Iterator[str]:
    try:
        with os.scandir(folder) as it:
            yield from (e.name for e in it if e.is_file(follow_symlinks=False))
    except OSError:  # no cache folder yet
        return


def _prune_superseded(base: Path, source: str) -> list[str]:
    """Delete the complete cache entries this new one ``base`` supersedes: the same ``source``
    (data root and img_size) with another key (its files changed since), and entries of an
    older cache version under the same name prefix. Without this every change to the data
    would leave a full copy behind. Returns the removed entries' names."""
    prefix = base.name.rsplit("-", 1)[0] + "-"
    removed = []
    for name in sorted(_entries(base.parent)):
        other = base.parent / name
        if not name.endswith(".json") or other.stem == base.name or _TEMP_NAME.search(name):
            continue
        try:
            meta = json.loads(other.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict):
            continue
        version = meta.get("version")
        older = isinstance(version, int) and version < _CACHE_VERSION and name.startswith(prefix)
        if meta.get("source") == source or older:
            with contextlib.suppress(OSError):  # a mapped file on Windows: left for next time
                other.unlink(missing_ok=True)  # first: without its json an entry is incomplete
                other.with_suffix(".npy").unlink(missing_ok=True)
                removed.append(other.stem)
    return removed


def _check_bad(split_dir: Path, bad: list[str], total: int, max_bad_fraction: float) -> None:
    if not bad:
        return
    frac = len(bad) / total
    shown = ", ".join(bad[:3])
    if frac > max_bad_fraction:
        raise LgvitError(
            f"{len(bad)} of {total} images in {split_dir} are unreadable "
            f"({frac:.1%} > max_bad_fraction {max_bad_fraction:.1%}), e.g. {shown}"
        )
    warnings.warn(
        f"skipped {len(bad)} unreadable image(s) of {total} in {split_dir} "
        f"({frac:.1%}), e.g. {shown}",
        stacklevel=5,  # the caller of load_dataset
    )
