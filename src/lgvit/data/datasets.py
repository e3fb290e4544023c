"""Datasets as decoded, in-memory uint8 tensors (the airbench approach: decode once, keep bytes).

Every loader returns a :class:`DatasetSplits` whose ``train``/``test`` hold ``uint8`` images of
shape ``(N, 3, H, W)`` and ``int64`` labels. Augmentation, resizing to the model's input size and
normalisation (``mean``/``std``, in ``[0, 1]`` units) happen later, on batches.

Sources:

* ``cifar10`` / ``cifar100``: the official python-format archives, read straight out of the
  ``.tar.gz`` (or an extracted folder) with a restricted unpickler; downloaded and md5-checked
  into the cache directory when no local copy is given.
* ``imagefolder``: ``<root>/train/<class>/*`` and ``<root>/val/<class>/*`` (or ``test/``), or a
  ``.tar.gz`` of such a tree. Images are decoded once into a memory-mapped ``.npy`` cache, so a
  second run opens 60,000 CIFAR JPEGs in about a second.
* ``digits``: scikit-learn's bundled 8x8 digits (1,797 real images, no download).
* ``synthetic``: seeded random images, for tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import tarfile
import urllib.request
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from lgvit.errors import LgvitError

logger = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2471, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
_DATASETS = ("cifar10", "cifar100", "imagefolder", "digits", "synthetic")

# Bump when the decoded-cache layout or the decode/resize policy changes: old caches then miss.
_CACHE_VERSION = 1
# Below this many images a process pool costs more (worker start-up) than it saves.
_POOL_MIN_IMAGES = 2000
# Only the default: with images of mixed sizes and no img_size we store at 224 / 0.875 = 256.
_DEFAULT_IMG_SIZE = 224
_CROP_PCT = 0.875


@dataclass
class ImageSet:
    """One split: ``images`` uint8 ``(N, 3, H, W)``, ``labels`` int64 ``(N,)``, class names."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        # Internal invariants (a bug in a loader, not a user error), so plain ValueError.
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(
                f"images must be uint8 (N, 3, H, W), got {self.images.dtype} "
                f"{tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must be int64 ({self.images.shape[0]},), got "
                f"{self.labels.dtype} {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class FileImageSet:
    """A split read from its image files while iterating (too large to decode once)."""

    paths: list[str]
    labels: torch.Tensor
    classes: list[str]

    def __len__(self) -> int:
        return len(self.paths)


STREAM_ABOVE_BYTES = 4 * 2**30  # an imagefolder whose decoded cache would exceed this streams


@dataclass
class DatasetSplits:
    """Train and test splits plus the per-dataset normalisation (in ``[0, 1]`` units)."""

    train: ImageSet | FileImageSet
    test: ImageSet | FileImageSet
    name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    skipped: list[str]


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return list(_DATASETS)


def default_cache_dir() -> Path:
    """``$LGVIT_CACHE`` if set, else ``~/.cache/lgvit``."""
    return Path(os.environ.get("LGVIT_CACHE") or Path.home() / ".cache" / "lgvit").expanduser()


def load_dataset(
    name: str,
    data_dir: str | None = None,
    *,
    img_size: int | None = None,
    cache_dir: str | None = None,
    download: bool = True,
    max_bad_fraction: float = 0.05,
    synthetic_size: tuple[int, int] = (512, 128),
    num_classes: int = 10,
    seed: int = 0,
    stream: bool | None = None,
) -> DatasetSplits:
    """Load ``name`` (one of :func:`dataset_names`) as uint8 tensors.

    ``img_size`` matters for ``imagefolder`` (storage size, see :func:`_store_plan`), ``digits``
    and ``synthetic`` (output size, default 32); CIFAR is always stored at its native 32x32.
    ``cache_dir`` defaults to :func:`default_cache_dir`. ``max_bad_fraction`` is the share of
    unreadable images per imagefolder split tolerated before giving up. ``synthetic_size``,
    ``num_classes`` and ``seed`` only affect ``synthetic``. ``stream`` (imagefolder only): True
    returns the splits as :class:`FileImageSet` file lists for :mod:`lgvit.data.stream`, False
    always decodes into the cache, None (default) streams when the images would be resized and
    the decoded cache would exceed ``STREAM_ABOVE_BYTES`` (ImageNet).
    """
    key = name.strip().lower()
    if key not in _DATASETS:
        raise LgvitError(f"unknown dataset {name!r}; valid names: {', '.join(_DATASETS)}")
    if img_size is not None and (not isinstance(img_size, int) or img_size < 1):
        raise LgvitError(f"img_size must be a positive integer, got {img_size!r}")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise LgvitError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if key in _CIFAR_SPECS:
        return _load_cifar(key, data_dir, cache, download)
    if key == "imagefolder":
        if data_dir is None:
            raise LgvitError(
                "the imagefolder dataset needs data_dir (--data-dir): a folder with "
                "train/ and val/ (or test/), or a .tar.gz of one"
            )
        return _load_imagefolder(
            Path(data_dir).expanduser(), img_size, cache, max_bad_fraction, stream
        )
    if key == "digits":
        return _load_digits(img_size or 32)
    return _load_synthetic(img_size or 32, synthetic_size, num_classes, seed)


# --------------------------------------------------------------------------------------------
# Restricted unpickling and safe extraction
# --------------------------------------------------------------------------------------------


def _numpy_reconstruct() -> object:
    # numpy 2 moved numpy.core to numpy._core; look it up directly so that old pickles naming
    # numpy.core.multiarray do not trigger numpy 2's deprecation shim.
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


# Exactly what a pickled numpy array needs, nothing else: no callables that reach the OS.
_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only numpy's array-reconstruction globals."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file, encoding="bytes")
        self._source = source

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _PICKLE_ALLOWED:
            raise LgvitError(
                f"{self._source}: refusing to unpickle {module}.{name} (a dataset file may only "
                "hold dicts, lists, bytes and numpy arrays)"
            )
        if name == "_reconstruct":
            return _numpy_reconstruct()
        return np.ndarray if name == "ndarray" else np.dtype


def safe_unpickle(data: bytes | IO[bytes], source: str) -> object:
    """Unpickle ``data`` allowing only plain containers and numpy arrays (``encoding='bytes'``).

    ``source`` names the file in error messages. Anything that would import another global
    (``os.system``, ``subprocess``...) raises :class:`LgvitError` before it can run.
    """
    fh = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return _RestrictedUnpickler(fh, source).load()
    except LgvitError:
        raise
    except Exception as e:  # a corrupt pickle raises many types (EOFError, UnpicklingError...)
        raise LgvitError(f"{source}: not a readable pickle ({type(e).__name__}: {e})") from e


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _member_problem(member: tarfile.TarInfo, root: str, parents: dict[str, str]) -> str | None:
    """Why ``member`` must not be extracted under ``root`` (a realpath), or None if it is safe.

    ``parents`` memoises parent-directory realpaths (60k members share a few dozen parents); the
    caller clears it whenever a symlink is extracted, as that can change what a path resolves to.
    """
    name = member.name
    if name.startswith(("/", "\\")) or os.path.isabs(name) or re.match(r"^[A-Za-z]:", name):
        return "has an absolute path"
    if member.isdev():
        return "is a device file or FIFO"
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return f"has an unsupported type {member.type!r}"
    # realpath of the parent follows links the archive created earlier in this extraction, so
    # a chain like "a -> ." then "a/../../x" is caught, not only a literal "../x".
    dirname = os.path.dirname(name)
    parent = parents.get(dirname)
    if parent is None:
        parent = parents[dirname] = os.path.realpath(os.path.join(root, dirname))
    target = os.path.join(parent, os.path.basename(name))
    if not _within(os.path.normpath(target), root):
        return "would be written outside the destination"
    if member.issym():
        link = os.path.realpath(os.path.join(parent, member.linkname))
        if not _within(link, root):
            return f"is a symlink to {member.linkname!r}, outside the destination"
    if member.islnk():
        if os.path.isabs(member.linkname):
            return f"is a hard link to the absolute path {member.linkname!r}"
        link = os.path.realpath(os.path.join(root, member.linkname))
        if not _within(link, root):
            return f"is a hard link to {member.linkname!r}, outside the destination"
    return None


def safe_extract(tar_path: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Extract ``tar_path`` into ``dest``, refusing any member that could escape ``dest``.

    Refused (LgvitError naming the member): absolute paths, ``..`` that leaves ``dest``, symlinks
    or hard links pointing outside ``dest``, device files and FIFOs. Python's ``filter='data'``
    is applied on top where this Python has it (3.10.12+/3.11.4+), but is not relied on.
    """
    dest_path = Path(dest)
    dest_path.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(dest_path)
    has_filter = hasattr(tarfile, "data_filter")
    try:
        with tarfile.open(tar_path, "r:*") as tf:
            # Check and extract member by member (one sequential pass) so each check sees the
            # links extracted before it.
            parents: dict[str, str] = {}
            for member in tf:
                problem = _member_problem(member, root, parents)
                if problem is not None:
                    raise LgvitError(
                        f"refusing to extract {tar_path}: member {member.name!r} {problem}"
                    )
                if has_filter:
                    tf.extract(member, root, filter="data")
                else:  # no filter: at least do not restore owners or odd permission bits
                    tf.extract(member, root, set_attrs=False)
                if member.issym():
                    parents.clear()
    except tarfile.TarError as e:  # includes tarfile.FilterError from filter="data"
        raise LgvitError(f"cannot extract {tar_path}: {e}") from e
    except (OSError, EOFError) as e:
        raise LgvitError(f"cannot read archive {tar_path}: {e}") from e
    return dest_path


def _is_archive(path: Path) -> bool:
    return path.name.lower().endswith(_ARCHIVE_SUFFIXES)


def _archive_stem(path: Path) -> str:
    lower = path.name.lower()
    for suffix in _ARCHIVE_SUFFIXES:
        if lower.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.name


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (official python-format archives)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CifarSpec:
    archive: str
    folder: str
    url: str
    md5: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    meta_file: str
    names_key: bytes
    label_key: bytes
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train_files, *self.test_files, self.meta_file)


_CIFAR_SPECS = {
    "cifar10": _CifarSpec(
        archive="cifar-10-python.tar.gz",
        folder="cifar-10-batches-py",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test_files=("test_batch",),
        meta_file="batches.meta",
        names_key=b"label_names",
        label_key=b"labels",
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
    ),
    "cifar100": _CifarSpec(
        archive="cifar-100-python.tar.gz",
        folder="cifar-100-python",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        train_files=("train",),
        test_files=("test",),
        meta_file="meta",
        names_key=b"fine_label_names",
        label_key=b"fine_labels",
        mean=CIFAR100_MEAN,
        std=CIFAR100_STD,
    ),
}


def _file_md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(url: str, dest: Path, md5: str) -> Path:
    """Download ``url`` to ``dest``; the file only appears under its name once its md5 matches."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}")
    h = hashlib.md5(usedforsecurity=False)
    logger.info("downloading %s to %s", url, dest)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as f:
            total = resp.headers.get("Content-Length")
            with tqdm(
                total=int(total) if total else None,
                unit="B",
                unit_scale=True,
                desc=dest.name,
                disable=None,
            ) as bar:
                for chunk in iter(lambda: resp.read(1 << 20), b""):
                    f.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    except (OSError, ValueError) as e:  # URLError, HTTPError and timeouts are all OSErrors
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", e)
        raise LgvitError(
            f"could not download {url} ({reason}); download {dest.name} yourself "
            "and pass --data-dir pointing at it"
        ) from e
    got = h.hexdigest()
    if got != md5:
        tmp.unlink(missing_ok=True)
        raise LgvitError(
            f"md5 mismatch for downloaded {dest}: expected {md5}, got {got} "
            "(the bad download was deleted)"
        )
    os.replace(tmp, dest)
    return dest


def _find_cifar(where: Path, spec: _CifarSpec) -> Path | None:
    """The archive or extracted folder for ``spec`` at ``where``, or None if neither is there."""
    if where.is_file():
        if not _is_archive(where):
            raise LgvitError(f"{where} is not a CIFAR archive (expected {spec.archive})")
        return where
    if not where.is_dir():
        return None
    for folder in (where, where / spec.folder):
        present = [f for f in spec.files if (folder / f).is_file()]
        if present and len(present) < len(spec.files):
            missing = [f for f in spec.files if f not in present]
            raise LgvitError(f"incomplete CIFAR folder {folder}: missing {', '.join(missing)}")
        if present:
            return folder
    archive = where / spec.archive
    return archive if archive.is_file() else None


def _locate_cifar(
    name: str, spec: _CifarSpec, data_dir: str | None, cache: Path, download: bool
) -> Path:
    if data_dir is not None:
        # An explicit path must hold the data: silently downloading elsewhere would hide a typo.
        where = Path(data_dir).expanduser()
        if not where.exists():
            raise LgvitError(f"{name} data dir not found: {where}")
        found = _find_cifar(where, spec)
        if found is None:
            raise LgvitError(
                f"no {name} data in {where} (expected {spec.archive} or "
                f"{spec.folder}/); omit --data-dir to download it into {cache}"
            )
        return found
    found = _find_cifar(cache, spec)
    if found is not None:
        if found.is_file():
            # Our own cache: it should be the official file, so check it like a fresh download.
            got = _file_md5(found)
            if got != spec.md5:
                found.unlink()
                raise LgvitError(
                    f"md5 mismatch for {found}: expected {spec.md5}, got {got} "
                    "(deleted; run again to re-download)"
                )
        return found
    if not download:
        raise LgvitError(
            f"{name} not found in {cache} and download is off; pass --data-dir "
            f"pointing at {spec.archive}"
        )
    return _download(spec.url, cache / spec.archive, spec.md5)


def _read_cifar_objects(source: Path, spec: _CifarSpec) -> dict[str, object]:
    """Unpickle every file of ``spec`` from an archive (one sequential pass) or a folder."""
    objects: dict[str, object] = {}
    if source.is_dir():
        for fname in spec.files:
            with open(source / fname, "rb") as f:
                objects[fname] = safe_unpickle(f, str(source / fname))
        return objects
    try:
        with tarfile.open(source, "r:*") as tf:
            # Read members as they stream past instead of extracting: nothing touches the disk
            # and a gzip stream is decompressed once.
            for member in tf:
                fname = os.path.basename(member.name)
                parent = os.path.basename(os.path.dirname(member.name.rstrip("/")))
                if (
                    member.isfile()
                    and fname in spec.files
                    and fname not in objects
                    and (parent in ("", ".", spec.folder))
                ):
                    fh = tf.extractfile(member)
                    if fh is not None:  # always a stream for a regular file
                        objects[fname] = safe_unpickle(fh, f"{source}:{member.name}")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LgvitError(f"cannot read archive {source}: {e}") from e
    missing = [f for f in spec.files if f not in objects]
    if missing:
        raise LgvitError(f"{source} is missing {', '.join(missing)} (not a {spec.archive}?)")
    return objects


def _cifar_batch(
    obj: object, source: str, spec: _CifarSpec, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(obj, dict):
        raise LgvitError(f"{source}: expected a dict, found {type(obj).__name__}")
    data, labels = obj.get(b"data"), obj.get(spec.label_key)
    if data is None or labels is None:
        key = "data" if data is None else spec.label_key.decode()
        raise LgvitError(f"{source}: no {key!r} entry")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or (data.shape[1] != 3 * 32 * 32)
    ):
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data)
        raise LgvitError(f"{source}: data must be a uint8 (N, 3072) array, found {desc}")
    try:
        lab = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise LgvitError(f"{source}: labels are not integers ({e})") from e
    if lab.shape[0] != data.shape[0]:
        raise LgvitError(f"{source}: {data.shape[0]} images but {lab.shape[0]} labels")
    if lab.size and (lab.min() < 0 or lab.max() >= num_classes):
        raise LgvitError(f"{source}: label {int(lab.max())} out of range for {num_classes} classes")
    # Rows are CHW, row-major: pixel (c, y, x) sits at column c*1024 + y*32 + x.
    return data.reshape(-1, 3, 32, 32), lab


def _load_cifar(name: str, data_dir: str | None, cache: Path, download: bool) -> DatasetSplits:
    spec = _CIFAR_SPECS[name]
    source = _locate_cifar(name, spec, data_dir, cache, download)
    objects = _read_cifar_objects(source, spec)

    meta = objects[spec.meta_file]
    names = meta.get(spec.names_key) if isinstance(meta, dict) else None
    if not isinstance(names, list) or not names:
        raise LgvitError(f"{source}: {spec.meta_file} has no {spec.names_key.decode()!r} list")
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    def split(files: tuple[str, ...]) -> ImageSet:
        parts = [_cifar_batch(objects[f], f"{source}:{f}", spec, len(classes)) for f in files]
        images = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        labels = np.concatenate([p[1] for p in parts])
        # torch wants a writable, contiguous buffer; an unpickled array may be read-only.
        if not images.flags.writeable:
            images = images.copy()
        images = np.ascontiguousarray(images)
        return ImageSet(torch.from_numpy(images), torch.from_numpy(labels), list(classes))

    return DatasetSplits(
        train=split(spec.train_files),
        test=split(spec.test_files),
        name=name,
        mean=spec.mean,
        std=spec.std,
        skipped=[],
    )


# --------------------------------------------------------------------------------------------
# ImageFolder with a decoded uint8 cache
# --------------------------------------------------------------------------------------------

_OK, _BAD, _MISMATCH = 0, 1, 2


def _to_rgb(img: Image.Image) -> Image.Image:
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


def _resize_center_crop(img: Image.Image, size: int) -> Image.Image:
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
    """Decode one file to HWC uint8 RGB: ``(_OK, array)``, ``(_BAD, None)`` or ``(_MISMATCH,
    None)`` when ``expect`` (W, H) is given and the image has another size."""
    try:
        with Image.open(path) as img:
            if expect is not None and img.size != expect:
                return _MISMATCH, None
            if resize is not None and img.format == "JPEG":
                img.draft(None, (resize, resize))  # DCT-domain downscale: big JPEGs decode fast
            img.load()  # open() only reads the header; load() finds truncated data
            rgb = _to_rgb(img)
            if resize is not None:
                rgb = _resize_center_crop(rgb, resize)
            return _OK, np.asarray(rgb, dtype=np.uint8)
    except Exception:  # PIL raises many types for corrupt files (OSError, SyntaxError, ...)
        return _BAD, None


def read_image_rgb(path: str | os.PathLike) -> torch.Tensor:
    """One image file as uint8 ``(3, H, W)`` RGB (any mode PIL reads); LgvitError if unreadable."""
    if not Path(path).is_file():
        raise LgvitError(f"{path}: no such image file")
    status, arr = _decode_image(str(path), None, None)
    if status != _OK or arr is None:
        raise LgvitError(f"{path}: not a readable image (empty, truncated or not an image)")
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def _decode_chunk(
    job: tuple[int, list[str], tuple[int, int] | None, int | None, tuple[int, int]],
) -> tuple[int, np.ndarray, np.ndarray]:
    """Decode a run of files into one (k, 3, H, W) block; stops at the first size mismatch."""
    start, paths, expect, resize, (h, w) = job
    out = np.zeros((len(paths), 3, h, w), dtype=np.uint8)
    status = np.full(len(paths), _BAD, dtype=np.uint8)
    for i, path in enumerate(paths):
        status[i], arr = _decode_image(path, expect, resize)
        if status[i] == _OK:
            out[i] = arr.transpose(2, 0, 1)
        elif status[i] == _MISMATCH:
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


def _decode_pass(
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
    status = np.full(n, _BAD, dtype=np.uint8)
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
            if (st == _MISMATCH).any():
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


def _probe_size(paths: list[str]) -> tuple[int, int] | None:
    """(W, H) of the first file whose header PIL can read."""
    for path in paths:
        try:
            with Image.open(path) as img:
                return img.size
        except Exception:  # unreadable: the decode pass will count it
            continue
    return None


def _store_plan(first: tuple[int, int], img_size: int | None) -> tuple[int, int] | None:
    """Native (W, H) to try storing at, or None to go straight to resizing.

    Images are stored at their native size when they all share it and it is <= 2 * img_size
    (CIFAR-like data: augmentation upsamples later); otherwise resized to round(img_size/0.875)
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


def _scan_split(split_dir: Path) -> _SplitFiles:
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and _visible(e.name))
    if not classes:
        raise LgvitError(f"no class folders in {split_dir} (expected {split_dir}/<class>/*)")
    paths: list[str] = []
    labels: list[int] = []
    stats: list[tuple[str, int, int]] = []
    empty: list[str] = []
    for label, cls in enumerate(classes):
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


def _extract_cached(archive: Path, cache: Path) -> Path:
    """Safe-extract ``archive`` under ``cache/extracted`` once; later calls reuse the folder."""
    st = archive.stat()
    ident = f"{os.path.realpath(archive)}|{st.st_size}|{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    dest = cache / "extracted" / f"{_archive_stem(archive)}-{key}"
    if dest.is_dir():
        return dest
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("extracting %s to %s", archive, dest)
    try:
        safe_extract(archive, tmp)
        os.replace(tmp, dest)  # atomic: a half-extracted tree never carries the final name
    except OSError:
        if not dest.is_dir():  # another process finishing first is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _imagefolder_root(data_dir: Path, cache: Path) -> Path:
    if not data_dir.exists():
        raise LgvitError(f"imagefolder data dir not found: {data_dir}")
    root = data_dir
    if root.is_file():
        if not _is_archive(root):
            raise LgvitError(f"{root} is a file but not a .tar.gz/.tgz/.tar archive")
        root = _extract_cached(root, cache)
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


def _cache_key(root: Path, img_size: int | None, splits: list[_SplitFiles]) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}|{os.path.realpath(root)}|{img_size}".encode())
    for sp in splits:
        h.update(f"|{sp.dirname}|{len(sp.stats)}".encode())
        for rel, size, mtime in sp.stats:
            h.update(f"\n{rel}\0{size}\0{mtime}".encode())
    return h.hexdigest()[:20]


def _read_cache(base: Path) -> tuple[np.ndarray, dict] | None:
    npy, meta_path = base.with_suffix(".npy"), base.with_suffix(".json")
    if not meta_path.is_file() or not npy.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        # Copy-on-write map: torch needs a writable buffer, and writes must never reach the file.
        images = np.load(npy, mmap_mode="c")
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != len(meta["labels"]):
            return None
        return images, meta
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged cache: decode again


def _write_json_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _build_cache(base: Path, splits: list[_SplitFiles], img_size: int | None) -> None:
    """Decode every image of ``splits`` into ``base.npy`` (readable rows only) + ``base.json``."""
    paths = [p for sp in splits for p in sp.paths]
    labels = np.array([lab for sp in splits for lab in sp.labels], dtype=np.int64)
    split_of = np.concatenate([np.full(len(sp.paths), i) for i, sp in enumerate(splits)])
    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = base.with_name(f"{base.name}.tmp-{os.getpid()}.npy")
    final_tmp = base.with_name(f"{base.name}.final-{os.getpid()}.npy")
    try:
        first = _probe_size(paths)
        status, hw = None, (0, 0)
        if first is None:  # nothing readable at all: every row is bad
            status = np.full(len(paths), _BAD, dtype=np.uint8)
            np.lib.format.open_memmap(
                tmp, mode="w+", dtype=np.uint8, shape=(len(paths), 3, 1, 1)
            ).flush()
        else:
            native = _store_plan(first, img_size)
            if native is not None:
                hw = (native[1], native[0])
                status = _decode_pass(paths, native, None, hw, tmp, "decoding")
            if status is None:  # sizes differ, or too large to keep: resize everything
                side = round((img_size or _DEFAULT_IMG_SIZE) / _CROP_PCT)
                hw = (side, side)
                status = _decode_pass(paths, None, side, hw, tmp, f"decoding+resizing to {side}")
        ok = status == _OK
        if ok.all():
            os.replace(tmp, final_tmp)
        else:  # drop the unreadable rows, copying in blocks to keep memory flat
            src = np.load(tmp, mmap_mode="r")
            dst = np.lib.format.open_memmap(
                final_tmp, mode="w+", dtype=np.uint8, shape=(int(ok.sum()), *src.shape[1:])
            )
            keep = np.flatnonzero(ok)
            for i in range(0, len(keep), 4096):
                dst[i : i + 4096] = src[keep[i : i + 4096]]
            dst.flush()
            del src, dst
        os.replace(final_tmp, base.with_suffix(".npy"))
        meta = {
            "version": _CACHE_VERSION,
            "classes": splits[0].classes,
            "splits": [sp.dirname for sp in splits],
            "counts": [int(ok[split_of == i].sum()) for i in range(len(splits))],
            "totals": [len(sp.paths) for sp in splits],
            "labels": labels[ok].tolist(),
            "skipped": [
                [p for p, s in zip(sp.paths, status[split_of == i], strict=True) if s != _OK]
                for i, sp in enumerate(splits)
            ],
            "store_hw": list(hw),
        }
        # The json is written last: its presence marks a complete cache entry.
        _write_json_atomic(base.with_suffix(".json"), meta)
    finally:
        tmp.unlink(missing_ok=True)
        final_tmp.unlink(missing_ok=True)


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
        stacklevel=4,
    )


def _load_imagefolder(
    data_dir: Path,
    img_size: int | None,
    cache: Path,
    max_bad_fraction: float,
    stream: bool | None = None,
) -> DatasetSplits:
    root = _imagefolder_root(data_dir, cache)
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

    if stream is None:
        first = _probe_size(train.paths)
        side = round((img_size or 224) / 0.875)
        n = len(train.paths) + len(val.paths)
        big = n * 3 * side * side > STREAM_ABOVE_BYTES
        stream = first is not None and _store_plan(first, img_size) is None and big
    if stream:
        classes = list(train.classes)
        cifar_like = tuple(classes) == CIFAR10_CLASSES
        return DatasetSplits(
            train=FileImageSet(train.paths, torch.tensor(train.labels, dtype=torch.int64), classes),
            test=FileImageSet(val.paths, torch.tensor(val.labels, dtype=torch.int64), classes),
            name="imagefolder",
            mean=CIFAR10_MEAN if cifar_like else IMAGENET_MEAN,
            std=CIFAR10_STD if cifar_like else IMAGENET_STD,
            skipped=[],
        )
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", root.name) or "root"
    base = cache / "imagefolder" / f"{safe}-{_cache_key(root, img_size, [train, val])}"
    cached = _read_cache(base)
    if cached is None:
        _build_cache(base, [train, val], img_size)
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
    cifar_like = tuple(classes) == CIFAR10_CLASSES
    return DatasetSplits(
        train=ImageSet(torch.from_numpy(images[:n_train]), labels[:n_train], classes),
        test=ImageSet(torch.from_numpy(images[n_train:]), labels[n_train:], list(classes)),
        name="imagefolder",
        mean=CIFAR10_MEAN if cifar_like else IMAGENET_MEAN,
        std=CIFAR10_STD if cifar_like else IMAGENET_STD,
        skipped=skipped,
    )


# --------------------------------------------------------------------------------------------
# digits (scikit-learn) and synthetic
# --------------------------------------------------------------------------------------------

DIGITS_TEST = 300  # of 1,797: 1,497 train / 300 test


def _digits_split(labels: np.ndarray, n_test: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split with a fixed seed (0): each class gives its share of ``n_test``
    (largest-remainder rounding, so the total is exact), picked by a seeded permutation."""
    rng = np.random.default_rng(0)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * n_test / len(labels)
    take = np.floor(quota).astype(int)
    order = np.argsort(-(quota - take), kind="stable")
    take[order[: n_test - take.sum()]] += 1
    test = np.concatenate(
        [
            rng.permutation(np.flatnonzero(labels == c))[:k]
            for c, k in zip(classes, take, strict=True)
        ]
    )
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[test] = True
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def _load_digits(size: int) -> DatasetSplits:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise LgvitError("the digits dataset needs scikit-learn: pip install scikit-learn") from e
    bunch = load_digits()
    raw = np.asarray(bunch.images, dtype=np.float64)  # (1797, 8, 8), values 0..16
    labels = np.asarray(bunch.target, dtype=np.int64)
    x = torch.from_numpy(np.rint(raw * (255.0 / 16.0)).astype(np.float32)).unsqueeze(1)
    if size != x.shape[-1]:
        x = torch.nn.functional.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False
        )
    images = x.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    train_idx, test_idx = _digits_split(labels, DIGITS_TEST)
    classes = [str(i) for i in range(10)]
    train_np = images[torch.from_numpy(train_idx)].numpy()
    # float64 numpy reductions are deterministic (torch's depend on the thread count).
    mean = float(train_np.mean(dtype=np.float64) / 255.0)
    std = float(train_np.std(dtype=np.float64) / 255.0)

    def subset(idx: np.ndarray) -> ImageSet:
        t = torch.from_numpy(idx)
        return ImageSet(images[t].contiguous(), torch.from_numpy(labels[idx]), list(classes))

    return DatasetSplits(
        train=subset(train_idx),
        test=subset(test_idx),
        name="digits",
        mean=(mean, mean, mean),
        std=(std, std, std),
        skipped=[],
    )


def _load_synthetic(
    size: int, sizes: tuple[int, int], num_classes: int, seed: int
) -> DatasetSplits:
    n_train, n_test = sizes
    if n_train < 1 or n_test < 1:
        raise LgvitError(f"synthetic_size must be two positive counts, got {sizes}")
    if num_classes < 1:
        raise LgvitError(f"num_classes must be positive, got {num_classes}")
    gen = torch.Generator().manual_seed(seed)
    classes = [str(i) for i in range(num_classes)]

    def make(n: int) -> ImageSet:
        images = torch.randint(0, 256, (n, 3, size, size), generator=gen, dtype=torch.uint8)
        labels = torch.randint(0, num_classes, (n,), generator=gen, dtype=torch.int64)
        return ImageSet(images, labels, list(classes))

    return DatasetSplits(
        train=make(n_train),
        test=make(n_test),
        name="synthetic",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        skipped=[],
    )
