"""Every pyramid model as a dense-prediction backbone (detection, segmentation).

:func:`create_backbone` builds a registered model with a feature pyramid (strides growing from
stage to stage: LIT, PVT, Swin and their LocalViT/LIT variants, LSA's ImageNet models), loads
any classification checkpoint the model reads (lgvit's, the authors' ``.pth``, timm's for the
baselines), drops the head and wraps it in :class:`DenseBackbone`, which takes any input height
and width and returns the maps of ``out_indices`` as a list of ``(B, C, H/s, W/s)``.

What the dense mode changes, as the authors' dense backbones (LIT's ``segmentation/`` and
``detection/`` code, Swin's) do:

* any input size: Swin-skeleton models zero-pad the input at the bottom and right to a multiple
  of the patch size and merge odd maps with padding; the PVT skeleton (LIT-Ti) and LSA floor
  odd sizes in their strided convolutions, as their code does. Heads resize their output to
  the input (mmseg's ``whole`` inference);
* absolute position embeddings are resized to each input's grids at run time (bilinear for
  PVT and LIT-Ti, as their dense code; bicubic for LSA); the PVT skeleton leaves stage 4's
  class token out (its position row too), as PVT's and LIT-Ti's dense backbones do;
* Swin-skeleton models are built for the dense input size (``img_size``: 512 for LIT's
  segmentation, 800 for detection), so LIT-S/M/B's relative-position tables over the whole
  stage map have the size the authors' dense checkpoints hold (a classification checkpoint's
  tables are resized bicubic on load, then bicubic to each input's grid), and Swin's windows
  shift in every second block; a grid that is not a multiple of the window is padded per block;
* per-level output norms: Swin-skeleton and LSA models get a new LayerNorm on every output map
  (``norms.i``, Swin's and LIT-S's ``norm{i}``), the PVT skeleton none (LIT-Ti's code);
* ``frozen_stages`` (-1: none; 0: the stem; k: the stem and stages 1..k, ResNet's numbering in
  mmdetection; Swin's own code counts one higher), kept in eval mode and without gradients;
  ``norm_eval``: BatchNorm layers stay in eval mode while training; drop path
  (``drop_path_rate``) and activation checkpointing as in classification.
Each family declares its part and the backbone asks the model, never its class:
``dense_out_norms``, ``dense_built_for_input_size``, ``dense_size_divisor()`` and
``set_dense_mode()`` (:class:`lgvit.models.base.StagedViT`, overridden by Swin, PVT and LSA).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.core.errors import LgvitError
from lgvit.models import create_model, list_models
from lgvit.models.layers.features import FeatureInfo, feature_take_indices

OUT_NORMS = ("per_level", "last", "none")


def is_pyramid(model: nn.Module) -> bool:
    """Whether the model's stages form a pyramid (each stride above the previous one)."""
    red = [f["reduction"] for f in getattr(model, "feature_info", [])]
    return len(red) > 1 and all(b > a for a, b in zip(red, red[1:], strict=False))


def dense_backbone_names() -> list[str]:
    """Registered models that work as dense backbones (built on the meta device to check)."""
    names = []
    for name in list_models():
        with torch.device("meta"):
            model = create_model(name)
        if is_pyramid(model):
            names.append(name)
    return names


class DenseBackbone(nn.Module):
    """A pyramid classification model as a backbone: ``forward(images) -> [maps]``.

    Attributes: ``model`` (the classification model without its head), ``out_indices``,
    ``feature_info`` (channels and reduction of each map), ``size_divisor`` (inputs are padded
    to a multiple of it), ``norms`` (per-level output norms, or None).
    """

    def __init__(
        self,
        model: nn.Module,
        out_indices: Sequence[int] | None = None,
        out_norms: str | None = None,
        frozen_stages: int = -1,
        norm_eval: bool = False,
        unnormed: Sequence[int] = (),
    ) -> None:
        super().__init__()
        if not is_pyramid(model):
            name = getattr(model, "model_name", type(model).__name__)
            raise LgvitError(
                f"{name} has no feature pyramid (one stride for every stage); dense backbones: "
                "the LIT, PVT, Swin and LSA ImageNet models (lgvit.dense.dense_backbone_names())"
            )
        n = len(model.feature_info)
        out_indices = list(range(n)) if out_indices is None else list(out_indices)
        self.out_indices = feature_take_indices(n, out_indices)
        out_norms = out_norms or model.dense_out_norms  # as the family's authors wrote it
        if out_norms not in OUT_NORMS:
            raise LgvitError(f"out_norms {out_norms!r} is not one of {OUT_NORMS}")
        if not -1 <= frozen_stages <= n:
            raise LgvitError(f"frozen_stages {frozen_stages} is not in -1..{n}")
        self.out_norms = out_norms
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.size_divisor = model.dense_size_divisor()
        self.feature_info = FeatureInfo(model.feature_info[i] for i in self.out_indices)
        last = n - 1
        model.prune_intermediate_layers(
            self.out_indices, prune_norm=out_norms != "last" or last not in self.out_indices
        )
        self.model = model
        self.norms = (
            nn.ModuleList(
                nn.Identity() if i in unnormed else nn.LayerNorm(f["num_chs"])
                for i, f in zip(self.out_indices, self.feature_info, strict=True)
            )
            if out_norms == "per_level"
            else None
        )
        self.pretrained_cfg = getattr(model, "pretrained_cfg", {})
        self._freeze()

    # -- training behaviour ------------------------------------------------------------------

    def frozen_modules(self) -> list[nn.Module]:
        """The stem (``frozen_stages >= 0``) and stages 1..``frozen_stages``."""
        if self.frozen_stages < 0:
            return []
        stem = re.compile(self.model.stem_pattern)
        mods = [m for name, m in self.model.named_children() if stem.match(name)]
        mods += list(self.model.stage_list()[: self.frozen_stages])
        return mods

    def frozen_parameters(self) -> list[nn.Parameter]:
        stem = re.compile(self.model.stem_pattern)
        params = [p for name, p in self.model.named_parameters(recurse=False) if stem.match(name)]
        return params + [p for m in self.frozen_modules() for p in m.parameters()]

    def _freeze(self) -> None:
        for p in self.frozen_parameters():
            p.requires_grad_(False)

    def train(self, mode: bool = True) -> DenseBackbone:
        super().train(mode)
        if mode:
            for m in self.frozen_modules():
                m.eval()
            if self.norm_eval:
                for m in self.modules():
                    if isinstance(m, nn.modules.batchnorm._BatchNorm):
                        m.eval()
        return self

    # -- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        H, W = x.shape[-2:]
        k = self.size_divisor
        ph, pw = -H % k, -W % k
        if ph or pw:
            x = F.pad(x, (0, pw, 0, ph))
        model = self.model
        maps = model.forward_intermediates(
            x, self.out_indices, norm=self.out_norms == "last", stop_early=True,
            output_fmt="NHWC", intermediates_only=True,
        )  # fmt: skip
        if self.norms is not None:
            maps = [norm(m) for norm, m in zip(self.norms, maps, strict=True)]
        return [m.permute(0, 3, 1, 2).contiguous() for m in maps]


def built_for_dense_size(name: str) -> bool:
    """Whether ``name``'s family builds its dense backbones for the dense input size (the
    model's ``dense_built_for_input_size``: the Swin skeleton); built on the meta device."""
    with torch.device("meta"):
        return create_model(name).dense_built_for_input_size


def create_backbone(
    name: str,
    *,
    checkpoint_path: str | None = None,
    out_indices: Sequence[int] | None = None,
    out_norms: str | None = None,
    frozen_stages: int = -1,
    norm_eval: bool = False,
    drop_path_rate: float | None = None,
    grad_checkpointing: bool = False,
    img_size: int = 512,
    unnormed: Sequence[int] = (),
    **overrides: Any,
) -> DenseBackbone:
    """A registered pyramid model as a :class:`DenseBackbone`.

    Args:
        checkpoint_path: classification weights to start from (any file ``create_model``
            reads: an lgvit checkpoint, the authors' ``.pth``, timm's for DeiT/Swin); the head
            is dropped.
        out_indices: the stages whose maps come out (default: all).
        out_norms: ``per_level`` (a LayerNorm per output), ``last`` (the final norm on the
            last stage's map) or ``none``; default as the authors' dense backbones.
        frozen_stages, norm_eval: as mmdetection's backbones.
        drop_path_rate: stochastic depth (default: the model's).
        grad_checkpointing: recompute each block's activations in the backward pass.
        img_size: the dense input size Swin-skeleton models are built for (see the module's
            docstring; :func:`built_for_dense_size`); other models keep their classification
            size.
        unnormed: stages whose output gets no per-level norm (LIT-S's detection backbone
            leaves stage 1's map unnormalised).
    """
    if drop_path_rate is not None:
        overrides["drop_path_rate"] = drop_path_rate
    if built_for_dense_size(name):
        overrides["img_size"] = img_size
    model = create_model(name, checkpoint_path=checkpoint_path, **overrides)
    model.reset_classifier(0, "")
    model.set_dense_mode()  # the family's own: padded windows, resized positions, no cls token
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return DenseBackbone(model, out_indices, out_norms, frozen_stages, norm_eval, unnormed)
