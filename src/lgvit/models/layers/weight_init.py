"""ViT/DeiT weight initialisation."""

from __future__ import annotations

import torch
import torch.nn as nn


def trunc_normal_(tensor: torch.Tensor, std: float = 0.02) -> torch.Tensor:
    """Truncated normal at +-2 std (ViT/DeiT initialisation)."""
    return nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-2 * std, b=2 * std)


def init_vit_weights(module: nn.Module, conv: bool = True) -> None:
    """ViT initialisation: trunc-normal(0.02) linear (and, with ``conv``, conv) weights, zero
    biases, unit norms. ``conv=False`` is timm's ViT/DeiT, PVT and Swin init: convolutions keep
    PyTorch's default."""
    kinds = (nn.Linear, nn.Conv2d) if conv else (nn.Linear,)
    if isinstance(module, kinds):
        # a stacked Linear (one qkv for q and kv) part by part: the draws of the separate parts
        for rows in module.weight.split(getattr(module, "row_parts", None) or len(module.weight)):
            trunc_normal_(rows, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm | nn.BatchNorm2d):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
