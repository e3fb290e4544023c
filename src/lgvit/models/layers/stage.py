"""A stage of a token pyramid: merge/downsample, then position embedding, then blocks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lgvit.models.layers.helpers import Grid
from lgvit.models.layers.pos_embed import register_resize_on_load, resize_pos_embed
from lgvit.models.layers.weight_init import trunc_normal_

# torch.fx: one graph node (it compares the grid with the built one).
torch.fx.wrap("resize_pos_embed")


@contextmanager
def frozen_norm_stats(module: nn.Module) -> Iterator[None]:
    """BatchNorm running statistics unchanged inside: a checkpointed block's recomputation
    must not count its batch twice."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None
              else None) for m in bns]  # fmt: skip
    for m in bns:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(bns, saved, strict=True):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def run_block(
    block: nn.Module, x: torch.Tensor, hw: Grid | None, grad_checkpointing: bool
) -> torch.Tensor:
    """``block(x, hw)``, with activation checkpointing when asked for and gradients are on:
    the block's activations are recomputed in the backward pass instead of kept."""
    if grad_checkpointing and torch.is_grad_enabled():
        return checkpoint(
            block, x, hw, use_reentrant=False,
            context_fn=lambda: (nullcontext(), frozen_norm_stats(block)),
        )  # fmt: skip
    return block(x, hw)


class Stage(nn.Module):
    """``[downsample] -> [class token] -> [+ position embedding] -> blocks``.

    Args:
        blocks: the stage's blocks, each called as ``block(x, hw)``.
        downsample: ``module(x, hw) -> (x, hw)`` that merges tokens into the stage's grid.
        pos_embed_grid: with ``dim``, add a learned absolute position embedding
            ``(prefix + H*W, dim)`` built for this grid (resized for another grid, at run time
            and on load).
        cls_token: prepend a learned class token (PVT's stage 4). ``use_cls_token = False``
            leaves it (and its position row) out, as PVT's dense backbones do.
        pos_resize_mode: ``bicubic`` or ``bilinear`` interpolation when resizing.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        downsample: nn.Module | None = None,
        dim: int | None = None,
        pos_embed_grid: Grid | None = None,
        cls_token: bool = False,
        pos_drop: float = 0.0,
        pos_resize_mode: str = "bicubic",
    ) -> None:
        super().__init__()
        self.downsample = downsample
        self.grid = tuple(pos_embed_grid) if pos_embed_grid else None
        self.num_prefix_tokens = int(cls_token)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        self.use_cls_token = True
        self.pos_embed = None
        if pos_embed_grid is not None:
            n = self.num_prefix_tokens + self.grid[0] * self.grid[1]
            self.pos_embed = nn.Parameter(torch.zeros(n, dim))
            trunc_normal_(self.pos_embed, std=0.02)
            self.pos_resize_mode = pos_resize_mode
            register_resize_on_load(
                self, lambda: {"pos_embed": (self.grid, self.num_prefix_tokens)}, pos_resize_mode
            )
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)
        self.pos_drop = nn.Dropout(pos_drop) if pos_drop else nn.Identity()
        self.blocks = nn.ModuleList(blocks)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, hw: Grid) -> tuple[torch.Tensor, Grid]:
        if self.downsample is not None:
            x, hw = self.downsample(x, hw)
        prefix = self.num_prefix_tokens if self.use_cls_token else 0
        if prefix:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        if self.pos_embed is not None:
            pos = self.pos_embed[self.num_prefix_tokens - prefix :]
            # the same on the built grid; one torch.fx graph node (it compares the grids)
            pos = resize_pos_embed(pos, self.grid, hw, prefix, self.pos_resize_mode)
            x = self.pos_drop(x + pos)
        for blk in self.blocks:
            x = run_block(blk, x, hw, self.grad_checkpointing)
        return x, hw
