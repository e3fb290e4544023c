"""Semantic FPN (Kirillov et al. 2019, "Panoptic Feature Pyramid Networks"), as LIT's
segmentation configs use it (mmsegmentation 0.13's ``FPN`` neck + ``FPNHead``).

backbone maps (strides s0 < s1 < ...) -> FPN (torchvision's ``FeaturePyramidNetwork``: 1x1
laterals, nearest top-down sums, 3x3 outputs; 256 channels) -> per level a stack of
3x3 conv + norm + ReLU (128 channels), each followed by 2x bilinear upsampling until stride
s0 -> sum -> dropout 0.1 -> 1x1 classifier -> bilinear resizing to the input. Losses and
metrics live in :mod:`lgvit.tasks.segmentation.train`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import Conv2dNormActivation, FeaturePyramidNetwork

from lgvit.core.errors import LgvitError
from lgvit.dense.backbone import DenseBackbone, create_backbone


class Upsample2x(nn.Module):
    """2x bilinear upsampling (mmseg's ``Upsample(scale_factor=2, align_corners=False)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class FPNHead(nn.Module):
    """Semantic FPN's decoder: every level brought to the first level's stride and summed.

    Level i gets ``max(1, log2(s_i / s_0))`` conv-norm-ReLU units (the first from the FPN's
    width, the rest at ``channels``), each but a level-0 one followed by 2x upsampling; levels
    whose strides are not powers of two apart are resized to level 0's size before the sum.
    Module names follow mmseg's (``scale_heads.i.j``, ``conv_seg``) so their checkpoints map
    one to one (``.conv`` -> ``.0``, ``.bn`` -> ``.1``).
    """

    def __init__(
        self,
        in_channels: int,
        strides: Sequence[int],
        num_classes: int,
        channels: int = 128,
        dropout: float = 0.1,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
    ) -> None:
        super().__init__()
        self.scale_heads = nn.ModuleList()
        for i, stride in enumerate(strides):
            length = max(1, round(math.log2(stride / strides[0])))
            layers: list[nn.Module] = []
            for k in range(length):
                layers.append(
                    Conv2dNormActivation(
                        in_channels if k == 0 else channels, channels, 3, norm_layer=norm_layer
                    )
                )
                if i > 0:
                    layers.append(Upsample2x())
            self.scale_heads.append(nn.Sequential(*layers))
        self.dropout = nn.Dropout2d(dropout) if dropout > 0 else nn.Identity()
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)
        nn.init.normal_(self.conv_seg.weight, 0, 0.01)  # mmseg's decode-head init
        nn.init.zeros_(self.conv_seg.bias)

    def forward(self, feats: Sequence[torch.Tensor]) -> torch.Tensor:
        out = self.scale_heads[0](feats[0])
        for head, f in zip(self.scale_heads[1:], feats[1:], strict=True):
            y = head(f)
            if y.shape[-2:] != out.shape[-2:]:
                y = F.interpolate(y, size=out.shape[-2:], mode="bilinear", align_corners=False)
            out = out + y
        return self.conv_seg(self.dropout(out))


class SemanticFPN(nn.Module):
    """Backbone -> FPN -> :class:`FPNHead`; ``forward(images)`` gives per-pixel class logits
    ``(B, num_classes, H, W)`` at the input's size."""

    def __init__(
        self,
        backbone: DenseBackbone,
        num_classes: int,
        fpn_channels: int = 256,
        head_channels: int = 128,
        dropout: float = 0.1,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.num_classes = num_classes
        chans = backbone.feature_info.channels()
        self.neck = FeaturePyramidNetwork(chans, fpn_channels)
        for m in self.neck.modules():  # as mmcv's ConvModule (mmseg 0.13 never calls FPN's init)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
        self.decode_head = FPNHead(
            fpn_channels, backbone.feature_info.reduction(), num_classes, head_channels, dropout,
            norm_layer,
        )  # fmt: skip
        self.pretrained_cfg = backbone.pretrained_cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H, W = x.shape[-2:]
        feats = self.backbone(x)
        pyramid = self.neck(OrderedDict((str(i), f) for i, f in enumerate(feats)))
        logits = self.decode_head(list(pyramid.values()))
        return F.interpolate(logits, size=(H, W), mode="bilinear", align_corners=False)


def create_segmenter(
    backbone: str,
    num_classes: int | None = None,
    *,
    checkpoint_path: str | None = None,
    sync_bn: bool = False,
    pretrained: bool = False,
    cache_dir: str | None = None,
    **backbone_kwargs: Any,
) -> SemanticFPN:
    """Semantic FPN on a registered pyramid model (``checkpoint_path``: its classification
    weights). ``sync_bn``: the head's BatchNorms as ``SyncBatchNorm`` (multi-process runs).

    ``pretrained``: the whole segmenter with the authors' released weights for ``backbone``
    (``lit_ti``, or ``lit_ti.ade20k_semfpn_authors``: ADE20K, 150 classes), downloaded once
    into the weights cache (``cache_dir``, default ``$LGVIT_WEIGHTS_DIR`` or torch hub's)."""
    if pretrained:
        from lgvit.dense.pretrained import check_classes, create_released
        from lgvit.models.weights import resolve_weights

        w = resolve_weights(backbone, "segmentation")
        check_classes(w, num_classes)
        if checkpoint_path is not None:
            raise LgvitError("create_segmenter: pretrained=True loads the whole segmenter; "
                             "checkpoint_path (backbone weights) would be overwritten")  # fmt: skip
        model = create_released(
            w, lambda **kw: create_segmenter(w.model, w.num_classes, **kw), backbone_kwargs,
            cache_dir,
        )  # fmt: skip
    elif num_classes is None:
        raise LgvitError("create_segmenter: num_classes is needed (pretrained=True takes the "
                         "released weights' classes)")  # fmt: skip
    else:
        bb = create_backbone(backbone, checkpoint_path=checkpoint_path, **backbone_kwargs)
        model = SemanticFPN(bb, num_classes)
    if sync_bn:  # the head's only, as mmseg's SyncBN norm_cfg: the backbone's BN stays per GPU
        model.decode_head = nn.SyncBatchNorm.convert_sync_batchnorm(model.decode_head)
    return model
