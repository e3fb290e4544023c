"""What each task lgvit trains, evaluates and predicts with is: one record per task, facts only.

A task's name, whether it is dense, what a checkpoint of it lacking a record key means, the
datasets it reads, its test-time augmentations, its words in messages, the call that loads its
released weights and the eval/predict flags that imply it. Whatever asks about a task reads
this table: the checkpoint record (:mod:`lgvit.checkpoints.record`), the released weights
(:mod:`lgvit.models.weights`), the run's config, the command line and the tasks' code
(:mod:`lgvit.tasks`, which links each name to its code by plain imports). It sits above the data
layer (its datasets and class lists) and below the checkpoints: nothing here builds a model or
imports a task's code. Adding a task is one :class:`TaskSpec` line here and one folder in
:mod:`lgvit.tasks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lgvit.core.errors import LgvitError
from lgvit.data.coco import COCO_CAT_IDS, COCO_CLASSES, COCO_DATASETS, DET_SCALE
from lgvit.data.datasets import DATASETS
from lgvit.data.segmentation import ADE20K_CLASSES, SEG_CROP, SEG_DATASETS, SEG_SCALE

__all__ = ["ALL_DATASETS", "CLASSIFICATION", "DEFAULT_TASK", "TASKS", "TASK_NAMES", "TTA_MODES",
           "TaskSpec", "get_task", "task_of_data"]  # fmt: skip

# Every test-time augmentation an evaluation has (``eval_tta``, ``--tta``); each task takes the
# first few: segmentation has no translated pass, detection none.
TTA_MODES = ("none", "flip", "flip-translate")


def _classification_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """lgvit's first classification checkpoints named no architecture keys: none."""
    return {"model_kwargs": {}}


def _segmentation_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The LIT authors' test scale and crop (their released files carry no header), and
    ADE20K's classes where the header names none."""
    out: dict[str, Any] = {"img_size": SEG_CROP, "seg_scale": SEG_SCALE}
    if "classes" not in values:
        out["classes"] = tuple(ADE20K_CLASSES)
    return out


def _detection_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The LIT authors' image scale (the backbone built for its short side), and COCO's classes
    and category ids where the header names none."""
    scale = values.get("det_scale", DET_SCALE)
    out: dict[str, Any] = {"det_scale": DET_SCALE, "img_size": min(scale)}
    if "classes" not in values:
        out.update(classes=tuple(COCO_CLASSES), cat_ids=tuple(COCO_CAT_IDS))
    return out


@dataclass(frozen=True)
class TaskSpec:
    """One task: what the rest of lgvit asks about it.

    Attributes:
        name: what ``--task``, a config's ``task`` and a checkpoint's record say.
        dense: a per-pixel or per-object task on a pyramid backbone (a segmenter or detector,
            not a classifier: ``lgvit export``/``viz`` refuse its checkpoints).
        datasets: the ``--data`` names it trains and evaluates on.
        eval_tta: the test-time augmentations its evaluation has (``eval_tta``, ``--tta``).
        model_words: the words for its model in messages ("a classifier", "Semantic FPN").
        loads_released: the call that builds its model with released weights, for messages
            (``{name}``, ``{model}``, ``{detector}``: the released entry's).
        record_defaults: what the record keys a checkpoint of it lacks mean, given the ones it
            has (:meth:`lgvit.checkpoints.record.CheckpointRecord.defaults`).
        needs_cat_ids: its checkpoints map each class to a COCO category id (``cat_ids``).
        implied_by: eval/predict flags whose presence says this task when neither the
            checkpoint nor ``--data`` does (``--detector``: an mmdet ``.pth``).
    """

    name: str
    dense: bool
    datasets: tuple[str, ...]
    eval_tta: tuple[str, ...]
    model_words: str
    loads_released: str
    record_defaults: Callable[[dict[str, Any]], dict[str, Any]]
    needs_cat_ids: bool = False
    implied_by: tuple[str, ...] = ()


CLASSIFICATION = "classification"  # the task create_model's models serve
DEFAULT_TASK = CLASSIFICATION  # a classification checkpoint has never named its task
TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec(CLASSIFICATION, dense=False, datasets=DATASETS, eval_tta=TTA_MODES,
                 model_words="a classifier",
                 loads_released="create_model('{name}', pretrained=True)",
                 record_defaults=_classification_defaults),
        TaskSpec("segmentation", dense=True, datasets=SEG_DATASETS, eval_tta=TTA_MODES[:2],
                 model_words="Semantic FPN",
                 loads_released="create_segmenter('{model}', pretrained=True)",
                 record_defaults=_segmentation_defaults),
        TaskSpec("detection", dense=True, datasets=COCO_DATASETS, eval_tta=TTA_MODES[:1],
                 model_words="a detector",
                 loads_released="create_detector('{detector}', '{model}', pretrained=True)",
                 record_defaults=_detection_defaults, needs_cat_ids=True,
                 implied_by=("detector",)),
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
