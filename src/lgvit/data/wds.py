"""WebDataset shards (``.tar`` files of ``NNN.jpg`` + ``NNN.cls`` samples) as a training and
evaluation source: ImageNet as the hub's ``timm/imagenet-1k-wds`` stores it.

``--data-dir`` is a folder of shards (a split's shards carry its name as a ``-``/``_``-delimited
token: ``imagenet1k-train-0000.tar``), a brace pattern (``/data/train-{0000..1023}.tar``) or an
``_info.json`` (timm's schema: ``splits: {name: {num_samples, filenames, shard_lengths}}``); a
folder holding an ``_info.json`` uses it. Sample counts come from ``_info.json`` (checked
against each shard as it is read: a shard holding more or fewer is one line) or from a
one-time scan of the tar headers (no image decoded), cached under the cache folder.

Every sample once per epoch across the job: the epoch's shard order is a seeded permutation,
whose samples form one stream of N; rank r reads a contiguous range of it (train: ceil(N/W)
samples, the last rank's range wrapping to the stream's start, so fewer than W repeats; eval: the
ranges partition the stream exactly). The range is shuffled in windows of whole batches (at least
``shuffle`` samples) and batch k is made by DataLoader worker ``k % workers``, which reads the
raw bytes of its batches' samples shard by shard, seeking past the rest: the DataLoader's
round-robin then yields the batches in order, the same batches for any worker count, and a
mid-epoch resume starts at its batch without reading what came before. (timm's wds reader hands
whole shards to ranks x workers, which repeats or drops samples when the counts do not divide
evenly; this split is exact, so it is lgvit's own.) Workers decode and crop as the streaming
folder does (:mod:`lgvit.data.stream`); the rest of the recipe runs on the main process.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import hashlib
import io
import json
import math
import os
import random
import re
import tarfile
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lgvit.core.atomic import atomic_write_json
from lgvit.core.constants import (
    DECODE_WORKERS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_BAD_FRACTION,
    MAX_CLASSES,
)
from lgvit.core.errors import LgvitError, refuse_deep_nesting
from lgvit.data.decode import load_rgb
from lgvit.data.device_decode import EncodedBatch, device_decoder
from lgvit.data.loader import AugmentConfig, BatchRecipe, RecipeLoader, _seed
from lgvit.data.segmentation import own_generator
from lgvit.data.splits import DatasetSplits
from lgvit.data.transforms import random_resized_box, resize_center_crop

__all__ = ["DEFAULT_INPUT_KEY", "DEFAULT_TARGET_KEY", "SHUFFLE", "ShardLoader", "ShardSet",
           "wds_split", "wds_splits"]  # fmt: skip

DEFAULT_INPUT_KEY = "jpg;png;webp"  # timm's: the first of these a sample has is its image
DEFAULT_TARGET_KEY = "cls"
TRAIN_SPLIT, VAL_SPLITS = "train", ("validation", "val")  # timm's names; "val" as fallback
SHUFFLE = 1000  # samples per shuffle window (rounded up to whole batches)
INFO_NAMES = ("_info.json", "info.json")
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, skipped as it does
_SCAN_VERSION = 2  # of the cached header scans' format (2: labels ASCII digits only)


def _webdataset() -> Any:
    try:
        import webdataset
    except ImportError:
        raise LgvitError(
            "--data wds needs the webdataset package: pip install 'lgvit[wds]'"
        ) from None
    return webdataset


# ---------------------------------------------------------------------------- one split


@dataclass
class ShardSet:
    """One split of shards: their paths, sample counts (in the split's canonical order: shard
    by shard, each in its tar order), class names and the sample keys read."""

    split: str
    paths: list[str]
    counts: list[int]
    classes: list[str]
    input_keys: tuple[str, ...] = tuple(DEFAULT_INPUT_KEY.split(";"))
    target_key: str = DEFAULT_TARGET_KEY
    counts_from: str | None = None  # the _info.json that declared the counts (None: scanned)
    classes_inferred: bool = False  # 0..K-1 from the largest label seen, not declared
    _keys: dict[int, list[str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.offsets = [0, *np.cumsum(self.counts).tolist()]

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """Sample ``i`` of the split as (shard, position in the shard)."""
        s = bisect.bisect_right(self.offsets, i) - 1
        return s, i - self.offsets[s]

    def name(self, i: int) -> str:
        """Sample ``i``'s name in results: its shard's file name and its ``__key__`` (the
        shard's headers read once, when a name is first asked for)."""
        s, j = self.locate(i)
        if s not in self._keys:
            try:
                self._keys[s] = _keys(self.paths[s])
            except (OSError, tarfile.TarError):  # named by position; reading it counts it bad
                self._keys[s] = []
        keys = self._keys[s]
        return f"{os.path.basename(self.paths[s])}/{keys[j] if j < len(keys) else j}"


def _samples(tar: tarfile.TarFile) -> Iterator[tuple[str, list[tarfile.TarInfo]]]:
    """A shard's samples as (``__key__``, member headers), grouped as webdataset groups them
    (consecutive members sharing the name before the first dot of their base name). Read from
    the headers alone, seeking past the data (stdlib tarfile in random-access mode: skipping
    a sample costs one header read, where webdataset's tar stream reads every byte)."""
    base_plus_ext = _webdataset().tariterators.base_plus_ext
    key, members = None, []
    while (m := _next(tar)) is not None:
        tar.members = []  # headers are not kept: an ImageNet shard has thousands
        if not m.isreg() or _META.match(m.name):
            continue
        prefix, _ = base_plus_ext(m.name)
        if prefix is None:
            continue
        if prefix != key and members:
            yield key, members
            members = []
        key = prefix
        members.append(m)
    if members:
        yield key, members


def _next(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    """The next member's header; None at the end, or where a truncated shard ends (its last
    sample then fails when read, and the samples missing are counted bad by the loader)."""
    try:
        return tar.next()
    except tarfile.ReadError:
        return None


def _keys(path: str) -> list[str]:
    with tarfile.open(path, "r:") as tar:
        return [key for key, _ in _samples(tar)]


def _ext(member: tarfile.TarInfo) -> str:
    return member.name.rpartition("/")[2].partition(".")[2].lower()


# ---------------------------------------------------------------------------- finding shards


def _tokens(name: str) -> list[str]:
    return re.split(r"[-_./]", os.path.basename(name).lower())


def _find_info(data_dir: str) -> Path | None:
    p = Path(data_dir)
    if p.suffix == ".json":
        if not p.is_file():
            raise LgvitError(f"{p} does not exist")
        return p
    if p.is_dir():
        return next((p / n for n in INFO_NAMES if (p / n).is_file()), None)
    return None


def _read_info(path: Path) -> dict:
    """``_info.json``, every field lgvit reads checked for type and shape (one line naming the
    file and the key): a malformed index must not surface as a traceback or a wrong count."""
    try:
        with refuse_deep_nesting(str(path), "JSON"):
            info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LgvitError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(info, dict) or not isinstance(info.get("splits"), dict):
        raise LgvitError(f"{path} has no 'splits' mapping (timm's _info.json schema)")
    for name, entry in info["splits"].items():
        _check_split_entry(entry, path, f"splits.{name}")
    _info_classes(info, path)
    return info


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_split_entry(entry: Any, path: Path, key: str) -> None:
    """A split's ``filenames`` (non-empty, names), ``shard_lengths`` (one count per file) and
    ``num_samples`` (their sum), each optional count null or absent."""
    if not isinstance(entry, dict):
        raise LgvitError(f"{path}: {key} is {type(entry).__name__}, not a mapping with filenames")
    names = entry.get("filenames")
    if not isinstance(names, list) or not names:
        raise LgvitError(f"{path}: {key}.filenames must be a non-empty list of shard file names, "
                         f"not {json.dumps(names)[:40]}")  # fmt: skip
    bad = next((i for i, n in enumerate(names) if not isinstance(n, str) or not n), None)
    if bad is not None:
        raise LgvitError(f"{path}: {key}.filenames[{bad}] is {json.dumps(names[bad])[:40]}, "
                         "not a file name")  # fmt: skip
    lengths, total = entry.get("shard_lengths"), entry.get("num_samples")
    if lengths is not None and (not isinstance(lengths, list) or len(lengths) != len(names)
                                or not all(map(_count, lengths))):  # fmt: skip
        raise LgvitError(f"{path}: {key}.shard_lengths must be one non-negative integer per "
                         f"file ({len(names)}), not {json.dumps(lengths)[:40]}")  # fmt: skip
    if total is not None and not _count(total):
        raise LgvitError(f"{path}: {key}.num_samples must be a non-negative integer, not "
                         f"{json.dumps(total)[:40]}")  # fmt: skip
    if lengths is not None and total is not None and sum(lengths) != total:
        raise LgvitError(f"{path}: {key}.num_samples is {total} but its shard_lengths sum to "
                         f"{sum(lengths)}")  # fmt: skip


def _info_split(
    info: dict, path: Path, split: str
) -> tuple[list[str], list[int] | None, int | None]:
    """A split's shard paths and, when given, their sample counts and total (checked on
    reading) from ``_info.json``."""
    entry = info["splits"].get(split)
    if entry is None:
        raise LgvitError(f"{path} has no split {split!r} with filenames (its splits: "
                         f"{', '.join(map(str, info['splits'])) or 'none'})")  # fmt: skip
    paths = [str(path.parent / f) for f in entry["filenames"]]
    return paths, entry.get("shard_lengths"), entry.get("num_samples")


def _info_classes(info: dict, path: Path) -> list[str] | None:
    """Class names from ``_info.json`` (a list of names, or a count) when it has them: names
    unique, at most ``MAX_CLASSES``, agreeing with ``num_classes`` when both are given."""
    found = None
    for key in ("classes", "class_names", "label_names"):
        names = info.get(key)
        if names is None:
            continue
        if not isinstance(names, list) or len(names) > MAX_CLASSES:
            raise LgvitError(f"{path}: {key} must be a list of at most {MAX_CLASSES:,} class "
                             f"names, not {json.dumps(names)[:40]}")  # fmt: skip
        bad = next((i for i, n in enumerate(names) if not isinstance(n, str)), None)
        if bad is not None:
            raise LgvitError(f"{path}: {key}[{bad}] is {json.dumps(names[bad])[:40]}, not a "
                             "class name")  # fmt: skip
        twice = next((n for n, c in Counter(names).items() if c > 1), None)
        if twice is not None:  # two classes of one name: results could not tell them apart
            raise LgvitError(f"{path}: {key} names {twice!r} twice")
        found = found or names or None
    n = info.get("num_classes")
    if n is not None and (not _count(n) or not 0 < n <= MAX_CLASSES):
        raise LgvitError(f"{path}: num_classes must be an integer in [1, {MAX_CLASSES:,}] "
                         f"(core.constants.MAX_CLASSES), not {json.dumps(n)[:40]}")  # fmt: skip
    if n is not None and found is not None and n != len(found):
        raise LgvitError(f"{path}: num_classes is {n} but its class names are {len(found)}")
    return found if found is not None else [str(i) for i in range(n)] if n else None


def _pattern_for(pattern: str, split: str, named: str) -> str:
    """The pattern of ``split`` from one of the ``named`` split: that token replaced."""
    if split in _tokens(pattern):
        return pattern
    if named not in _tokens(pattern):
        raise LgvitError(f"cannot tell the {split} shards from {pattern}: it has no {named!r} "
                         f"token to replace by {split!r}; give their pattern")  # fmt: skip
    head, sep, tail = pattern.rpartition("/")
    swapped = re.sub(rf"(?<![^-_.]){re.escape(named)}(?![^-_.])", split, tail)
    return head + sep + swapped


def _split_paths(data_dir: str, split: str, named: str = TRAIN_SPLIT) -> list[str]:
    """The shards of ``split`` in a folder (the split's name a token of the file name) or a
    brace pattern (given for ``named``'s shards, ``split``'s found by replacing the name)."""
    if "{" in data_dir or data_dir.endswith(".tar"):
        pattern = _pattern_for(data_dir, split, named)
        paths = list(_webdataset().shardlists.expand_urls(pattern))
        missing = next((p for p in paths if not os.path.isfile(p)), None)
        if missing is None:
            return paths
        if pattern == data_dir:
            raise LgvitError(f"shard {missing} (of {pattern}) does not exist")
        # Another split rarely numbers its shards as these (ImageNet: 1024 train shards, 64
        # validation ones; a lone shard's path names one): its files with any numbering.
        loose = _any_numbering(pattern)
        found = sorted(glob.glob(loose))
        if not found:
            raise LgvitError(f"no {split!r} shards for {data_dir}: neither {pattern} nor any "
                             f"{loose} exists")  # fmt: skip
        return found
    folder = Path(data_dir)
    if not folder.is_dir():
        raise LgvitError(f"{data_dir} is neither a folder of .tar shards, a brace pattern nor "
                         "an _info.json")  # fmt: skip
    paths = sorted(str(p) for p in folder.glob("*.tar") if split in _tokens(p.stem))
    if not paths:
        raise LgvitError(f"{data_dir} has no .tar shards of the {split!r} split (file names "
                         f"with a -{split}- token, e.g. imagenet-{split}-0000.tar)")  # fmt: skip
    return paths


def _any_numbering(pattern: str) -> str:
    """A glob of ``pattern``'s file name with its brace ranges and numbers (whole tokens)
    free: ``ds-validation-0001.tar`` -> ``ds-validation-*.tar``."""
    head, sep, tail = pattern.rpartition("/")
    tail = re.sub(r"\{[^}]*\}", "*", glob.escape(tail))
    tail = re.sub(r"(?<![^-_.])[0-9]+(?![^-_.])", "*", tail)
    return glob.escape(head) + sep + tail


def _val_name(data_dir: str, info: dict | None, given: str | None) -> str:
    """The evaluation split: ``given``, else "validation", or "val" where the shards are
    called that (a pattern's or a shard's own split, else its sibling shards')."""
    if given:
        return given
    if info is not None:
        return next((n for n in VAL_SPLITS if n in info["splits"]), VAL_SPLITS[0])
    folder = Path(data_dir)
    if not folder.is_dir():
        named = next((n for n in VAL_SPLITS if n in _tokens(data_dir)), None)
        if named is not None:
            return named
        folder = folder.parent
    stems = [_tokens(p.stem) for p in folder.glob("*.tar")]
    return next((n for n in VAL_SPLITS if any(n in t for t in stems)), VAL_SPLITS[0])


# ---------------------------------------------------------------------------- counting


def _scan_shard(path: str, target_key: str) -> tuple[int, int]:
    """(samples, largest label) of one shard, from its headers and its tiny label members."""
    count, top = 0, -1
    try:
        with tarfile.open(path, "r:") as tar:
            for _, members in _samples(tar):
                count += 1
                label = next((m for m in members if _ext(m) == target_key), None)
                value = _parse_label(_read(tar, label)) if label is not None else None
                top = max(top, value if value is not None else -1)
    except (OSError, tarfile.TarError) as e:
        raise LgvitError(f"shard {path} is not a readable tar file ({e})") from None
    return count, top


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes | None:
    """A label member's bytes (a label is a few digits: a large member is no label)."""
    try:
        f = tar.extractfile(member) if member.size < 64 else None
        return f.read() if f is not None else None
    except (OSError, tarfile.TarError):  # a truncated shard: counted when it is read
        return None


_LABEL = re.compile(rb"\s*([0-9]+)\s*")  # ASCII digits: int() also reads "1_0" and "٢"


def _parse_label(data: bytes | None) -> int | None:
    found = _LABEL.fullmatch(data) if data is not None else None
    return int(found[1]) if found else None


def _scanned(paths: list[str], target_key: str, cache: Path) -> list[tuple[int, int]]:
    """(samples, largest label) per shard, scanned once and cached (atomically) under the
    shards' paths, sizes and modification times: a changed shard is scanned again."""
    stats = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            raise LgvitError(f"shard {p} does not exist") from None
        stats.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    ident = json.dumps([_SCAN_VERSION, target_key, stats]).encode()
    where = cache / "wds" / f"scan-{hashlib.sha256(ident).hexdigest()[:24]}.json"
    try:
        found = json.loads(where.read_text())
        if len(found) == len(paths):
            return [tuple(x) for x in found]
    except (OSError, ValueError, TypeError):
        pass  # not scanned yet (or a damaged cache entry): scan
    result = [_scan_shard(p, target_key) for p in paths]
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(where, result)
    except OSError:
        pass  # a read-only cache only costs the scan next time
    return result


def _shard_set(
    split: str, paths: list[str], lengths: list[int] | None, classes: list[str] | None,
    input_key: str | None, target_key: str | None, cache: Path, info: Path | None = None,
    total: int | None = None,
) -> ShardSet:  # fmt: skip
    """A split whose missing counts (or class count) come from the cached header scan;
    ``info``'s ``total`` (``num_samples``) must then agree with it."""
    missing = next((p for p in paths if not os.path.isfile(p)), None)
    if missing is not None:
        raise LgvitError(f"shard {missing} of the {split!r} split does not exist")
    keys = tuple(k.strip().lower() for k in (input_key or DEFAULT_INPUT_KEY).split(";"))
    if not all(keys):
        raise LgvitError(f"input key {input_key!r} has an empty name (e.g. 'jpg;png;webp')")
    target = (target_key or DEFAULT_TARGET_KEY).strip().lower()
    declared, inferred = lengths is not None, classes is None
    if lengths is None or classes is None:
        scan = _scanned(paths, target, cache)
        lengths = lengths if lengths is not None else [n for n, _ in scan]
        if classes is None:  # no names anywhere: 0..K-1, K the largest label + 1
            classes = _label_classes(split, paths, [t for _, t in scan], target)
    if total is not None and sum(lengths) != total:
        raise LgvitError(f"{info}: splits.{split}.num_samples is {total} but its shards hold "
                         f"{sum(lengths)} samples")  # fmt: skip
    if sum(lengths) == 0:
        raise LgvitError(f"the {split!r} shards ({paths[0]}, ...) hold no samples")
    return ShardSet(split, paths, list(lengths), classes, keys, target,
                    counts_from=str(info) if declared else None,
                    classes_inferred=inferred)  # fmt: skip


def _label_classes(split: str, paths: list[str], tops: list[int], target: str) -> list[str]:
    """Classes 0..K-1, K the largest label + 1, at most ``MAX_CLASSES``: one stray label
    must not size the head (the sample that holds it named)."""
    top = max(tops, default=-1)
    if top < 0:
        raise LgvitError(f"no sample of the {split!r} shards has an integer {target!r} label "
                         "(--target-key)")  # fmt: skip
    if top >= MAX_CLASSES:
        path = paths[tops.index(top)]
        key, label = _huge_label(path, target)
        text = str(label) if len(str(label)) <= 20 else f"{str(label)[:20]}..."
        raise LgvitError(f"{path} sample {key}: label {text} implies more than {MAX_CLASSES:,} "
                         "classes, lgvit's bound (core.constants.MAX_CLASSES); is it a "
                         "stray label?")  # fmt: skip
    return [str(i) for i in range(top + 1)]


def _huge_label(path: str, target: str) -> tuple[str, int]:
    """The first sample of a shard whose label reaches ``MAX_CLASSES`` (its key, its label)."""
    with tarfile.open(path, "r:") as tar:
        for key, members in _samples(tar):
            label = next((m for m in members if _ext(m) == target), None)
            value = _parse_label(_read(tar, label)) if label is not None else None
            if value is not None and value >= MAX_CLASSES:
                return key, value
    return "?", MAX_CLASSES  # the shard changed since it was scanned


def _load_split(
    data_dir: str, split: str, classes: list[str] | None, input_key: str | None,
    target_key: str | None, cache: Path, named: str = TRAIN_SPLIT,
) -> ShardSet:  # fmt: skip
    info_path = _find_info(data_dir)
    if info_path is None:
        paths = _split_paths(data_dir, split, named)
        return _shard_set(split, paths, None, classes, input_key, target_key, cache)
    info = _read_info(info_path)
    paths, lengths, total = _info_split(info, info_path, split)
    classes = classes or _info_classes(info, info_path)
    return _shard_set(split, paths, lengths, classes, input_key, target_key, cache, info_path,
                      total)  # fmt: skip


def wds_splits(
    data_dir: str, *, train_split: str | None, val_split: str | None, input_key: str | None,
    target_key: str | None, cache: Path, max_bad_fraction: float,
) -> DatasetSplits:  # fmt: skip
    """The train and validation splits of shards (``None``: timm's names and keys). Without
    class names in ``_info.json`` the classes are 0..K-1, K the train split's largest label
    + 1 (a one-time scan of its label members, cached). ``max_bad_fraction`` applies when the
    loaders read (samples are not decoded here)."""
    _webdataset()
    info_path = _find_info(data_dir)
    info = _read_info(info_path) if info_path is not None else None
    name = train_split or TRAIN_SPLIT  # a pattern gives the train shards; the others swap it
    train = _load_split(data_dir, name, None, input_key, target_key, cache, name)
    val = _val_name(data_dir, info, val_split)
    test = _load_split(data_dir, val, train.classes, input_key, target_key, cache, name)
    return DatasetSplits(train=train, test=test, name="wds", mean=IMAGENET_MEAN,
                         std=IMAGENET_STD, skipped=[])  # fmt: skip


def wds_split(
    data_dir: str, *, split: str | None, input_key: str | None, target_key: str | None,
    cache: Path,
) -> ShardSet:  # fmt: skip
    """The split ``lgvit eval`` reads (default: the validation split). A brace pattern is
    read as given when it names no other split."""
    _webdataset()
    info_path = _find_info(data_dir)
    info = _read_info(info_path) if info_path is not None else None
    name = _val_name(data_dir, info, split)
    if info is None and "{" in data_dir and not {name, TRAIN_SPLIT} & set(_tokens(data_dir)):
        paths = list(_webdataset().shardlists.expand_urls(data_dir))  # no split named: as given
        return _shard_set(name, paths, None, None, input_key, target_key, cache)
    return _load_split(data_dir, name, None, input_key, target_key, cache)


# ---------------------------------------------------------------------------- reading an epoch


class _Bad(Exception):
    """A sample that cannot be used; its message says why."""


class _Mismatch(Exception):
    """A shard that holds ``args[0]`` samples, not the count the split declares: the run
    stops (counting on it would drop or invent samples)."""


@dataclass
class _Epoch:
    """What a worker needs to make the rank's batches of one epoch (picklable)."""

    paths: list[str]
    counts: list[int]
    order: list[int]  # the epoch's shard order
    start: int  # the rank's first position in the epoch's stream
    bounds: list[tuple[int, int]]  # the rank's batches, as positions in its range
    window: int  # shuffle window (whole batches); 0: no shuffle (eval)
    first: int  # the first batch of this pass (a mid-epoch resume starts later)
    seed: int
    num_classes: int
    input_keys: tuple[str, ...]
    target_key: str
    crop: AugmentConfig
    train: bool
    split: str = TRAIN_SPLIT
    counts_from: str | None = None  # ShardSet.counts_from
    encoded: bool = False  # JPEGs left encoded for a device decoder (lgvit.data.device_decode)

    def __post_init__(self) -> None:
        counts = [self.counts[s] for s in self.order]
        self.cum = [0, *np.cumsum(counts).tolist()]  # stream offsets of the ordered shards
        self.offsets = [0, *np.cumsum(self.counts).tolist()]  # canonical ones

    def where(self, u: int) -> tuple[int, int]:
        """Rank position ``u`` as (shard, sample in it); the stream wraps (train padding)."""
        t = (self.start + u) % self.cum[-1]
        i = bisect.bisect_right(self.cum, t) - 1
        return self.order[i], t - self.cum[i]

    def batch_positions(self, k: int) -> list[int]:
        """Rank positions of batch ``k``: its slice of its window's seeded permutation."""
        s, e = self.bounds[k]
        if not self.window:
            return list(range(s, e))
        w0 = (s // self.window) * self.window
        w1 = min(w0 + self.window, self.bounds[-1][1])
        perm = np.random.default_rng(_seed(self.seed, 7, w0)).permutation(w1 - w0) + w0
        return perm[s - w0 : e - w0].tolist()

    def mismatch(self, shard: int, found: int) -> str:
        """The line for shard ``shard`` holding ``found`` samples, not its count."""
        n, path = self.counts[shard], self.paths[shard]
        if self.counts_from is None:
            return (f"shard {path} holds {found} samples but its cached header scan counted "
                    f"{n}: was it rewritten during the run?")  # fmt: skip
        return (f"shard {path} holds {found} samples but {self.counts_from} declares {n} "
                f"(splits.{self.split}.shard_lengths[{shard}]); correct it, or remove the "
                "_info.json to have the shards counted")  # fmt: skip


def _clean_end(tar: tarfile.TarFile) -> bool:
    """Whether a shard's members ended where its file does (at the end-of-archive zeros, or
    at the file's end between members); a truncated shard breaks off in a header or data."""
    f = tar.fileobj
    if f is None or tar.offset > f.seek(0, os.SEEK_END):
        return False
    f.seek(tar.offset)
    return not f.read(2 * tarfile.BLOCKSIZE).strip(b"\0")


class _Cursor:
    """Reads samples of shards forward, seeking past the data of the samples it skips."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.tar: tarfile.TarFile | None = None
        self.it: Iterator | None = None
        self.next = 0  # index in the shard of the sample self.it yields next
        self.error: str | None = None

    def _open(self, path: str) -> None:
        self.close()
        self.path, self.next, self.error = path, 0, None
        try:
            self.tar = tarfile.open(path, "r:")
            self.it = _samples(self.tar)
        except (OSError, tarfile.TarError) as e:
            self.error = f"unreadable shard ({e})"

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
        self.tar = self.it = None

    def read(self, path: str, j: int, count: int, wanted: set[str]) -> tuple[str, dict[str, bytes]]:
        """Sample ``j`` of shard ``path`` (``count`` samples, as the split counts them): its
        key and the bytes of its ``wanted`` members. A shard whose samples end cleanly
        before ``count``, or go on after it, raises :class:`_Mismatch`."""
        if path != self.path or j < self.next:
            self._open(path)
        if self.error:
            raise _Bad(self.error)
        assert self.it is not None and self.tar is not None
        while self.next <= j:
            got = next(self.it, None)
            if got is None:
                if _clean_end(self.tar):
                    raise _Mismatch(self.next)
                self.error = f"truncated shard: the file breaks off after {self.next} of its "
                self.error += f"{count} samples"
                raise _Bad(self.error)
            self.next += 1
        key, members = got
        try:
            data = {_ext(m): self.tar.extractfile(m).read() for m in members if _ext(m) in wanted}
        except (OSError, tarfile.TarError) as e:
            raise _Bad(f"truncated shard ({e})") from None
        if j == count - 1 and next(self.it, None) is not None:  # the last counted: is it?
            raise _Mismatch(count + 1 + sum(1 for _ in self.it))
        return key, data


class _ShardBatches(IterableDataset):
    """Worker ``w`` of ``n`` makes batches ``first + w``, ``first + w + n``, ... as
    ``(x uint8 (B, 3, S, S), usable, canonical indices, labels, first bad or None, None)``
    (``encoded``: and the :class:`EncodedBatch`'s payload of the JPEGs left to the device);
    the DataLoader's round-robin over the workers then yields them in the rank's order. A
    shard that disagrees with its count ends the worker's batches with ``(..., its line)``:
    an exception would reach the main process as a multi-line traceback."""

    def __init__(self, epoch: _Epoch) -> None:
        self.e = epoch

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        cursor, raw = _Cursor(), {}
        try:
            for k in range(self.e.first + w, len(self.e.bounds), n):
                positions = self.e.batch_positions(k)
                if any(u not in raw for u in positions):  # this batch's window, read once
                    raw = self._read_window(k, w, n, cursor)
                yield self._batch(k, [raw.pop(u) for u in positions])
        except _Mismatch as m:
            yield None, None, None, None, None, str(m)
        finally:
            cursor.close()

    def _read_window(self, k: int, w: int, n: int, cursor: _Cursor) -> dict[int, Any]:
        """The raw samples of this worker's batches in batch ``k``'s window, read in stream
        order (a window's worth of bytes held: the shuffle buffer)."""
        e = self.e
        mine = [k]
        if e.window:
            w_end = (e.bounds[k][0] // e.window + 1) * e.window
            mine = [j for j in range(k, len(e.bounds), n) if e.bounds[j][0] < w_end]
        positions = sorted(u for j in mine for u in e.batch_positions(j))
        wanted = {*e.input_keys, e.target_key}
        raw: dict[int, Any] = {}
        for u in positions:
            shard, j = e.where(u)
            try:
                key, data = cursor.read(e.paths[shard], j, e.counts[shard], wanted)
                raw[u] = (shard, j, key, data)
            except _Bad as bad:  # no key read: named by its position
                raw[u] = (shard, j, f"#{j}", bad)
            except _Mismatch as m:
                raise _Mismatch(e.mismatch(shard, m.args[0])) from None
        return raw

    def _batch(self, k: int, samples: list) -> tuple:
        e, s = self.e, self.e.crop.img_size
        rng = random.Random(_seed(e.seed, 8, k))  # per batch: any worker, any resume point
        b = len(samples)
        x = torch.zeros((b, 3, s, s), dtype=torch.uint8)
        ok = torch.zeros(b, dtype=torch.bool)
        idx, y = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        first_bad = None
        enc = EncodedBatch(b) if e.encoded else None
        for i, (shard, j, key, data) in enumerate(samples):
            idx[i] = e.offsets[shard] + j
            try:
                y[i], image = self._sample(data, rng, enc, i)
                if image is not None:  # else the device decodes it
                    x[i] = image
                ok[i] = True
            except _Bad as bad:
                first_bad = first_bad or f"{e.paths[shard]} sample {key}: {bad}"
        done = (x, ok, idx, y, first_bad, None)
        return done if enc is None else (*done, enc.payload())

    def _box(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        """Train: the random-resized crop's box; eval: the whole image (center-cropped later)."""
        a = self.e.crop
        if not self.e.train:
            return 0, 0, width, height
        return random_resized_box(width, height, a.rrc_scale, a.rrc_ratio, rng)

    def _sample(
        self, data: dict[str, bytes] | _Bad, rng: random.Random, enc: EncodedBatch | None, i: int
    ) -> tuple:
        """(label, uint8 (3, S, S) image) of one sample's raw members (image None: a JPEG
        left to the device decoder, sample ``i`` of ``enc``)."""
        if isinstance(data, _Bad):
            raise data
        e, a = self.e, self.e.crop
        image = next((data[k] for k in e.input_keys if k in data), None)
        if image is None:
            raise _Bad(f"no image ({';'.join(e.input_keys)}; --input-key)")
        if e.target_key not in data:
            raise _Bad(f"no {e.target_key!r} label (--target-key)")
        label = _parse_label(data[e.target_key])
        if label is None:
            raise _Bad(f"label {data[e.target_key][:20]!r} is not an integer")
        if not 0 <= label < e.num_classes:
            raise _Bad(f"label {label} is outside [0, {e.num_classes})")
        try:  # upright (EXIF orientation); too large or too thin images refused
            if enc is not None and enc.add(i, image, lambda w, h: self._box(w, h, rng)):
                return label, None
            rgb = load_rgb(io.BytesIO(image))  # type: ignore[arg-type]
        except Exception:  # PIL raises many types for damaged data
            raise _Bad("undecodable image") from None
        if e.train:  # the streaming folder's crop (lgvit.data.stream)
            box = self._box(*rgb.size, rng)
            rgb = rgb.resize((a.img_size,) * 2, Image.Resampling.BICUBIC, box=box)
            return label, torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        chw = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        return label, resize_center_crop(chw[None], a.img_size, a.crop_pct, a.interpolation)[0]


class ShardLoader(RecipeLoader):
    """Batches of a :class:`ShardSet`: samples split over ranks and DataLoader workers as the
    module says, decoded and cropped by ``workers`` processes, then the rest of
    :class:`BatchRecipe`'s recipe (seeds, augmentation stream, batches) on the main process.
    Bad samples (undecodable, without their image or label, a label outside the classes,
    missing from a truncated shard) are left out of their batch and counted per pass (``seen``,
    ``bad``, ``first_bad``); more than ``max_bad_fraction`` of the samples read (of at least
    100) is one line. Train: the rank's last partial batch is dropped (fewer than
    ``batch_size`` samples per rank per epoch). ``shuffle``: samples per shuffle window.
    ``decode_device``: JPEGs decoded and cropped there (:mod:`lgvit.data.device_decode`). The
    engine's loader contract (:class:`lgvit.data.protocol.TrainLoader`)."""

    def __init__(
        self,
        split: ShardSet,
        batch_size: int,
        *,
        workers: int = DECODE_WORKERS,
        max_bad_fraction: float = MAX_BAD_FRACTION,
        aug: AugmentConfig | None = None,
        shuffle: int = SHUFFLE,
        decode_device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        repeats = kwargs.pop("repeated_aug", 1)
        if repeats > 1 and kwargs.get("train") and kwargs.get("rank", 0) == 0:
            # Shards are read as a stream, each sample once an epoch (docs/training.md): a
            # config's DeiT recipe (imagenet_lit_ti) still runs, said once.
            warnings.warn(f"repeated_aug={repeats} (DeiT's RASampler) does not apply to --data "
                          "wds: ignored, each sample is read once an epoch",
                          stacklevel=2)  # fmt: skip
        self.crop = aug if aug is not None else AugmentConfig()
        after_crop = dataclasses.replace(self.crop, train_crop="none")
        self.recipe = BatchRecipe(len(split), None, batch_size, aug=after_crop, **kwargs)
        self.split, self.workers, self.shuffle = split, workers, shuffle
        self.max_bad_fraction = max_bad_fraction
        self.seen = self.bad = 0
        self.first_bad: str | None = None
        self.decoder = device_decoder(decode_device, self.crop, self.recipe.train)

    def rank_range(self) -> tuple[int, int]:
        """(first stream position, samples) of this rank's range in the epoch's stream."""
        r, n = self.recipe, len(self.split)
        if r.train:  # ceil(N/W) each, the last range wrapping: fewer than W repeats
            return r.rank * math.ceil(n / r.world_size), r.num_samples
        q, rem = divmod(n, r.world_size)  # eval: an exact partition
        return r.rank * q + min(r.rank, rem), q + (r.rank < rem)

    def epoch_plan(self, first: int = 0) -> _Epoch:
        """This rank's batches of the current epoch, from batch ``first`` on."""
        r, sp = self.recipe, self.split
        order = list(range(len(sp.paths)))
        if r.train:  # the same shard order on every rank
            order = np.random.default_rng(_seed(r.seed, r.epoch, 0, 5)).permutation(order)
        start, n = self.rank_range()
        bounds = r.batch_bounds(n)
        window = r.batch_size * math.ceil(self.shuffle / r.batch_size) if r.train else 0
        return _Epoch(
            sp.paths, sp.counts, [int(s) for s in order], start, bounds, window, first,
            _seed(r.seed, r.epoch, r.rank, 6), r.num_classes, sp.input_keys, sp.target_key,
            self.crop, r.train, sp.split, sp.counts_from, self.decoder is not None,
        )  # fmt: skip

    def _count_bad(self, ok: torch.Tensor, first_bad: str | None) -> None:
        self.seen += len(ok)
        bad_now = int((~ok).sum())
        if bad_now:
            self.bad += bad_now
            self.first_bad = self.first_bad or first_bad
            if self.bad > self.max_bad_fraction * max(self.seen, 100):
                raise LgvitError(
                    f"{self.bad} of the first {self.seen} samples of the {self.split.split!r} "
                    f"shards are bad (more than {self.max_bad_fraction:.0%}), e.g. "
                    f"{self.first_bad}"
                )

    def _on_device(
        self, x: torch.Tensor, ok: torch.Tensor, idx: torch.Tensor, first_bad: str | None,
        payload: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, str | None]:  # fmt: skip
        """The batch's JPEGs decoded by the device decoder; one it cannot read is bad."""
        assert self.decoder is not None
        was = ok.clone()
        x, ok = self.decoder.finish(x, ok, payload)
        lost = (was & ~ok).nonzero().flatten().tolist()
        if lost and first_bad is None:
            first_bad = f"{self.split.name(int(idx[lost[0]]))}: undecodable image"
        return self.recipe.to_device(x), ok, first_bad

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        r = self.recipe
        start, gen = r.pass_start()  # mid-epoch resume: its batches are neither read nor made
        self.seen = self.bad = 0
        self.first_bad = None
        batches = DataLoader(
            _ShardBatches(self.epoch_plan(start)), batch_size=None, num_workers=self.workers,
            pin_memory=r.device.type == "cuda", generator=own_generator(),
        )  # fmt: skip
        if self.decoder is not None:
            self.decoder.cpu_decoded = 0
        for x, ok, idx, y, first_bad, mismatch, *encoded in batches:
            if mismatch is not None:
                raise LgvitError(mismatch)
            if encoded:
                x, ok, first_bad = self._on_device(x, ok, idx, first_bad, encoded[0])
            self._count_bad(ok, first_bad)
            batch = self.recipe_batch(x, y, idx, ok, gen)
            if batch is not None:
                yield batch
