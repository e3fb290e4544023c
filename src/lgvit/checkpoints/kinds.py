"""The kinds of detection checkpoint lgvit writes and reads: one per detector, with what the
data, training, evaluation and the authors' mmdet files switch on.

These are facts of the checkpoint format (the record's ``detector`` key), so they live below
the model zoo and the tasks: :mod:`lgvit.checkpoints.record` validates a header with them. What
each task is (its checkpoints' ``task`` key among the rest) is :mod:`lgvit.task_table`'s.
Plain data only: nothing here builds a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from lgvit.core.errors import LgvitError

__all__ = ["DETECTOR_SPECS", "DETECTORS", "DetectorSpec", "detector_spec"]


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
