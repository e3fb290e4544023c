"""Object detection and instance segmentation: torchvision's RetinaNet and Mask R-CNN on a
pyramid backbone with LIT's COCO 1x recipe (``train``), COCOeval (``evaluate``), ``lgvit eval``
/ ``predict`` (``cli``)."""

from __future__ import annotations

from typing import Any


def build_released(w: Any) -> Any:
    """The released file's detector on its backbone, with its class count."""
    from lgvit.dense.detection import create_detector

    return create_detector(w.detector, w.model, w.num_classes)
