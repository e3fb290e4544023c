"""Patch embedding: a strided conv from an image (or a token map) to tokens, then a norm."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from lgvit.models.layers.helpers import Grid, map_to_tokens, to_2tuple, tokens_to_map


class PatchEmbed(nn.Module):
    """``Conv2d(k=patch, stride=patch)`` -> tokens -> optional norm.

    ``forward(x)`` takes an image ``(B, C, H, W)``; ``forward(x, hw)`` takes tokens on a grid,
    so the same module merges tokens between the stages of a pyramid (PVT's per-stage patch
    embeddings). Returns ``(tokens, grid)``.
    """

    def __init__(
        self,
        patch_size: int | Grid = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: Callable[[int], nn.Module] | None = None,
        stride: int | Grid | None = None,
        padding: int | Grid = 0,
    ) -> None:
        super().__init__()
        self.patch_size = to_2tuple(patch_size)
        self.proj = nn.Conv2d(
            in_chans, embed_dim, self.patch_size, stride=to_2tuple(stride or patch_size),
            padding=to_2tuple(padding),
        )  # fmt: skip
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x: torch.Tensor, hw: Grid | None = None) -> tuple[torch.Tensor, Grid]:
        if hw is not None:  # tokens come with their grid (not x.ndim: fx cannot branch on it)
            x = tokens_to_map(x, hw)
        tokens, grid = map_to_tokens(self.proj(x))
        return self.norm(tokens), grid
