"""Semantic segmentation: Semantic FPN on a pyramid backbone with LIT's ADE20K recipe
(``train``), mIoU/mAcc/aAcc (``evaluate``), ``lgvit eval`` / ``predict`` (``cli``)."""

from __future__ import annotations

from typing import Any


def build_released(w: Any) -> Any:
    """Semantic FPN on the released file's backbone, with its class count."""
    from lgvit.dense.semfpn import create_segmenter

    return create_segmenter(w.model, w.num_classes)
