"""The tasks lgvit trains, evaluates and predicts with, one folder each, and their registry.

Each task is a package ``lgvit.tasks.<name>`` with the same three modules:

- ``train``: the task on the shared run (:class:`lgvit.run.engine.Task`), made by ``make_task()``;
- ``evaluate``: its metrics and the loading of its checkpoints (never imports the engine);
- ``cli``: ``lgvit eval`` / ``lgvit predict`` of its checkpoints: ``EVAL_FLAGS`` and
  ``PREDICT_FLAGS`` (the flags it reads beyond the common ones), ``run_eval(args)`` and
  ``run_predict(args)``;

and, in its ``__init__``, ``build_released(w)`` (the model a released file of the task loads
into). What its checkpoints are -- its name, dense or not, the record keys they may lack -- is
its :class:`lgvit.checkpoints.kinds.TaskKind`, below the model zoo, since the checkpoint
record reads it.
 :data:`TASKS` below is the only list of the tasks' code: the engine's ``train()``, the config's
validation and the command line read it, and nothing outside ``lgvit.tasks`` and
:mod:`lgvit.checkpoints.kinds` names a task. Adding a task is one folder, one :class:`TaskKind` and
one :class:`TaskSpec` line. A task's modules are imported on first use, so ``lgvit eval`` and
``predict`` never import training; which task a command runs is :mod:`lgvit.tasks.dispatch`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any

from lgvit.checkpoints.kinds import DEFAULT_TASK, TASK_KINDS, TASK_NAMES, TaskKind, task_kind
from lgvit.data.coco import COCO_DATASETS
from lgvit.data.datasets import DATASETS
from lgvit.data.segmentation import SEG_DATASETS
from lgvit.models.weights import MODEL_WORDS

__all__ = ["ALL_DATASETS", "DEFAULT_TASK", "TASKS", "TASK_NAMES", "TTA_MODES", "TaskSpec",
           "get_task", "task_of_data"]  # fmt: skip

# Every test-time augmentation an evaluation has (``eval_tta``, ``--tta``); each task takes the
# first few: segmentation has no translated pass, detection none.
TTA_MODES = ("none", "flip", "flip-translate")


@dataclass(frozen=True)
class TaskSpec:
    """One task: its kind of checkpoint, where its code lives and the facts the rest of lgvit
    asks about it.

    Attributes:
        kind: its checkpoints (:class:`lgvit.checkpoints.kinds.TaskKind`: name, dense,
            record defaults).
        datasets: the ``--data`` names it trains and evaluates on.
        eval_tta: the test-time augmentations its evaluation has (``eval_tta``, ``--tta``).
        head: the words for its model in messages ("a classifier", "Semantic FPN").
        implied_by: eval/predict flags whose presence says this task when neither the
            checkpoint nor ``--data`` does (``--detector``: an mmdet ``.pth``).
    """

    kind: TaskKind
    datasets: tuple[str, ...]
    eval_tta: tuple[str, ...]
    head: str
    implied_by: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        """What ``--task``, a config's ``task`` and a checkpoint's record say."""
        return self.kind.name

    @property
    def dense(self) -> bool:
        """A segmenter or detector on a pyramid backbone, not a classifier."""
        return self.kind.dense

    @property
    def needs_cat_ids(self) -> bool:
        return self.kind.needs_cat_ids

    @property
    def package(self) -> str:
        """The task's package (``train``, ``evaluate``, ``cli`` modules in it)."""
        return f"lgvit.tasks.{self.name}"

    def module(self, part: str) -> ModuleType:
        """``train``, ``evaluate`` or ``cli`` of this task (imported on first use)."""
        return import_module(f"{self.package}.{part}")

    def make_task(self) -> Any:
        """The task object the engine runs (an :class:`lgvit.run.engine.Task`)."""
        return self.module("train").make_task()

    def build_released(self, w: Any) -> Any:
        """The model the released weights ``w`` load into, as registered (random weights)."""
        return import_module(self.package).build_released(w)


def _spec(name: str, datasets: tuple[str, ...], eval_tta: tuple[str, ...], **kw: Any) -> TaskSpec:
    return TaskSpec(TASK_KINDS[name], datasets, eval_tta, head=MODEL_WORDS[name], **kw)


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _spec("classification", DATASETS, TTA_MODES),
        _spec("segmentation", SEG_DATASETS, TTA_MODES[:2]),
        _spec("detection", COCO_DATASETS, TTA_MODES[:1], implied_by=("detector",)),
    )
}
ALL_DATASETS = tuple(dict.fromkeys(d for t in TASKS.values() for d in t.datasets))


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; an unknown one is one line naming the known ones."""
    return TASKS[task_kind(name).name]


def task_of_data(data: str | None) -> TaskSpec | None:
    """The task whose datasets include ``data`` (None: no dataset, or one no task reads)."""
    return next((t for t in TASKS.values() if data in t.datasets), None)
