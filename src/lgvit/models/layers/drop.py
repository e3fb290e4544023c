"""Stochastic depth: ``DropPath`` and the linear-in-depth schedule."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """Stochastic depth per sample: zero the residual branch of whole samples."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = x.new_empty(shape).bernoulli_(keep)
    if x.dtype in (torch.float32, torch.float64):
        return x * mask.div_(keep)  # one pass over x, as timm (x * mask / keep took two)
    return x * mask / keep  # 1/keep in bf16 would scale every kept sample ~0.2% too little


def residual_add(
    x: torch.Tensor, y: torch.Tensor, drop_prob: float = 0.0, training: bool = False
) -> torch.Tensor:
    """``x + drop_path(y)``: a block's residual and its branch's stochastic depth as one op.

    Training with a drop path: ``addcmul(x, y, mask / keep)``, one pass over the tensors where
    scaling the branch, then adding it, took two (three for a bf16 branch under autocast). The
    per-sample mask is drawn as :func:`drop_path` draws it (the same random numbers). A float32
    residual stream stays float32 (a bf16 branch is widened inside the op, as ``x + y`` does);
    a low-precision stream keeps :func:`drop_path`'s arithmetic."""
    if drop_prob == 0.0 or not training:
        return x + y
    if x.dtype not in (torch.float32, torch.float64):
        return x + drop_path(y, drop_prob, training)
    keep = 1.0 - drop_prob
    mask = y.new_empty((y.shape[0],) + (1,) * (y.ndim - 1)).bernoulli_(keep)
    return torch.addcmul(x, y, mask.to(x.dtype).div_(keep))


# torch.fx: one graph node (its arithmetic depends on the dtype).
torch.fx.wrap("drop_path")


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


def drop_path_schedule(rate: float, depths: Sequence[int]) -> list[list[float]]:
    """Drop-path rate of every block, rising linearly from 0 to ``rate`` over the whole depth,
    split per stage (DeiT/Swin's ``linspace(0, rate, total)``)."""
    total = sum(depths)
    rates = [rate * i / max(total - 1, 1) for i in range(total)]
    out, start = [], 0
    for d in depths:
        out.append(rates[start : start + d])
        start += d
    return out
