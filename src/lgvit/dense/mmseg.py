"""The LIT authors' Semantic FPN checkpoints (mmsegmentation 0.13 layout) -> :class:`SemanticFPN`.

Their files (``sem_fpn_lit_ti.pth``, ``sem_fpn_lit_s.pth``) hold ``{"meta", "state_dict",
"optimizer"}``; the state dict names mmseg's modules:

* ``backbone.*`` (the authors' classification layout less the head) -> ``backbone.model.*``,
  through the model's own mapping of the authors' classification checkpoints;
* ``backbone.norm{i}`` (LIT-S's per-level output norms) -> ``backbone.norms.{i}``;
* ``neck.lateral_convs.i.conv`` / ``neck.fpn_convs.i.conv`` -> ``neck.inner_blocks.i.0`` /
  ``neck.layer_blocks.i.0`` (torchvision's FPN);
* ``decode_head.scale_heads.i.j.conv`` / ``.bn`` -> ``decode_head.scale_heads.i.j.0`` / ``.1``;
  ``decode_head.conv_seg`` unchanged.

LIT-Ti's dense backbone has no class token; ours keeps the (unused) parameter, so the model's
own value fills it. The key names and shapes are checked against a fixture built from the
authors' configs and mmseg 0.13's module definitions; without mmseg installed, the numerical
output of their model could not be compared.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lgvit.core.errors import LgvitError

_RENAMES = (
    (re.compile(r"^neck\.lateral_convs\.(\d+)\.conv\."), r"neck.inner_blocks.\1.0."),
    (re.compile(r"^neck\.fpn_convs\.(\d+)\.conv\."), r"neck.layer_blocks.\1.0."),
    (re.compile(r"^decode_head\.scale_heads\.(\d+)\.(\d+)\.conv\."),
     r"decode_head.scale_heads.\1.\2.0."),
    (re.compile(r"^decode_head\.scale_heads\.(\d+)\.(\d+)\.bn\."),
     r"decode_head.scale_heads.\1.\2.1."),
)  # fmt: skip
_OUT_NORM = re.compile(r"^norm(\d+)\.(.*)$")


def is_mmseg_layout(state_dict: dict[str, Any]) -> bool:
    """Whether a state dict is an mmseg segmentor's (FPN neck with ConvModule laterals)."""
    return any(k.startswith("neck.lateral_convs.") for k in state_dict)


def unwrap_mmseg(obj: Any) -> dict[str, torch.Tensor]:
    """The state dict of an mmseg checkpoint file's contents (``{"state_dict": ...}``)."""
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    return {k.removeprefix("module."): v for k, v in obj.items()}


def backbone_to_lgvit(
    state_dict: dict[str, torch.Tensor], backbone: torch.nn.Module, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """The authors' dense backbone keys (``backbone.`` stripped) -> a :class:`DenseBackbone`'s:
    ``norm{i}`` -> ``norms.{position of i in out_indices}``, the rest through the model's own
    mapping of the authors' classification layout. A level the authors normalise but we do not
    output (LIT-S's stride-4 map in RetinaNet) is left out."""
    from lgvit.models.loading import adapt_state_dict

    out: dict[str, torch.Tensor] = {}
    inner: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = _OUT_NORM.match(key)
        if m and backbone.norms is not None:
            if int(m[1]) not in backbone.out_indices:
                raise LgvitError(f"{source}: backbone.{key} is the norm of a level not output")
            out[f"norms.{backbone.out_indices.index(int(m[1]))}.{m[2]}"] = value
        else:
            inner[key] = value
    mapped = adapt_state_dict(backbone.model, inner, source)
    for key, value in backbone.model.state_dict().items():
        if key not in mapped and key.endswith("cls_token"):  # LIT-Ti's dense code has none
            mapped[key] = value
    out.update({f"model.{k}": v for k, v in mapped.items()})
    return out


def mmseg_to_lgvit(
    state_dict: dict[str, torch.Tensor], model: torch.nn.Module, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Map an mmseg Semantic FPN state dict onto ``model`` (a :class:`SemanticFPN`)."""
    sub = {k.removeprefix("backbone."): v for k, v in state_dict.items()
           if k.startswith("backbone.")}  # fmt: skip
    out = {f"backbone.{k}": v for k, v in backbone_to_lgvit(sub, model.backbone, source).items()}
    for key, value in state_dict.items():
        if not key.startswith("backbone."):
            for pattern, repl in _RENAMES:
                key = pattern.sub(repl, key)
            out[key] = value
    return out


# The layout for :func:`lgvit.models.loading.adapt_state_dict`: its test and its mapping.
MMSEG_LAYOUT = (is_mmseg_layout, mmseg_to_lgvit)
