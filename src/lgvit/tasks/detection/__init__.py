"""Object detection and instance segmentation: torchvision's RetinaNet and Mask R-CNN on a
pyramid backbone with LIT's COCO 1x recipe (``train``), COCOeval (``evaluate``), ``lgvit eval``
/ ``predict`` (``cli``)."""

from __future__ import annotations

from typing import Any

# The LIT authors' mmdet configs: images resized to (long, short) sides 1333 x 800. Their
# released files carry no header, so a checkpoint without the key means it.
DET_SCALE = (1333, 800)


def build_released(w: Any) -> Any:
    """The released file's detector on its backbone, with its class count."""
    from lgvit.dense.detection import create_detector

    return create_detector(w.detector, w.model, w.num_classes)


def record_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The authors' image scale (the backbone built for its short side), and COCO's classes
    and category ids where the header names none."""
    scale = values.get("det_scale", DET_SCALE)
    out: dict[str, Any] = {"det_scale": DET_SCALE, "img_size": min(scale)}
    if "classes" not in values:
        from lgvit.data.coco import COCO_CAT_IDS, COCO_CLASSES

        out.update(classes=tuple(COCO_CLASSES), cat_ids=tuple(COCO_CAT_IDS))
    return out
