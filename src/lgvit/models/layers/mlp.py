"""The transformer feed-forward."""

from __future__ import annotations

import torch
import torch.nn as nn

from lgvit.models.layers.helpers import Grid


class Mlp(nn.Module):
    """Linear -> act -> Linear, token-wise.

    Every feed-forward takes ``(x, hw)`` so one that works on the token grid (a convolutional
    one) is a drop-in ``mlp_layer`` of :class:`Block`. Class attributes tell the block how to
    wrap it: ``pre_norm`` (a LayerNorm before it) and ``drop_path`` (stochastic depth on its
    residual branch).
    """

    pre_norm = True
    drop_path = True

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        out_features: int | None = None,
        act_layer: type[nn.Module] = nn.GELU,
        drop: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features or in_features, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, hw: Grid | None = None) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))
