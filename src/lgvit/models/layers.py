"""Building blocks shared by the model families, from small to large."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-6  # DeiT / the LSA authors' LayerNorm epsilon


def trunc_normal_(tensor: torch.Tensor, std: float = 0.02) -> torch.Tensor:
    """Truncated normal at +-2 std (ViT/DeiT initialisation)."""
    return nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-2 * std, b=2 * std)


def init_vit_weights(module: nn.Module) -> None:
    """DeiT initialisation: trunc-normal(0.02) linear and conv weights, zero biases, unit norms."""
    if isinstance(module, nn.Linear | nn.Conv2d):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm | nn.BatchNorm2d):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """Stochastic depth per sample: zero the residual branch of whole samples."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = x.new_empty(shape).bernoulli_(keep)
    return x * mask / keep


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """Identity whose backward makes the incoming gradient contiguous.

    A linear layer's backward with a permuted gradient runs ~2x slower on CPU than the copy
    that makes it contiguous (measured: 1.24 s vs 0.61 s for a 1.2M x 192 -> 128 projection).
    """
    return _ContiguousGrad.apply(x)


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class Mlp(nn.Module):
    """Transformer feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Attention(nn.Module):
    """Multi-head self-attention over all tokens, with grouped keys/values.

    ``kv_heads`` sets how many key/value heads there are: ``num_heads`` is standard multi-head
    attention, 1 is multi-query attention (one key/value head shared by every query head), as
    in the LSA paper's tiny CIFAR model.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kv_heads: int | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        kv_heads = kv_heads or num_heads
        if num_heads % kv_heads:
            raise ValueError(f"num_heads {num_heads} is not divisible by kv_heads {kv_heads}")
        self.num_heads = num_heads
        self.kv_heads = kv_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        g = self.num_heads // self.kv_heads
        # Query heads that share a key/value head are stacked along the sequence (grouped-query
        # trick): one (g*N x N) attention per key/value head instead of g separate ones.
        q = self.q(x).view(B, N, self.kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(B, self.kv_heads, g * N, self.head_dim)
        kv = self.kv(x).view(B, N, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        drop = self.attn_drop if self.training else 0.0
        x = F.scaled_dot_product_attention(q, kv[0], kv[1], dropout_p=drop)
        x = x.view(B, self.kv_heads, g, N, self.head_dim).permute(0, 3, 1, 2, 4).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + MSA(LN(x)), then x + MLP(LN(x)).

    ``attn_layer`` swaps the attention for another one with the same constructor arguments
    (the LSA local block uses it).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        kv_heads: int | None = None,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        attn_layer: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = (attn_layer or Attention)(dim, num_heads, kv_heads, qkv_bias, attn_drop, drop)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class ConvDownsample(nn.Module):
    """Tokens -> map -> conv3x3 (C_in -> C_out) -> LayerNorm over channels -> max-pool 3x3/2."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim_out, 3, stride=1, padding=1)
        self.norm = nn.LayerNorm(dim_out, eps=LN_EPS)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        B, N, C = x.shape
        x = self.conv(x.transpose(1, 2).reshape(B, C, *grid))
        x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.pool(x).flatten(2).transpose(1, 2)

    @staticmethod
    def out_grid(grid: tuple[int, int]) -> tuple[int, int]:
        return (grid[0] + 1) // 2, (grid[1] + 1) // 2


def conv_out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def resize_pos_embed(
    pos: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]
) -> torch.Tensor:
    """Bicubic resize of a position embedding ``(..., H*W, C)`` from one token grid to another."""
    if tuple(old_grid) == tuple(new_grid):
        return pos
    lead, (n, c) = pos.shape[:-2], pos.shape[-2:]
    if n != old_grid[0] * old_grid[1]:
        raise ValueError(f"position embedding has {n} tokens, not a {old_grid} grid")
    x = pos.reshape(-1, *old_grid, c).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=tuple(new_grid), mode="bicubic", align_corners=False)
    x = x.permute(0, 2, 3, 1).reshape(*lead, new_grid[0] * new_grid[1], c)
    return x.to(pos.dtype)


def grid_from_tokens(n: int) -> tuple[int, int]:
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"{n} tokens do not form a square grid")
    return side, side
