"""Semantic segmentation: Semantic FPN on a pyramid backbone with LIT's ADE20K recipe
(``train``), mIoU/mAcc/aAcc (``evaluate``), ``lgvit eval`` / ``predict`` (``cli``)."""

from __future__ import annotations

from typing import Any

# The LIT authors' mmseg configs: ADE20K's test scale (long, short) and training crop. Their
# released files carry no header, so a checkpoint without these keys means them.
SEG_SCALE = (2048, 512)
SEG_CROP = 512


def build_released(w: Any) -> Any:
    """Semantic FPN on the released file's backbone, with its class count."""
    from lgvit.dense.semfpn import create_segmenter

    return create_segmenter(w.model, w.num_classes)


def record_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The authors' test scale and crop, and ADE20K's classes where the header names none."""
    out: dict[str, Any] = {"img_size": SEG_CROP, "seg_scale": SEG_SCALE}
    if "classes" not in values:
        from lgvit.data.segmentation import ADE20K_CLASSES

        out["classes"] = tuple(ADE20K_CLASSES)
    return out
