"""A run folder's layout: the name of every file and folder a training run keeps in its ``--out``.

They are spelled here and nowhere else (``tests/test_layout.py`` checks it): the engine, a
resume's checks, the kept epochs, the loggers, the checkpoint files' messages, ``lgvit average``
and ``lgvit plot`` ask :class:`RunLayout`::

    <out>/last.safetensors  last.state.pt    the resumable checkpoint (weights + training state)
    <out>/best.safetensors  best.state.pt    the best evaluated epoch's checkpoint
    <out>/last_ema.safetensors               the EMA's weights alone
    <out>/kept/kept.json  kept/epoch-0012.safetensors  kept/epoch-0012_ema.safetensors
                                             the N best epochs (``keep_best``) and their index
    <out>/metrics.jsonl  train.log  config.yaml   the run's record, its log, its config
    <out>/tensorboard/  wandb_id             the loggers' (``log_to``)
    <out>/.lock                              held while a run owns the folder

A checkpoint is two files sharing a stem (:func:`checkpoint_paths`), wherever it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

WEIGHTS_SUFFIX = ".safetensors"  # a checkpoint's weights: <stem>.safetensors
STATE_SUFFIX = ".state.pt"  # its training state: <stem>.state.pt


def _strip_known_suffix(path: str | Path) -> Path:
    path = Path(path)
    for suffix in (WEIGHTS_SUFFIX, STATE_SUFFIX):
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.with_name(path.name[: -len(suffix)])
    return path


def checkpoint_paths(stem: str | Path) -> tuple[Path, Path]:
    """``(weights_path, state_path)`` of a checkpoint stem (a trailing suffix is tolerated)."""
    stem = _strip_known_suffix(stem)
    # String concatenation, not with_suffix: stems like "ep1.5" contain dots.
    return stem.with_name(stem.name + WEIGHTS_SUFFIX), stem.with_name(stem.name + STATE_SUFFIX)


@dataclass(frozen=True, init=False)
class RunLayout:
    """Where the files of the run in folder ``out`` are: paths only, nothing read or made. The
    names alone (``RunLayout.LAST``...) are class attributes, for a folder not yet known."""

    out: Path

    LAST: ClassVar[str] = "last"  # the resumable checkpoint's stem (``--resume auto``)
    BEST: ClassVar[str] = "best"
    LAST_EMA: ClassVar[str] = "last_ema"  # weights only: no training state
    CHECKPOINTS: ClassVar[tuple[str, ...]] = (LAST, BEST, LAST_EMA)  # the stems the engine saves
    KEPT: ClassVar[str] = "kept"  # keep_best's folder
    KEPT_INDEX: ClassVar[str] = "kept.json"
    KEPT_PREFIX: ClassVar[str] = "epoch-"
    KEPT_GLOB: ClassVar[str] = f"{KEPT_PREFIX}*{WEIGHTS_SUFFIX}"
    METRICS: ClassVar[str] = "metrics.jsonl"  # one JSON line an epoch: the run's record
    LOG: ClassVar[str] = "train.log"
    CONFIG: ClassVar[str] = "config.yaml"
    TENSORBOARD: ClassVar[str] = "tensorboard"  # a folder: tensorboard --logdir runs/
    WANDB_ID: ClassVar[str] = "wandb_id"  # the W&B run a resume continues
    LOCK: ClassVar[str] = ".lock"

    def __init__(self, out: str | Path) -> None:
        object.__setattr__(self, "out", Path(out))

    @property
    def last(self) -> Path:
        """The resumable checkpoint's stem."""
        return self.out / self.LAST

    @property
    def last_weights(self) -> Path:
        """The resumable checkpoint's weights file: there once the run saved."""
        return checkpoint_paths(self.last)[0]

    @property
    def best(self) -> Path:
        """The best evaluated epoch's checkpoint stem."""
        return self.out / self.BEST

    @property
    def last_ema(self) -> Path:
        """The EMA's weights alone (a file, not a pair)."""
        return checkpoint_paths(self.out / self.LAST_EMA)[0]

    @property
    def kept_dir(self) -> Path:
        return self.out / self.KEPT

    @property
    def kept_index(self) -> Path:
        return self.kept_dir / self.KEPT_INDEX

    @classmethod
    def kept_name(cls, epoch: int, ema: bool) -> str:
        """A kept epoch's weights file in ``kept/`` (``epoch`` from 0, named from 1)."""
        return f"{cls.KEPT_PREFIX}{epoch + 1:04d}{'_ema' if ema else ''}{WEIGHTS_SUFFIX}"

    @property
    def metrics(self) -> Path:
        return self.out / self.METRICS

    @property
    def log(self) -> Path:
        return self.out / self.LOG

    @property
    def config(self) -> Path:
        return self.out / self.CONFIG

    @property
    def records(self) -> tuple[Path, ...]:
        """The files a run keeps beside its checkpoints: a folder without them holds copies."""
        return self.metrics, self.log, self.config

    @property
    def files(self) -> tuple[Path, ...]:
        """What a run writes in its folder (besides the kept epochs), ``last``'s weights first."""
        last, best = checkpoint_paths(self.last), checkpoint_paths(self.best)
        return (*last, *best, self.last_ema, *self.records)

    @property
    def tensorboard(self) -> Path:
        return self.out / self.TENSORBOARD

    @property
    def wandb_id(self) -> Path:
        return self.out / self.WANDB_ID

    @property
    def lock(self) -> Path:
        return self.out / self.LOCK
