"""The LIT authors' detection checkpoints (mmdetection 2.11 layout) -> torchvision's RetinaNet
and Mask R-CNN built by :func:`lgvit.dense.detection.create_detector`.

Names: ``backbone.*`` through :func:`lgvit.dense.mmseg.backbone_to_lgvit`; the FPN's
``lateral_convs.i.conv`` / ``fpn_convs.i.conv`` -> torchvision's ``inner_blocks.i.0`` /
``layer_blocks.i.0``, RetinaNet's extra ``fpn_convs.3`` / ``.4`` -> ``extra_blocks.p6`` / ``p7``;
RetinaNet's ``cls_convs.i.conv`` / ``reg_convs.i.conv`` / ``retina_cls`` / ``retina_reg`` ->
``classification_head.conv.i.0`` / ``regression_head.conv.i.0`` / ``cls_logits`` / ``bbox_reg``
(anchors and classes in the same channel order: anchor-major, ratio-major anchors); the RPN's
``rpn_conv`` / ``rpn_cls`` / ``rpn_reg`` -> ``conv.0.0`` / ``cls_logits`` / ``bbox_pred``; the
box head's ``shared_fcs.0`` / ``.1`` -> ``fc6`` / ``fc7``; the mask head's ``convs.i.conv`` ->
``mask_head.i.0``, ``upsample`` -> ``conv5_mask``, ``conv_logits`` -> ``mask_fcn_logits``.

Conventions: mmdet's box classifier puts background last (81 outputs), torchvision's first;
mmdet regresses boxes for the 80 object classes only, torchvision for 81 (the background rows
are zeros, never used); the mask logits likewise get a zero background row. The box coders are
the same (mmdet's stds 0.1/0.1/0.2/0.2 are torchvision's weights 10/10/5/5). RetinaNet's sigmoid
classifier has no background class on either side.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lgvit.checkpoints.kinds import detector_spec
from lgvit.dense.mmseg import backbone_to_lgvit, unwrap_mmseg

_NECK = (
    (r"^neck\.lateral_convs\.(\d+)\.conv\.", r"backbone.fpn.inner_blocks.\1.0."),
    (r"^neck\.fpn_convs\.([0-2])\.conv\.", r"backbone.fpn.layer_blocks.\1.0."),
)
_RETINA = (
    (r"^neck\.fpn_convs\.3\.conv\.", "backbone.fpn.extra_blocks.p6."),
    (r"^neck\.fpn_convs\.4\.conv\.", "backbone.fpn.extra_blocks.p7."),
    (r"^bbox_head\.cls_convs\.(\d+)\.conv\.", r"head.classification_head.conv.\1.0."),
    (r"^bbox_head\.reg_convs\.(\d+)\.conv\.", r"head.regression_head.conv.\1.0."),
    (r"^bbox_head\.retina_cls\.", "head.classification_head.cls_logits."),
    (r"^bbox_head\.retina_reg\.", "head.regression_head.bbox_reg."),
)
_MASKRCNN = (
    (r"^neck\.fpn_convs\.3\.conv\.", "backbone.fpn.layer_blocks.3.0."),
    (r"^rpn_head\.rpn_conv\.", "rpn.head.conv.0.0."),
    (r"^rpn_head\.rpn_cls\.", "rpn.head.cls_logits."),
    (r"^rpn_head\.rpn_reg\.", "rpn.head.bbox_pred."),
    (r"^roi_head\.bbox_head\.shared_fcs\.0\.", "roi_heads.box_head.fc6."),
    (r"^roi_head\.bbox_head\.shared_fcs\.1\.", "roi_heads.box_head.fc7."),
    (r"^roi_head\.bbox_head\.fc_cls\.", "roi_heads.box_predictor.cls_score."),
    (r"^roi_head\.bbox_head\.fc_reg\.", "roi_heads.box_predictor.bbox_pred."),
    (r"^roi_head\.mask_head\.convs\.(\d+)\.conv\.", r"roi_heads.mask_head.\1.0."),
    (r"^roi_head\.mask_head\.upsample\.", "roi_heads.mask_predictor.conv5_mask."),
    (r"^roi_head\.mask_head\.conv_logits\.", "roi_heads.mask_predictor.mask_fcn_logits."),
)


def is_mmdet_layout(state_dict: dict[str, Any]) -> bool:
    return any(k.startswith(("bbox_head.retina_cls.", "roi_head.bbox_head.")) for k in state_dict)


def _background_first(key: str, value: torch.Tensor) -> torch.Tensor:
    """mmdet's class rows -> torchvision's: background moved from last to first (the box
    classifier), or a zero background row added (box regression: 4 rows; mask logits: 1)."""
    if key.startswith("roi_heads.box_predictor.cls_score."):
        return torch.cat([value[-1:], value[:-1]])
    if key.startswith("roi_heads.box_predictor.bbox_pred."):
        return torch.cat([value.new_zeros((4, *value.shape[1:])), value])
    if key.startswith("roi_heads.mask_predictor.mask_fcn_logits."):
        return torch.cat([value.new_zeros((1, *value.shape[1:])), value])
    return value


def mmdet_to_lgvit(
    state_dict: dict[str, torch.Tensor], model: torch.nn.Module, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Map an mmdet 2.11 RetinaNet / Mask R-CNN state dict onto ``model``."""
    state_dict = unwrap_mmseg(state_dict)
    body = model.backbone.body
    sub = {k.removeprefix("backbone."): v for k, v in state_dict.items()
           if k.startswith("backbone.")}  # fmt: skip
    if body.norms is not None:  # norms of levels the detector does not use (RetinaNet's C2)
        sub = {k: v for k, v in sub.items() if not (m := re.match(r"norm(\d+)\.", k))
               or int(m[1]) in body.out_indices}  # fmt: skip
    out = {f"backbone.body.{k}": v for k, v in backbone_to_lgvit(sub, body, source).items()}
    rules = [*_NECK, *(_MASKRCNN if detector_spec(model.detector).two_stage else _RETINA)]
    for key, value in state_dict.items():
        if key.startswith("backbone."):
            continue
        for pattern, repl in rules:
            key = re.sub(pattern, repl, key)
        out[key] = _background_first(key, value)
    return out


# The layout for :func:`lgvit.models.loading.adapt_state_dict`: its test and its mapping.
MMDET_LAYOUT = (is_mmdet_layout, mmdet_to_lgvit)
