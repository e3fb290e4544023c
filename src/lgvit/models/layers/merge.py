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
        x = pad_to_even(x.view(B, H, W, C))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        grid = (x.shape[1], x.shape[2])
        return self.reduction(self.norm(x.flatten(1, 2))), grid


def pad_to_even(x: torch.Tensor) -> torch.Tensor:
    """A ``(B, H, W, C)`` map zero-padded at the bottom/right to an even height and width."""
    H, W = x.shape[1], x.shape[2]
    return F.pad(x, (0, 0, 0, W % 2, 0, H % 2)) if H % 2 or W % 2 else x


torch.fx.wrap("pad_to_even")  # torch.fx: one graph node (it branches on the map's size)
