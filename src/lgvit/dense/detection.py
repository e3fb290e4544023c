"""RetinaNet and Mask R-CNN on any pyramid model: torchvision's detectors, configured as LIT's
mmdetection 2.11 configs (``detection/configs/lit``, Tables 5-6).

What follows their configs (and how torchvision is set to it):

* RetinaNet: FPN (256) over strides 8/16/32 (mmdet ``start_level=1``) plus P6 from a 3x3
  stride-2 conv on the backbone's last map and P7 from one on P6 without a ReLU between
  (``add_extra_convs='on_input'``, ``relu_before_extra_convs=False``; torchvision's
  ``LastLevelP6P7`` puts a ReLU there); 9 anchors per place, octave base scale 4 with 3 scales
  per octave and ratios 0.5/1/2, not rounded (torchvision rounds its base anchors); focal loss
  (gamma 2, alpha 0.25) and L1 box loss; IoU 0.5/0.4 with low-quality matches; test: score
  0.05, the 1000 best per level, NMS 0.5, 100 detections.
* Mask R-CNN: FPN over strides 4-32 plus a max-pooled P6; RPN with 3 anchors (scale 8, ratios
  0.5/1/2) per place, 2000/1000 proposals before/after NMS 0.7 in training, 1000/1000 at test;
  RoIAlign 7x7 (boxes) and 14x14 (masks) with ``aligned=True`` and adaptive sampling (mmcv's;
  torchvision's pooler is not aligned and samples 2 points); two shared 1024-wide FC layers,
  class-specific box regression with stds 0.1/0.1/0.2/0.2; the 4-conv FCN mask head; 512 RoIs
  a quarter positive; test: score 0.05, NMS 0.5, 100 detections, masks at 0.5.
* Images resized keeping the ratio to at most 1333x800, normalised, padded to a multiple of 32.

Where torchvision cannot follow: Mask R-CNN's RPN and box-regression losses are torchvision's
smooth L1 (beta 1/9), where mmdet 2.11's configs use L1; torchvision's detectors put the
background class first (class 0) where mmdet puts it last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torchvision.models.detection import MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.retinanet import RetinaNetHead
from torchvision.ops import FeaturePyramidNetwork, MultiScaleRoIAlign, roi_align
from torchvision.ops.feature_pyramid_network import ExtraFPNBlock, LastLevelMaxPool
from torchvision.ops.poolers import _convert_to_roi_format, _filter_input, _setup_scales

from lgvit.checkpoints.kinds import DetectorSpec, detector_spec
from lgvit.core.constants import IMAGENET_MEAN, IMAGENET_STD
from lgvit.core.errors import LgvitError
from lgvit.dense.backbone import DenseBackbone, create_backbone
from lgvit.models.swin import SwinTransformer

DETECTION_SIZE = 800  # the short side LIT's detection configs train and test at


class P6P7OnInput(ExtraFPNBlock):
    """mmdet's ``add_extra_convs='on_input'``: P6 = conv(C5), P7 = conv(P6), no ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.p6 = nn.Conv2d(in_channels, out_channels, 3, 2, 1)
        self.p7 = nn.Conv2d(out_channels, out_channels, 3, 2, 1)

    def forward(
        self, results: list[torch.Tensor], x: list[torch.Tensor], names: list[str]
    ) -> tuple[list[torch.Tensor], list[str]]:
        p6 = self.p6(x[-1])
        return [*results, p6, self.p7(p6)], [*names, "p6", "p7"]


class UnroundedAnchors(AnchorGenerator):
    """torchvision's anchor generator without rounding the base anchors (mmdet 2.x's)."""

    def generate_anchors(  # type: ignore[override]
        self, scales: Sequence[float], aspect_ratios: Sequence[float],
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> torch.Tensor:  # fmt: skip
        scales_t = torch.as_tensor(scales, dtype=dtype, device=device)
        ratios = torch.as_tensor(aspect_ratios, dtype=dtype, device=device)
        h_ratios = torch.sqrt(ratios)
        ws = ((1 / h_ratios)[:, None] * scales_t[None, :]).view(-1)
        hs = (h_ratios[:, None] * scales_t[None, :]).view(-1)
        return torch.stack([-ws, -hs, ws, hs], dim=1) / 2


class AlignedMultiScaleRoIAlign(MultiScaleRoIAlign):
    """``MultiScaleRoIAlign`` with ``aligned=True`` (mmcv's RoIAlign: pixel centres at +0.5)."""

    def forward(  # type: ignore[override]
        self, x: dict[str, torch.Tensor], boxes: list[torch.Tensor],
        image_shapes: list[tuple[int, int]],
    ) -> torch.Tensor:  # fmt: skip
        feats = _filter_input(x, self.featmap_names)
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = _setup_scales(
                feats, image_shapes, self.canonical_scale, self.canonical_level
            )
        rois = _convert_to_roi_format(boxes)
        levels = self.map_levels(boxes)
        out = feats[0].new_zeros((len(rois), feats[0].shape[1], *self.output_size))
        for level, (feat, scale) in enumerate(zip(feats, self.scales, strict=True)):
            idx = torch.where(levels == level)[0]
            pooled = roi_align(feat, rois[idx], self.output_size, scale, self.sampling_ratio,
                               aligned=True)  # fmt: skip
            out[idx] = pooled.to(out.dtype)
        return out


class BackboneWithFPN(nn.Module):
    """A :class:`DenseBackbone` and an FPN: ``forward(images) -> OrderedDict`` of 256-channel
    maps, as torchvision's detectors take them (``out_channels``)."""

    def __init__(self, body: DenseBackbone, extra: ExtraFPNBlock, out_channels: int = 256) -> None:
        super().__init__()
        self.body = body
        self.fpn = FeaturePyramidNetwork(body.feature_info.channels(), out_channels, extra)
        self.out_channels = out_channels
        for m in self.fpn.modules():  # mmdet's FPN.init_weights: Xavier-uniform convs
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        maps = self.body(x)
        return self.fpn(OrderedDict((str(i), m) for i, m in enumerate(maps)))


def retinanet_anchors(strides: Sequence[int] = (8, 16, 32, 64, 128)) -> UnroundedAnchors:
    """9 per place: 4 x stride x 2^(k/3), k = 0, 1, 2, ratios 0.5/1/2 (mmdet's octave base
    scale 4, 3 scales per octave), for each level's stride."""
    sizes = tuple(tuple(4 * s * 2 ** (k / 3) for k in range(3)) for s in strides)
    return UnroundedAnchors(sizes, ((0.5, 1.0, 2.0),) * len(strides))


def _norm_kwargs(name: str, spec: DetectorSpec) -> dict[str, Any]:
    """LIT-S's detection backbone (Swin skeleton) has no norm on the stride-4 map in the
    authors' Mask R-CNN configs."""
    from lgvit.models.registry import model_class

    if spec.swin_unnormed and issubclass(model_class(name), SwinTransformer):
        return {"unnormed": spec.swin_unnormed}
    return {}


def create_detector(
    kind: str,
    backbone: str,
    num_classes: int = 80,
    *,
    checkpoint_path: str | None = None,
    min_size: int = DETECTION_SIZE,
    max_size: int = 1333,
    pretrained: bool = False,
    cache_dir: str | None = None,
    **backbone_kwargs: Any,
) -> nn.Module:
    """``retinanet`` or ``maskrcnn`` (torchvision's) on a registered pyramid model.

    ``num_classes`` counts object classes (COCO: 80); Mask R-CNN adds torchvision's background
    class 0 in front. ``checkpoint_path``: the backbone's classification weights.
    ``pretrained``: the whole detector with the authors' released COCO weights for ``backbone``
    (``lit_ti``, or ``lit_ti.coco_retinanet_authors``), downloaded once into the weights cache
    (``cache_dir``, default ``$LGVIT_WEIGHTS_DIR`` or torch hub's).
    """
    spec = detector_spec(kind)
    if pretrained:
        from lgvit.dense.pretrained import check_classes, create_released
        from lgvit.models.weights import resolve_weights

        w = resolve_weights(backbone, "detection", kind)
        check_classes(w, num_classes)
        if checkpoint_path is not None:
            raise LgvitError("create_detector: pretrained=True loads the whole detector; "
                             "checkpoint_path (backbone weights) would be overwritten")  # fmt: skip
        return create_released(
            w, lambda **kw: create_detector(kind, w.model, w.num_classes, min_size=min_size,
                                            max_size=max_size, **kw),
            backbone_kwargs, cache_dir,
        )  # fmt: skip
    backbone_kwargs.setdefault("img_size", DETECTION_SIZE)  # LIT-S's tables: 800 // 4
    common = dict(min_size=min_size, max_size=max_size, image_mean=list(IMAGENET_MEAN),
                  image_std=list(IMAGENET_STD))  # fmt: skip
    if not spec.two_stage:
        # The last three stages (strides 8-32 on the four-stage pyramids), then P6 and P7.
        body = create_backbone(backbone, checkpoint_path=checkpoint_path, out_indices=(-3, -2, -1),
                               **backbone_kwargs)  # fmt: skip
        c5, s5 = body.feature_info.channels()[-1], body.feature_info.reduction()[-1]
        net = BackboneWithFPN(body, P6P7OnInput(c5, 256))
        strides = (*body.feature_info.reduction(), 2 * s5, 4 * s5)
        head = RetinaNetHead(256, 9, num_classes)
        model: nn.Module = RetinaNet(
            net, num_classes, anchor_generator=retinanet_anchors(strides), head=head,
            score_thresh=0.05, nms_thresh=0.5, detections_per_img=100, topk_candidates=1000,
            **common,
        )  # fmt: skip
    else:
        kwargs = {**_norm_kwargs(backbone, spec), **backbone_kwargs}
        body = create_backbone(backbone, checkpoint_path=checkpoint_path, **kwargs)
        net = BackboneWithFPN(body, LastLevelMaxPool())
        red = body.feature_info.reduction()  # scale 8 x stride (strides 4-64 on LIT, PVT, Swin)
        anchors = UnroundedAnchors(tuple((8.0 * s,) for s in (*red, 2 * red[-1])),
                                   ((0.5, 1.0, 2.0),) * (len(red) + 1))  # fmt: skip
        names = [str(i) for i in range(len(red))]
        model = MaskRCNN(
            net, num_classes + spec.label_offset, rpn_anchor_generator=anchors,
            rpn_pre_nms_top_n_train=2000, rpn_post_nms_top_n_train=1000,
            rpn_pre_nms_top_n_test=1000, rpn_post_nms_top_n_test=1000,
            box_roi_pool=AlignedMultiScaleRoIAlign(names, 7, sampling_ratio=0),
            mask_roi_pool=AlignedMultiScaleRoIAlign(names, 14, sampling_ratio=0),
            bbox_reg_weights=(10.0, 10.0, 5.0, 5.0), **common,
        )  # fmt: skip
    model.pretrained_cfg = body.pretrained_cfg
    model.detector = kind
    return model
