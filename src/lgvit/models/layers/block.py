"""The one transformer block every family builds from."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from lgvit.models.layers.attention import LN_EPS, Attention
from lgvit.models.layers.drop import DropPath, residual_add
from lgvit.models.layers.helpers import Grid
from lgvit.models.layers.mlp import Mlp

default_norm = partial(nn.LayerNorm, eps=LN_EPS)


def _unwrap(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """The class behind ``functools.partial`` layers (their class attributes count)."""
    while isinstance(factory, partial):
        factory = factory.func
    return factory


class Block(nn.Module):
    """Pre-norm block: ``x + MSA(LN(x))``, then ``x + FFN(LN(x))``; ``forward(x, hw)``.

    Args:
        attn_layer: built as ``attn_layer(dim, num_heads, qkv_bias=, attn_drop=, proj_drop=)``
            and called as ``attn(x, hw)``; bind its own options with ``functools.partial``
            (``partial(Attention, sr_ratio=8)``). ``None`` makes an MLP-only block
            (``x + MLP(LN(x))``, LIT's early stages).
        mlp_layer: built as ``mlp_layer(dim, hidden, act_layer=, drop=)`` and called as
            ``mlp(x, hw)``, so a feed-forward on the token grid fits; its ``pre_norm`` and
            ``drop_path`` class attributes say whether a LayerNorm precedes it and whether
            stochastic depth applies to its branch (the locality feed-forward has neither).
        norm_layer, act_layer: the norm and activation classes.
        drop_path: stochastic-depth rate of this block.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        *,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        attn_layer: Callable[..., nn.Module] | None = Attention,
        mlp_layer: Callable[..., nn.Module] = Mlp,
        norm_layer: Callable[[int], nn.Module] = default_norm,
        act_layer: type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        if attn_layer is not None:
            self.norm1 = norm_layer(dim)
            self.attn = attn_layer(
                dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop
            )
            self.drop_path1 = DropPath(drop_path)
        else:
            self.attn = None
        mlp_cls = _unwrap(mlp_layer)
        self.norm2 = norm_layer(dim) if getattr(mlp_cls, "pre_norm", True) else nn.Identity()
        self.mlp = mlp_layer(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        mlp_drop_path = getattr(mlp_cls, "drop_path", True)
        self.drop_path2 = DropPath(drop_path) if mlp_drop_path else nn.Identity()

    def residual(self, x: torch.Tensor, y: torch.Tensor, drop: nn.Module) -> torch.Tensor:
        """``x + drop(y)`` as one op (:func:`residual_add`); ``drop`` is the branch's
        :class:`DropPath` (its rate read per call: the authors' LSA models set it after
        construction) or ``nn.Identity`` (no stochastic depth)."""
        return residual_add(x, y, getattr(drop, "drop_prob", 0.0), self.training)

    def forward(self, x: torch.Tensor, hw: Grid | None = None) -> torch.Tensor:
        if self.attn is not None:
            x = self.residual(x, self.attn(self.norm1(x), hw), self.drop_path1)
        return self.residual(x, self.mlp(self.norm2(x), hw), self.drop_path2)


# torch.fx: one graph node (its arithmetic depends on the dtype and the rate); fx.wrap takes
# effect in the module that calls the function, which is this one.
torch.fx.wrap("residual_add")
