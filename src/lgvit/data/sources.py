"""The ``--data`` sources of classification: one :class:`DataSource` record each, in one table.

A record says what lgvit needs to know of a source: its name, what its ``--data-dir`` holds
(or that it needs none), its option keys and their defaults, whether it is read while
iterating, how its train/test splits and its evaluation split open, the loader it brings, and
where its class names come from. The dataset factory (:mod:`lgvit.data.datasets`), the loaders
(:func:`lgvit.data.stream.make_loader`), the run config's validation, the command line's flags
and a refused resume's message read :data:`DATA_SOURCES`; a new source is its module (reading
its splits, and its loader if lgvit's do not fit) and one record here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lgvit.core.constants import MAX_BAD_FRACTION
from lgvit.core.errors import LgvitError
from lgvit.data import hfds, wds
from lgvit.data.builtin import load_digits, load_synthetic
from lgvit.data.cifar import load_cifar
from lgvit.data.imagefolder import load_class_map, load_imagefolder, load_test_folder
from lgvit.data.splits import DatasetSplits

__all__ = ["DATASETS", "DATA_SOURCES", "OPTION_KEYS", "OPTION_SOURCES", "DataSource", "Request",
           "option_help", "own_loader", "sources_taking"]  # fmt: skip


@dataclass(frozen=True)
class Request:
    """What the dataset factory was asked; each source reads the fields it needs. ``options``:
    the source's option keys (training: ``input_key``, ``target_key``, ``train_split``,
    ``val_split``; evaluation: ``input_key``, ``target_key``, ``split``), None where unset."""

    name: str
    data_dir: str | None
    cache: Path
    img_size: int | None = None
    download: bool = True
    max_bad_fraction: float = MAX_BAD_FRACTION
    synthetic_size: tuple[int, int] = (512, 128)
    num_classes: int = 10
    seed: int = 0
    stream: bool | None = None
    stream_above: int = 0
    class_map: str | None = None
    options: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class DataSource:
    """One ``--data`` source of classification.

    Attributes:
        name: what ``--data`` and a config's ``data`` say.
        open_train: its train and test splits (a :class:`DatasetSplits`) for a :class:`Request`.
        open_test: the split ``lgvit eval`` reads (None: ``open_train``'s test split).
        folder: what its ``--data-dir`` holds ("": none needed: downloaded or built in).
        eval_folder: what eval's ``--data-dir`` holds, where that differs.
        options: its option keys (the config's, eval's flags), each with the source's default.
        streamed: read while iterating, never decoded into memory.
        class_map: eval reads a class map (``--class-map``) for it.
        split_type, loader: the loader it brings for its splits of ``split_type`` (None:
            lgvit's, by the split: a decoded one batched in memory, else read sample by sample).
        classes_from: where its class names come from (a resume refused for them says it).
    """

    name: str
    open_train: Callable[[Request], DatasetSplits]
    open_test: Callable[[Request], Any] | None = None
    folder: str = ""
    eval_folder: str = ""
    options: Mapping[str, str] = field(default_factory=dict)
    streamed: bool = False
    class_map: bool = False
    split_type: type | None = None
    loader: Callable[..., Any] | None = None
    classes_from: str = ""

    @property
    def needs_dir(self) -> bool:
        """It has no default location: ``data_dir`` (``--data-dir``) must name it."""
        return bool(self.folder)


def _folder(r: Request, flag: str = "--data-dir", what: str = "") -> str:
    """``--data-dir`` of a source that needs one: when absent, one line saying what it holds."""
    if r.data_dir is None:
        source = DATA_SOURCES[r.name]
        raise LgvitError(f"the {source.name} dataset needs {flag}: {what or source.folder}")
    return r.data_dir


def _source_dir(r: Request) -> str:
    """Shards' or a Hugging Face dataset's ``--data-dir``; a brace pattern is kept as given."""
    data_dir = _folder(r)
    return str(Path(data_dir).expanduser()) if "{" not in data_dir else data_dir


def _cifar(r: Request) -> DatasetSplits:
    return load_cifar(r.name, r.data_dir, r.cache, r.download)


def _imagefolder(r: Request) -> DatasetSplits:
    root = Path(_folder(r, "data_dir (--data-dir)")).expanduser()
    return load_imagefolder(root, r.img_size, r.cache, r.max_bad_fraction, r.stream,
                            stream_above=r.stream_above)  # fmt: skip


def _imagefolder_test(r: Request) -> Any:
    root = Path(_folder(r, what=DATA_SOURCES[r.name].eval_folder)).expanduser()
    mapping = load_class_map(Path(r.class_map).expanduser()) if r.class_map is not None else None
    return load_test_folder(root, r.cache, mapping)


def _wds(r: Request) -> DatasetSplits:
    return wds.wds_splits(_source_dir(r), cache=r.cache, max_bad_fraction=r.max_bad_fraction,
                          **r.options)  # fmt: skip


def _wds_test(r: Request) -> Any:
    return wds.wds_split(_source_dir(r), cache=r.cache, **r.options)


def _hfds(r: Request) -> DatasetSplits:
    return hfds.hfds_splits(_source_dir(r), max_bad_fraction=r.max_bad_fraction, **r.options)


def _hfds_test(r: Request) -> Any:
    return hfds.hfds_split(_source_dir(r), **r.options)


def _digits(r: Request) -> DatasetSplits:
    return load_digits(r.img_size or 32)


def _synthetic(r: Request) -> DatasetSplits:
    return load_synthetic(r.img_size or 32, r.synthetic_size, r.num_classes, r.seed)


def _keys(module: Any) -> dict[str, str]:
    """A streamed source's option keys and its module's defaults (timm's names)."""
    return {"input_key": module.DEFAULT_INPUT_KEY, "target_key": module.DEFAULT_TARGET_KEY,
            "train_split": module.TRAIN_SPLIT, "val_split": module.VAL_SPLITS[0]}  # fmt: skip


# The sources, in the order --data lists them.
DATA_SOURCES: dict[str, DataSource] = {
    s.name: s
    for s in (
        DataSource("cifar10", _cifar),
        DataSource("cifar100", _cifar),
        DataSource(
            "imagefolder", _imagefolder, _imagefolder_test,
            folder="a folder with train/ and val/ (or test/), or a .tar.gz of one",
            eval_folder="a folder with val/ (or test/), or a folder of class folders, or a "
            ".tar.gz of one",
            class_map=True, classes_from="class folders now sort as timm's, 2 before 10",
        ),
        DataSource(
            "wds", _wds, _wds_test,
            folder="a folder of .tar shards, a brace pattern (train-{0000..1023}.tar) or an "
            "_info.json",
            options=_keys(wds), streamed=True, split_type=wds.ShardSet, loader=wds.ShardLoader,
            classes_from="the shards' classes are _info.json's names, else 0..K-1 for their "
            "largest label K-1",
        ),
        DataSource(
            "hfds", _hfds, _hfds_test,
            folder="a dataset saved with save_to_disk, or a folder of parquet or arrow files "
            "named by split",
            options=_keys(hfds), streamed=True,
            classes_from="the classes are the label column's ClassLabel names, else 0..K-1 "
            "for its largest label K-1",
        ),
        DataSource("digits", _digits),
        DataSource("synthetic", _synthetic),
    )
}  # fmt: skip
# The names load_dataset accepts: the one list the config and the command line check against.
DATASETS = tuple(DATA_SOURCES)
# Every source option key (the run config's), in the records' order.
OPTION_KEYS = tuple(dict.fromkeys(k for s in DATA_SOURCES.values() for k in s.options))
# The sources taking options (eval's --input-key, --target-key and --split too).
OPTION_SOURCES = tuple(s.name for s in DATA_SOURCES.values() if s.options)


def sources_taking(key: str) -> tuple[str, ...]:
    """The sources with the option ``key``, in the table's order."""
    return tuple(s.name for s in DATA_SOURCES.values() if key in s.options)


def option_help(key: str, words: str, default: str = "") -> str:
    """A flag's help from the table: the sources taking ``key``, ``words``, then their
    defaults after ``default`` (``wds/hfds: label key or column (cls, label)``)."""
    names = sources_taking(key)
    defaults = ", ".join(dict.fromkeys(DATA_SOURCES[n].options[key] for n in names))
    return f"{'/'.join(names)}: {words} ({default}{defaults})"


def own_loader(split: Any) -> Callable[..., Any] | None:
    """The loader a source brings for ``split`` (WebDataset shards': ``ShardLoader``); None:
    lgvit's (:func:`lgvit.data.stream.make_loader`)."""
    for s in DATA_SOURCES.values():
        if s.split_type is not None and isinstance(split, s.split_type):
            return s.loader
    return None
