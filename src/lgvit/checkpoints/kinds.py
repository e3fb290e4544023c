"""The kinds of checkpoint lgvit writes and reads: one per task, and for detection one per
detector, with what a checkpoint of each kind that lacks a record key means.

These are facts of the checkpoint format (the record's ``task`` and ``detector`` keys and their
defaults), so they live below the model zoo and the tasks: :mod:`lgvit.checkpoints.record` validates
a header with them, and :mod:`lgvit.tasks` adds each task's code (its package, datasets, commands)
to its kind. Plain data and the data layer's class lists only: nothing here builds a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lgvit.core.errors import LgvitError
from lgvit.data.coco import COCO_CAT_IDS, COCO_CLASSES, DET_SCALE
from lgvit.data.segmentation import ADE20K_CLASSES, SEG_CROP, SEG_SCALE

__all__ = [
    "DEFAULT_TASK",
    "DETECTOR_SPECS",
    "DETECTORS",
    "DetectorSpec",
    "detector_spec",
    "TASK_KINDS",
    "TASK_NAMES",
    "TaskKind",
    "task_kind",
]


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
class TaskKind:
    """The checkpoints of one task.

    Attributes:
        name: what ``--task``, a config's ``task`` and a checkpoint's record say.
        dense: a per-pixel or per-object task on a pyramid backbone (a segmenter or detector,
            not a classifier: ``lgvit export``/``viz`` refuse its checkpoints).
        needs_cat_ids: its checkpoints map each class to a COCO category id (``cat_ids``).
        record_defaults: what the record keys a checkpoint of it lacks mean, given the ones it
            has (:meth:`lgvit.checkpoints.record.CheckpointRecord.defaults`).
    """

    name: str
    dense: bool
    record_defaults: Callable[[dict[str, Any]], dict[str, Any]]
    needs_cat_ids: bool = False


DEFAULT_TASK = "classification"  # a classification checkpoint has never named its task
TASK_KINDS: dict[str, TaskKind] = {
    k.name: k
    for k in (
        TaskKind("classification", dense=False, record_defaults=_classification_defaults),
        TaskKind("segmentation", dense=True, record_defaults=_segmentation_defaults),
        TaskKind("detection", dense=True, record_defaults=_detection_defaults,
                 needs_cat_ids=True),
    )
}  # fmt: skip
TASK_NAMES = tuple(TASK_KINDS)


@dataclass(frozen=True)
class DetectorSpec:
    """One detector a detection checkpoint's ``detector`` names: what the data, training,
    evaluation and the authors' mmdet files switch on.

    Attributes:
        name: the ``detector`` key's value (``--detector``).
        masks: it predicts instance masks (the data must carry them; COCOeval's segm too).
        label_offset: torchvision's label of the first object class (1 where its background
            class 0 comes first: two-stage detectors).
        two_stage: an RPN and RoI heads (the authors' mmdet keys ``rpn_head``/``roi_head``),
            not one dense head (``bbox_head``).
        swin_unnormed: pyramid levels the authors' Swin-skeleton backbones leave without a
            norm in this detector's configs (LIT-S's stride-4 map in Mask R-CNN).
    """

    name: str
    masks: bool
    label_offset: int
    two_stage: bool
    swin_unnormed: tuple[int, ...] = ()


DETECTOR_SPECS: dict[str, DetectorSpec] = {
    s.name: s
    for s in (
        DetectorSpec("retinanet", masks=False, label_offset=0, two_stage=False),
        DetectorSpec("maskrcnn", masks=True, label_offset=1, two_stage=True,
                     swin_unnormed=(0,)),
    )
}  # fmt: skip
DETECTORS = tuple(DETECTOR_SPECS)  # a detection checkpoint's ``detector``


def detector_spec(name: str) -> DetectorSpec:
    """The spec of detector ``name``; an unknown one is one line naming the known ones."""
    try:
        return DETECTOR_SPECS[name]
    except (KeyError, TypeError):
        raise LgvitError(f"detector {name!r} is not one of {', '.join(DETECTORS)}") from None


def task_kind(name: str) -> TaskKind:
    """The kind of task ``name``; an unknown one is one line naming the known ones."""
    try:
        return TASK_KINDS[name]
    except (KeyError, TypeError):
        raise LgvitError(f"unknown task {name!r}: one of {', '.join(TASK_NAMES)}") from None
