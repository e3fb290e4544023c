"""Resizing position embeddings: absolute (with prefix tokens) and relative-bias tables.

Models built for one input size load checkpoints trained at another through
:func:`register_resize_on_load`, and resize on the fly for other grids at run time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.layers.helpers import Grid


def grid_from_tokens(n: int) -> Grid:
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"{n} tokens do not form a square grid")
    return side, side


def is_symbolic(grid: Grid) -> bool:
    """Whether a grid holds symbolic sizes (``torch.export`` with a dynamic height/width)."""
    return any(isinstance(g, torch.SymInt) for g in grid)


def grid_differs(grid: Grid, built: Grid) -> bool:
    """Whether tokens on ``grid`` need embeddings resized from ``built``. A symbolic grid always
    does: an exported graph must resize inside itself rather than fix the size it was traced at
    (comparing would specialise the symbol)."""
    return is_symbolic(grid) or tuple(grid) != tuple(built)


def resize_pos_embed(
    pos: torch.Tensor,
    old_grid: Grid,
    new_grid: Grid,
    num_prefix_tokens: int = 0,
    mode: str = "bicubic",
) -> torch.Tensor:
    """Resize an absolute position embedding ``(..., prefix + H*W, C)`` to another grid.

    Prefix-token rows (a class token's) are kept as they are; the grid rows are interpolated
    (``bicubic``, or ``bilinear`` as LIT's dense-prediction code does), in float32.
    """
    if not grid_differs(new_grid, old_grid):
        return pos
    lead, (n, c) = pos.shape[:-2], pos.shape[-2:]
    if n != num_prefix_tokens + old_grid[0] * old_grid[1]:
        raise ValueError(
            f"position embedding has {n} tokens, not {num_prefix_tokens} + a {old_grid} grid"
        )
    prefix, grid = pos[..., :num_prefix_tokens, :], pos[..., num_prefix_tokens:, :]
    x = grid.reshape(-1, *old_grid, c).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=tuple(new_grid), mode=mode, align_corners=False)
    x = x.permute(0, 2, 3, 1).reshape(*lead, new_grid[0] * new_grid[1], c).to(pos.dtype)
    return torch.cat([prefix, x], dim=-2) if num_prefix_tokens else x


def resize_rel_pos_table(table: torch.Tensor, old_grid: Grid, new_grid: Grid) -> torch.Tensor:
    """Resize a relative-position bias table ``((2H-1)(2W-1), heads)`` to another grid (bicubic,
    as Swin's and LIT's fine-tuning code does)."""
    if not grid_differs(new_grid, old_grid):
        return table
    old = (2 * old_grid[0] - 1, 2 * old_grid[1] - 1)
    if table.shape[0] != old[0] * old[1]:
        raise ValueError(f"relative-position table has {table.shape[0]} rows, not {old}")
    new = (2 * new_grid[0] - 1, 2 * new_grid[1] - 1)
    x = table.T.reshape(1, -1, *old).float()
    x = F.interpolate(x, size=new, mode="bicubic", align_corners=False)
    return x.reshape(-1, new[0] * new[1]).T.to(table.dtype).contiguous()


def grid_of_rel_table(rows: int, like: Grid) -> Grid:
    """The grid a table of ``rows`` rows was made for: square when ``rows`` is an odd square
    (checkpoints are trained on square inputs), else the factorisation with ``like``'s aspect
    ratio."""
    side = math.isqrt(rows)
    if side * side == rows and side % 2:
        return (side + 1) // 2, (side + 1) // 2
    for h in range(1, rows + 1):
        if rows % (2 * h - 1) == 0:
            w2 = rows // (2 * h - 1)
            if w2 % 2 and abs((w2 + 1) / 2 / h - like[1] / like[0]) < 1e-6:
                return h, (w2 + 1) // 2
    raise ValueError(f"cannot tell the grid of a relative-position table with {rows} rows")


# Specs a module gives for its absolute embeddings: name -> (grid built for, prefix tokens).
PosSpecs = Callable[[], dict[str, tuple[Grid, int]]]


def _parameter_or_buffer(module: nn.Module, name: str) -> torch.Tensor:
    """A learned embedding is a parameter, a fixed one (T2T's sinusoids) a buffer."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)


def register_resize_on_load(module: nn.Module, specs: PosSpecs, mode: str = "bicubic") -> None:
    """Let ``module.load_state_dict`` take position embeddings made for another grid: each
    named embedding whose token count differs is resized to the module's grid. A tensor whose
    other dimensions differ is left alone, for ``load_state_dict`` to report."""

    def hook(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, (grid, n_prefix) in specs().items():
            key = prefix + name
            old = state_dict.get(key)
            param = _parameter_or_buffer(module, name)
            if old is None or old.shape == param.shape:
                continue
            if old.shape[:-2] != param.shape[:-2] or old.shape[-1] != param.shape[-1]:
                continue
            old_grid = grid_from_tokens(old.shape[-2] - n_prefix)
            state_dict[key] = resize_pos_embed(old, old_grid, grid, n_prefix, mode)

    module._register_load_state_dict_pre_hook(hook)
