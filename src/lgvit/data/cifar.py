"""CIFAR-10 / CIFAR-100 from the official python-format archives.

Read straight out of the ``.tar.gz`` (or an extracted folder) with a restricted unpickler;
downloaded and md5-checked into the cache directory when no local copy is given.
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch

from lgvit.core.constants import CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD
from lgvit.core.errors import LgvitError
from lgvit.core.safe_pickle import RestrictedUnpickler
from lgvit.data.archives import download_checked, file_md5, is_archive
from lgvit.data.splits import DatasetSplits, ImageSet

__all__ = ["CIFAR10_CLASSES", "CIFAR_SPECS", "load_cifar", "safe_unpickle"]

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

# Exactly what a pickled numpy array needs, nothing else: no callables that reach the OS.
_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


def _numpy_array_global(module: str, name: str) -> bool:
    return (module, name) in _PICKLE_ALLOWED


def safe_unpickle(data: bytes | IO[bytes], source: str) -> object:
    """Unpickle ``data`` allowing only plain containers and numpy arrays (``encoding='bytes'``).

    ``source`` names the file in error messages. Anything that would import another global
    (``os.system``, ``subprocess``...) raises :class:`LgvitError` before it can run.
    """

    def refuse(module: str, name: str) -> object:
        raise LgvitError(
            f"{source}: refusing to unpickle {module}.{name} (a dataset file may only "
            "hold dicts, lists, bytes and numpy arrays)"
        )

    fh = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return RestrictedUnpickler(fh, _numpy_array_global, refuse, encoding="bytes").load()
    except LgvitError:
        raise
    except Exception as e:  # a corrupt pickle raises many types (EOFError, UnpicklingError...)
        raise LgvitError(f"{source}: not a readable pickle ({type(e).__name__}: {e})") from e


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


CIFAR_SPECS = {
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


def _find_cifar(where: Path, spec: _CifarSpec) -> Path | None:
    """The archive or extracted folder for ``spec`` at ``where``, or None if neither is there."""
    if where.is_file():
        if not is_archive(where):
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
            got = file_md5(found)
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
    return download_checked(spec.url, cache / spec.archive, spec.md5)


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


def load_cifar(name: str, data_dir: str | None, cache: Path, download: bool) -> DatasetSplits:
    """``cifar10``/``cifar100`` from ``data_dir`` (an archive or folder), else from ``cache``
    (downloaded there when ``download``)."""
    spec = CIFAR_SPECS[name]
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
