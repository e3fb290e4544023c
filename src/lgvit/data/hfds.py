"""Hugging Face datasets on disk as a training and evaluation source: ImageNet as the hub
stores it (parquet or arrow files with ``image`` and ``label`` columns).

``--data-dir`` is a dataset saved with ``save_to_disk`` (a ``DatasetDict``'s folder, or one
``Dataset``'s: one split, which ``lgvit eval`` reads and training refuses), or a folder of
parquet or arrow files named by split as on the hub (``train-00000-of-00004.parquet``,
``data/validation-*.parquet``, ``train/*.arrow``): the ``datasets`` library's own naming rules
give each file its split (so ``val-*.parquet`` is the validation split). Everything is read
locally with ``datasets``: no hub, no loading script, no code from the data. Parquet files are
converted once into ``datasets``' arrow cache (``HF_DATASETS_CACHE``), which is how ``datasets``
reads parquet row by row; arrow files and saved datasets are memory-mapped where they lie.

A split is map-style (:class:`HFImageSet`, a :class:`lgvit.data.splits.SampleSet`): the
streaming loader (:mod:`lgvit.data.stream`) shards it over ranks, seeds and resumes it and
counts undecodable images, and its workers decode the image column's encoded bytes with lgvit's
decoder (upright by EXIF, decompression bombs refused), not with ``datasets``' PIL path, so the
decode and the batched uint8 augmentation are the same as for image files. The label column is
read alone when the split is opened (no image read): rows without a usable label are left out
there and reported.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from lgvit.core.constants import IMAGENET_MEAN, IMAGENET_STD, MAX_CLASSES
from lgvit.core.errors import LgvitError, first_line
from lgvit.data.decode import load_rgb
from lgvit.data.splits import DatasetSplits

__all__ = ["DEFAULT_INPUT_KEY", "DEFAULT_TARGET_KEY", "HFImageSet", "hfds_split", "hfds_splits"]

DEFAULT_INPUT_KEY, DEFAULT_TARGET_KEY = "image", "label"  # the hub's image datasets' columns
TRAIN_SPLIT = "train"
VAL_SPLITS = ("validation", "val", "test")  # the evaluation split, else these (as timm)
_FORMATS = (".parquet", ".arrow")  # in this order where a split has both

Loaders = dict[str, Callable[[], Any]]  # split name -> its datasets.Dataset, read on demand


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise LgvitError(
            "--data hfds needs the datasets package: pip install 'lgvit[hfds]'"
        ) from None
    return datasets


@dataclass
class HFImageSet:
    """One split of a Hugging Face dataset, read row by row: ``images`` is the dataset with its
    image column alone, undecoded (a memory-mapped arrow table: DataLoader workers share it, and
    pickling it carries its file paths, not its rows); ``rows`` the dataset rows used (those
    with a usable label), ``labels`` theirs."""

    split: str
    images: Any  # datasets.Dataset
    input_key: str
    rows: np.ndarray  # int64 (N,)
    labels: torch.Tensor  # int64 (N,)
    classes: list[str]
    classes_inferred: bool = False  # 0..K-1 from the largest label seen: no ClassLabel

    def __len__(self) -> int:
        return len(self.rows)

    def name(self, i: int) -> str:
        """Sample ``i``'s name in results: ``<split>[<row>]``."""
        return f"{self.split}[{int(self.rows[i])}]"

    def open(self, i: int) -> Image.Image:
        """Sample ``i`` decoded by lgvit; raises when it is unreadable (counted by the loader)."""
        return load_rgb(self._cell(i))

    def encoded(self, i: int) -> bytes:
        """Sample ``i``'s encoded image (what a device decoder reads)."""
        cell = self._cell(i)
        if isinstance(cell, str):
            with open(cell, "rb") as f:
                return f.read()
        return cell

    def _cell(self, i: int) -> bytes | str:
        cell = self.images[int(self.rows[i])][self.input_key]
        if isinstance(cell, dict):  # datasets' Image storage: encoded bytes, or a file's path
            cell = cell.get("bytes") or cell.get("path")
        if not isinstance(cell, (bytes, str)):
            raise ValueError(f"{self.name(i)} holds no image")
        return cell


# ---------------------------------------------------------------------------- finding splits


def _neither(data_dir: str) -> LgvitError:
    return LgvitError(
        f"hfds {data_dir} is neither a dataset saved with save_to_disk nor a folder of parquet "
        "or arrow files named by split (train-*.parquet, validation-*.parquet)"
    )


def _saved(data_dir: str) -> Loaders:
    """The splits of a dataset saved with ``save_to_disk`` (memory-mapped, so read at once)."""
    try:
        saved = _datasets().load_from_disk(data_dir)
    except Exception as e:  # a damaged save: datasets raises many types
        why = first_line(e)
        raise LgvitError(f"hfds {data_dir}: cannot read the saved dataset ({why})") from None
    if not isinstance(saved, _datasets().DatasetDict):  # one Dataset: the split it records,
        # else its folder's name (a DatasetDict saves each split in a folder named by it)
        saved = {str(saved.split or Path(data_dir).resolve().name or TRAIN_SPLIT): saved}
    return {str(name): (lambda ds=ds: ds) for name, ds in saved.items()}


def _files(data_dir: str) -> Loaders:
    """Parquet or arrow files by split, as ``datasets`` names the hub's files."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    if not Path(data_dir).is_dir():
        raise _neither(data_dir)
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(data_dir), base_path=data_dir)
    except Exception:  # no files (datasets' EmptyDatasetError), or none it can name
        raise _neither(data_dir) from None
    loaders = {}
    for split, files in found.items():
        for suffix in _FORMATS:
            chosen = sorted(str(f) for f in files if str(f).endswith(suffix))
            if chosen:
                loaders[str(split)] = partial(_read_files, data_dir, str(split), suffix, chosen)
                break
    if not loaders:
        raise _neither(data_dir)
    return loaders


def _read_files(data_dir: str, split: str, suffix: str, files: list[str]) -> Any:
    d = _datasets()
    try:
        if suffix == ".arrow":
            try:  # memory-mapped where they lie (load_dataset("arrow") would copy them)
                parts = [d.Dataset.from_file(f) for f in files]
                return parts[0] if len(parts) == 1 else d.concatenate_datasets(parts)
            except Exception:  # Arrow's IPC file format, which only the arrow builder reads
                return d.load_dataset("arrow", data_files=files, split="train")
        return d.load_dataset("parquet", data_files=files, split="train")
    except Exception as e:  # a damaged file: pyarrow and datasets raise many types
        raise LgvitError(f"hfds {data_dir}: cannot read split {split} ({first_line(e)})") from None


def _source(data_dir: str) -> Loaders:
    _datasets()
    folder = Path(data_dir)
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return _saved(data_dir)
    return _files(data_dir)


def _one_dataset(data_dir: str) -> bool:
    """Whether ``data_dir`` holds one saved ``Dataset``, not a ``DatasetDict`` (the files
    ``load_from_disk`` tells them apart by)."""
    folder = Path(data_dir)
    return (folder / "state.json").is_file() and not (folder / "dataset_dict.json").is_file()


def _one_for_training(data_dir: str, name: str) -> LgvitError:
    """Training needs a train and a validation split: what to give instead of one."""
    parent = Path(data_dir).parent
    instead = (f"give --data-dir {parent}, the DatasetDict it is a split of"
               if (parent / "dataset_dict.json").is_file() else "save both as one (DatasetDict("
               "train=..., validation=...).save_to_disk) and give its folder")  # fmt: skip
    return LgvitError(f"hfds {data_dir} holds one saved Dataset (split {name!r}), not a "
                      f"DatasetDict with train and validation splits: {instead}")  # fmt: skip


def _check_split(source: Loaders, data_dir: str, split: str) -> None:
    if split not in source:
        raise LgvitError(f"hfds {data_dir}: no split {split!r} (splits: {', '.join(source)})")


def _val_name(source: Loaders, data_dir: str, given: str | None) -> str:
    """The evaluation split: ``given``, else "validation", else "val" or "test" (said)."""
    if given:
        return given
    name = next((n for n in VAL_SPLITS if n in source), None)
    if name is None:
        raise LgvitError(f"hfds {data_dir}: no split {VAL_SPLITS[0]!r} (nor "
                         f"{' or '.join(map(repr, VAL_SPLITS[1:]))}; splits: "
                         f"{', '.join(source)})")  # fmt: skip
    if name != VAL_SPLITS[0]:
        warnings.warn(f"hfds {data_dir}: no {VAL_SPLITS[0]!r} split: evaluating on {name!r}",
                      stacklevel=3)  # fmt: skip
    return name


# ---------------------------------------------------------------------------- reading a split


def _images(ds: Any, data_dir: str, split: str, key: str) -> Any:
    """The image column alone, its bytes undecoded (lgvit decodes them)."""
    d = _datasets()
    feature = ds.features[key]
    if isinstance(feature, d.Image):
        ds = ds.cast_column(key, d.Image(decode=False))  # the features change, not the table
    elif not (isinstance(feature, d.Value) and feature.dtype in ("binary", "large_binary")):
        raise LgvitError(f"hfds {data_dir}: column {key!r} of split {split} holds "
                         f"{_kind(feature)}, not images (--input-key)")  # fmt: skip
    return ds.select_columns([key])


def _kind(feature: Any) -> str:
    return str(getattr(feature, "dtype", type(feature).__name__))


def _labels(
    ds: Any, data_dir: str, split: str, key: str
) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    """The label column alone (no image read): its values (int64, or uint64 for an unsigned
    type, so every integer type's values are exact), which rows have no label (null), and the
    class names its ``ClassLabel`` feature gives."""
    import pyarrow as pa

    d = _datasets()
    feature = ds.features[key]
    column = ds.select_columns([key]).with_format("arrow")[:][key]
    if not pa.types.is_integer(column.type):
        raise LgvitError(f"hfds {data_dir}: column {key!r} of split {split} holds "
                         f"{_kind(feature)}, not integer labels (--target-key)")  # fmt: skip
    missing = column.is_null().to_numpy(zero_copy_only=False)
    wide = pa.uint64() if pa.types.is_unsigned_integer(column.type) else pa.int64()
    # 0 fills the nulls (any integer type holds it, unlike -1), masked by ``missing``
    values = column.fill_null(0).cast(wide).to_numpy(zero_copy_only=False)
    return values, missing, list(feature.names) if isinstance(feature, d.ClassLabel) else None


def _bad(values: np.ndarray, missing: np.ndarray, k: int) -> np.ndarray:
    """Rows without a usable label: none (null, or ClassLabel's -1), or outside 0..k-1."""
    bad = missing | (values >= k)
    return bad | (values < 0) if values.dtype.kind == "i" else bad  # uint64: never below 0


def _unusable(split: str, values: np.ndarray, missing: np.ndarray, k: int) -> list[str]:
    """Rows without a usable label, named with why."""
    return [f"{split}[{r}]: no label" if missing[r] or values[r] == -1 else
            f"{split}[{r}]: label {values[r]} outside 0..{k - 1}"
            for r in np.flatnonzero(_bad(values, missing, k)).tolist()]  # fmt: skip


def _read_split(
    source: Loaders, data_dir: str, split: str, input_key: str | None, target_key: str | None,
    like: HFImageSet | None, max_bad_fraction: float | None,
) -> tuple[HFImageSet, list[str]]:  # fmt: skip
    """A split and its rows left out. Classes: those of ``like`` (the train split, whose label
    feature's names, if any, must be this split's), else the label feature's names, else 0..K-1
    for K the largest label + 1. More rows left out than ``max_bad_fraction`` is one line
    (None: a warning)."""
    _check_split(source, data_dir, split)
    ds = source[split]()
    image_key, label_key = input_key or DEFAULT_INPUT_KEY, target_key or DEFAULT_TARGET_KEY
    for key in (image_key, label_key):
        if key not in ds.column_names:
            raise LgvitError(f"hfds {data_dir}: no column {key!r} in split {split} (columns: "
                             f"{', '.join(ds.column_names)})")  # fmt: skip
    images = _images(ds, data_dir, split, image_key)
    values, missing, names = _labels(ds, data_dir, split, label_key)
    if like is not None and names and names != like.classes:
        raise LgvitError(f"hfds {data_dir}: the ClassLabel classes of splits {like.split} and "
                         f"{split} differ: {_difference(like, split, names)}")  # fmt: skip
    classes = (
        like.classes if like is not None else names or _numbered(data_dir, split, values, missing)
    )
    if len(classes) > MAX_CLASSES:  # a ClassLabel's declared count (the head is sized by it)
        raise LgvitError(f"hfds {data_dir}: column {label_key!r} of split {split} declares "
                         f"{len(classes)} classes (ClassLabel), more than MAX_CLASSES "
                         f"({MAX_CLASSES})")  # fmt: skip
    left_out = _unusable(split, values, missing, len(classes))
    _check_left_out(data_dir, split, left_out, len(values), max_bad_fraction)
    rows = np.flatnonzero(~_bad(values, missing, len(classes)))
    labels = torch.from_numpy(values[rows].astype(np.int64))  # all in 0..K-1 now
    inferred = like.classes_inferred if like is not None else not names
    return HFImageSet(split, images, image_key, rows, labels, list(classes), inferred), left_out


def _difference(like: HFImageSet, split: str, names: list[str]) -> str:
    """Both class lists where they are short, else the first class that differs."""
    ours, theirs = like.classes, names
    if len(ours) + len(theirs) <= 20:
        return f"{like.split} [{', '.join(ours)}], {split} [{', '.join(theirs)}]"
    shorter = min(len(ours), len(theirs))  # one list a prefix of the other: where it ends
    i = next((i for i in range(shorter) if ours[i] != theirs[i]), shorter)
    at = [repr(c[i]) if i < len(c) else "absent" for c in (ours, theirs)]
    counts = (f"{len(ours)} classes in each" if len(ours) == len(theirs)
              else f"{len(ours)} and {len(theirs)} classes")  # fmt: skip
    return f"class {i} is {at[0]} in {like.split} and {at[1]} in {split} ({counts})"


def _numbered(data_dir: str, split: str, values: np.ndarray, missing: np.ndarray) -> list[str]:
    """Classes 0..K-1 without a ClassLabel, K the largest label + 1: at most MAX_CLASSES, so
    one stray label cannot size the head (the first row past it is named)."""
    present = values[~missing]
    top = int(present.max()) if present.size else -1
    if top >= MAX_CLASSES:
        row = int(np.flatnonzero(~missing & (values >= MAX_CLASSES))[0])
        raise LgvitError(f"hfds {data_dir}: label {values[row]} of {split}[{row}] would make "
                         f"{int(values[row]) + 1} classes, more than MAX_CLASSES ({MAX_CLASSES}; "
                         "without a ClassLabel the classes are 0..the largest label)")  # fmt: skip
    return [str(i) for i in range(top + 1)]


def _check_left_out(
    data_dir: str, split: str, left_out: list[str], total: int, max_bad_fraction: float | None
) -> None:
    if not left_out:
        return
    frac, example = len(left_out) / total, left_out[0]
    what = f"{len(left_out)} of {total} rows of split {split} have no usable label"
    if max_bad_fraction is not None and frac > max_bad_fraction:
        raise LgvitError(f"hfds {data_dir}: {what} ({frac:.1%} > max_bad_fraction "
                         f"{max_bad_fraction:.1%}), e.g. {example}")  # fmt: skip
    if len(left_out) == total:
        raise LgvitError(f"hfds {data_dir}: none of the {total} rows of split {split} has a "
                         f"usable label (--target-key), e.g. {example}")  # fmt: skip
    if max_bad_fraction is None:  # evaluation: no run log to report them in
        warnings.warn(f"hfds {data_dir}: {what}, left out, e.g. {example}", stacklevel=4)


# ---------------------------------------------------------------------------- the front door


def hfds_splits(
    data_dir: str, *, train_split: str | None, val_split: str | None, input_key: str | None,
    target_key: str | None, max_bad_fraction: float,
) -> DatasetSplits:  # fmt: skip
    """The train and evaluation splits (``None``: "train" and "validation", columns ``image``
    and ``label``); the evaluation split has the train split's classes. ``skipped``: the rows
    left out for want of a usable label."""
    source = _source(data_dir)
    if _one_dataset(data_dir):
        raise _one_for_training(data_dir, next(iter(source)))
    train_name = train_split or TRAIN_SPLIT
    _check_split(source, data_dir, train_name)  # before the evaluation split's note
    val_name = _val_name(source, data_dir, val_split)
    keys = dict(input_key=input_key, target_key=target_key, max_bad_fraction=max_bad_fraction)
    train, skipped = _read_split(source, data_dir, train_name, like=None, **keys)
    test, skipped_test = _read_split(source, data_dir, val_name, like=train, **keys)
    return DatasetSplits(train=train, test=test, name="hfds", mean=IMAGENET_MEAN,
                         std=IMAGENET_STD, skipped=skipped + skipped_test)  # fmt: skip


def hfds_split(
    data_dir: str, *, split: str | None, input_key: str | None, target_key: str | None
) -> HFImageSet:
    """The split ``lgvit eval`` reads (default: the validation split; a folder holding one
    saved ``Dataset``: that one); rows without a usable label are left out with a warning."""
    source = _source(data_dir)
    one = _one_dataset(data_dir)
    name = next(iter(source)) if one else _val_name(source, data_dir, split)
    if one and split and split != name:
        raise LgvitError(
            f"hfds {data_dir} holds one saved Dataset (split {name!r}), the split "
            f"evaluated: --split {split!r} names another (leave --split out)"
        )
    return _read_split(source, data_dir, name, input_key, target_key, None, None)[0]
