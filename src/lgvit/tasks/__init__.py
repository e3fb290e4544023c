"""The tasks lgvit trains, evaluates and predicts with, one folder each, and their registry.

Each task is a package ``lgvit.tasks.<name>`` with the same three modules:

- ``train``: the task on the shared run (:class:`lgvit.engine.Task`), made by ``make_task()``;
- ``evaluate``: its metrics and the loading of its checkpoints (never imports the engine);
- ``cli``: ``lgvit eval`` / ``lgvit predict`` of its checkpoints: ``EVAL_FLAGS`` and
  ``PREDICT_FLAGS`` (the flags it reads beyond the common ones), ``run_eval(args)`` and
  ``run_predict(args)``;

and, in its ``__init__``, ``record_defaults(values)`` (what a checkpoint of the task that lacks
a record key means: :class:`lgvit.record.CheckpointRecord`) and ``build_released(w)`` (the
model a released file of the task loads into).

:data:`TASKS` below is the only list of them: the engine's ``train()``, the config's validation,
the checkpoint record and the command line all read it, and nothing outside ``lgvit.tasks``
names a task. Adding a task is one folder plus one :class:`TaskSpec` line. A task's modules are
imported on first use, so ``lgvit eval`` and ``predict`` never import training; which task a
command runs is :mod:`lgvit.tasks.dispatch`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType
from typing import Any

from lgvit.data.coco import COCO_DATASETS
from lgvit.data.datasets import DATASETS
from lgvit.data.segmentation import SEG_DATASETS
from lgvit.errors import LgvitError
from lgvit.models.weights import MODEL_WORDS


@dataclass(frozen=True)
class TaskSpec:
    """One task: its name, where its code lives and the facts the rest of lgvit asks about it.

    Attributes:
        name: what ``--task``, a config's ``task`` and a checkpoint's record say.
        package: the task's package (``train``, ``evaluate``, ``cli`` modules in it).
        datasets: the ``--data`` names it trains and evaluates on.
        eval_tta: the test-time augmentations its evaluation has (``eval_tta``, ``--tta``).
        dense: a per-pixel or per-object task on a pyramid backbone (a segmenter or detector,
            not a classifier: ``lgvit export``/``viz`` refuse its checkpoints).
        head: the words for its model in messages ("a classifier", "Semantic FPN").
        implied_by: eval/predict flags whose presence says this task when neither the
            checkpoint nor ``--data`` does (``--detector``: an mmdet ``.pth``).
        needs_cat_ids: its checkpoints map each class to a COCO category id (``cat_ids``).
    """

    name: str
    package: str
    datasets: tuple[str, ...]
    eval_tta: tuple[str, ...]
    dense: bool
    head: str
    implied_by: tuple[str, ...] = field(default=())
    needs_cat_ids: bool = False

    def module(self, part: str) -> ModuleType:
        """``train``, ``evaluate`` or ``cli`` of this task (imported on first use)."""
        return import_module(f"{self.package}.{part}")

    def make_task(self) -> Any:
        """The task object the engine runs (an :class:`lgvit.engine.Task`)."""
        return self.module("train").make_task()

    def build_released(self, w: Any) -> Any:
        """The model the released weights ``w`` load into, as registered (random weights)."""
        return import_module(self.package).build_released(w)

    def record_defaults(self, values: dict[str, Any]) -> dict[str, Any]:
        """What the record keys a checkpoint of this task lacks mean (given the ones it has)."""
        return import_module(self.package).record_defaults(values)


DEFAULT_TASK = "classification"
TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("classification", "lgvit.tasks.classification", DATASETS,
                 ("none", "flip", "flip-translate"), dense=False,
                 head=MODEL_WORDS["classification"]),
        TaskSpec("segmentation", "lgvit.tasks.segmentation", SEG_DATASETS, ("none", "flip"),
                 dense=True, head=MODEL_WORDS["segmentation"]),
        TaskSpec("detection", "lgvit.tasks.detection", COCO_DATASETS, ("none",), dense=True,
                 head=MODEL_WORDS["detection"], implied_by=("detector",), needs_cat_ids=True),
    )
}  # fmt: skip
TASK_NAMES = tuple(TASKS)
ALL_DATASETS = tuple(dict.fromkeys(d for t in TASKS.values() for d in t.datasets))


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; an unknown one is one line naming the known ones."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise LgvitError(f"unknown task {name!r}: one of {', '.join(TASK_NAMES)}") from None


def task_of_data(data: str | None) -> TaskSpec | None:
    """The task whose datasets include ``data`` (None: no dataset, or one no task reads)."""
    return next((t for t in TASKS.values() if data in t.datasets), None)
