"""Datasets as decoded, in-memory uint8 tensors (the airbench approach: decode once, keep bytes).

Every loader returns a :class:`DatasetSplits` whose ``train``/``test`` hold ``uint8`` images of
shape ``(N, 3, H, W)`` and ``int64`` labels. Augmentation, resizing to the model's input size and
normalisation (``mean``/``std``, in ``[0, 1]`` units) happen later, on batches.

This module is the front door (:func:`load_dataset`); each source lives in its own module,
with one record in :mod:`lgvit.data.sources` (what it needs, its options, how it opens):

* ``cifar10`` / ``cifar100`` (:mod:`lgvit.data.cifar`): the official python-format archives,
  read with a restricted unpickler, downloaded and md5-checked when no local copy is given.
* ``imagefolder`` (:mod:`lgvit.data.imagefolder`): ``<root>/train/<class>/*`` and
  ``<root>/val/<class>/*`` (or ``test/``), or a ``.tar.gz`` of such a tree, decoded once into a
  memory-mapped ``.npy`` cache (:mod:`lgvit.data.decode`), or streamed when too large.
* ``wds`` (:mod:`lgvit.data.wds`): WebDataset shards (``.tar`` files of ``NNN.jpg`` +
  ``NNN.cls`` samples, with timm's hub ``_info.json`` or without), streamed and split over
  ranks and workers.
* ``hfds`` (:mod:`lgvit.data.hfds`): a Hugging Face dataset on disk (``save_to_disk``, or the
  hub's parquet / arrow files named by split), read map-style.
* ``digits``, ``synthetic`` (:mod:`lgvit.data.builtin`): scikit-learn's bundled 8x8 digits,
  and seeded random images for tests and benchmarks.

``wds`` and ``hfds`` are ImageNet as its users store it: read while iterating (never decoded
into the cache), their images decoded and cropped by DataLoader workers like a streamed folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lgvit.core.constants import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    IMAGE_EXTENSIONS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_BAD_FRACTION,
)
from lgvit.core.errors import LgvitError
from lgvit.data.archives import default_cache_dir, safe_extract
from lgvit.data.builtin import DIGITS_TEST
from lgvit.data.cifar import CIFAR10_CLASSES, safe_unpickle
from lgvit.data.decode import read_image_rgb
from lgvit.data.sources import DATA_SOURCES, DATASETS, OPTION_SOURCES, Request
from lgvit.data.splits import DatasetSplits, FileImageSet, ImageSet

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "DATASETS",
    "DIGITS_TEST",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "STREAM_ABOVE_BYTES",
    "DatasetSplits",
    "FileImageSet",
    "ImageSet",
    "dataset_names",
    "default_cache_dir",
    "load_dataset",
    "load_test_split",
    "read_image_rgb",
    "safe_extract",
    "safe_unpickle",
]

STREAM_ABOVE_BYTES = 4 * 2**30  # an imagefolder whose decoded cache would exceed this streams


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`."""
    return list(DATASETS)


def load_dataset(
    name: str,
    data_dir: str | None = None,
    *,
    img_size: int | None = None,
    cache_dir: str | None = None,
    download: bool = True,
    max_bad_fraction: float = MAX_BAD_FRACTION,
    synthetic_size: tuple[int, int] = (512, 128),
    num_classes: int = 10,
    seed: int = 0,
    stream: bool | None = None,
    input_key: str | None = None,
    target_key: str | None = None,
    train_split: str | None = None,
    val_split: str | None = None,
) -> DatasetSplits:
    """Load ``name`` (one of :func:`dataset_names`) as uint8 tensors.

    ``img_size`` matters for ``imagefolder`` (storage size: native when all images share a size
    of at most ``2 * img_size``, else resized to ``round(img_size / 0.875)``), ``digits`` and
    ``synthetic`` (output size, default 32); CIFAR is always stored at its native 32x32.
    ``cache_dir`` defaults to :func:`default_cache_dir`. ``max_bad_fraction`` is the share of
    unreadable images per imagefolder split tolerated before giving up. ``synthetic_size``,
    ``num_classes`` and ``seed`` only affect ``synthetic``. ``stream`` (imagefolder only): True
    returns the splits as :class:`FileImageSet` file lists for :mod:`lgvit.data.stream`, False
    always decodes into the cache, None (default) streams when the images would be resized and
    the decoded cache would exceed ``STREAM_ABOVE_BYTES`` (ImageNet). ``input_key``,
    ``target_key`` (the image and label key of a shard's samples or a dataset's columns) and
    ``train_split``/``val_split`` apply to ``wds`` and ``hfds``; None: the source's defaults
    (timm's: ``jpg;png;webp`` / ``cls`` for shards, ``image`` / ``label`` columns, splits
    ``train`` and ``validation``).
    """
    key = name.strip().lower()
    if key not in DATASETS:
        raise LgvitError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if img_size is not None and (not isinstance(img_size, int) or img_size < 1):
        raise LgvitError(f"img_size must be a positive integer, got {img_size!r}")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise LgvitError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    options = dict(input_key=input_key, target_key=target_key, train_split=train_split,
                   val_split=val_split)  # fmt: skip
    source = DATA_SOURCES[key]
    return source.open_train(Request(
        key, data_dir, cache, img_size=img_size, download=download,
        max_bad_fraction=max_bad_fraction, synthetic_size=synthetic_size,
        num_classes=num_classes, seed=seed, stream=stream, stream_above=STREAM_ABOVE_BYTES,
        options={k: v for k, v in options.items() if k in source.options},
    ))  # fmt: skip


def load_test_split(
    name: str,
    data_dir: str | None = None,
    *,
    img_size: int | None = None,
    cache_dir: str | None = None,
    class_map: str | None = None,
    input_key: str | None = None,
    target_key: str | None = None,
    split: str | None = None,
) -> ImageSet | FileImageSet | Any:
    """The split ``lgvit eval`` evaluates. An ``imagefolder`` is read from its files (each image
    preprocessed from the original, as timm's validation does, and named in the results): its
    ``val/`` or ``test/`` folder, or ``data_dir`` itself as a folder of class folders (no
    ``train/`` needed: ImageNet-V2's layout); ``class_map`` (timm's ``--class-map`` file) fixes
    the class indices. ``wds``/``hfds``: their ``split`` (default: the validation split),
    read with ``input_key``/``target_key``. Other datasets: their test split (see
    :func:`load_dataset`)."""
    key = name.strip().lower()
    source = DATA_SOURCES.get(key)
    if (input_key or target_key or split) and not (source and source.options):
        raise LgvitError(f"--input-key, --target-key and --split apply to "
                         f"{' and '.join(OPTION_SOURCES)}, not to the {name} dataset")  # fmt: skip
    if class_map is not None and not (source and source.class_map):
        raise LgvitError(f"a class map applies to image folders, not to the {name} dataset")
    if source is None or source.open_test is None:
        return load_dataset(name, data_dir, img_size=img_size, cache_dir=cache_dir).test
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    options = dict(input_key=input_key, target_key=target_key, split=split)
    return source.open_test(Request(key, data_dir, cache, img_size, class_map=class_map,
                                    options=options if source.options else {}))  # fmt: skip
