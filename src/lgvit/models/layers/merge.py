"""Swin's patch merging: each 2x2 group of tokens -> one token of twice the width."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.layers.helpers import Grid


class PatchMerging(nn.Module):
    """Concatenate the 2x2 neighbours (order: (0,0), (1,0), (0,1), (1,1), as Swin), LayerNorm
    over the 4C channels, then a bias-free ``Linear(4C, out_dim)``. Odd grids are zero-padded."""

    def __init__(
        self,
        dim: int,
        out_dim: int | None = None,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ) -> None:
        super().__init__()
        self.norm = norm_layer(4 * dim)
        self.reduction = nn.Linear(4 * dim, out_dim or 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, hw: Grid) -> tuple[torch.Tensor, Grid]:
        B, _, C = x.shape
        H, W = hw
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        grid = (x.shape[1], x.shape[2])
        return self.reduction(self.norm(x.flatten(1, 2))), grid
