"""LocalViT's locality feed-forward: the transformer MLP as 1x1 conv -> depth-wise 3x3 -> 1x1
conv on the token grid, with BatchNorm, an activation and optional channel attention.

Li, Zhang, Timofte, Van Gool, Cao, "LocalViT: Bringing Locality to Vision Transformers".
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.layers.helpers import Grid, num_prefix_tokens
from lgvit.models.layers.weight_init import trunc_normal_

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu6": nn.ReLU6,
    "hswish": nn.Hardswish,  # x * relu6(x + 3) / 6, the authors' h_swish
    "gelu": nn.GELU,
}


def _token_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of ``(B, N, C)``. For bf16 it is a matmul with ones (float32
    accumulation, no copy): ``mean(1)`` copies the whole tensor to float32 first on the CPU,
    measured 7.5 vs 0.7 ms per call at (64, 196, 768), 16% of a LocalViT-T batch. fp16 cannot
    hold the sum (65504 at most: 196 tokens of 335 overflow), so it reduces in float32 and
    divides before rounding (on CUDA one reduction kernel, no copy)."""
    if x.dtype == torch.float16:
        return x.mean(1, dtype=torch.float32).to(x.dtype)
    if x.dtype == torch.bfloat16:
        return torch.bmm(x.new_ones(x.shape[0], 1, x.shape[1]), x)[:, 0] / x.shape[1]
    return x.mean(1)


class SqueezeExcite(nn.Module):
    """avg-pool -> Linear(C, C // reduction) -> ReLU -> Linear -> h-sigmoid -> scale.

    ``reduction`` divides the channel count it is given (the EXPANDED width gC inside the
    locality feed-forward), as the authors' code does: reduction 192 at 768 channels is a
    4-wide bottleneck.
    """

    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        hidden = max(channels // reduction, 1)
        self.fc = nn.Sequential(
            nn.Linear(channels, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, channels),
            nn.Hardsigmoid(),
        )  # fmt: skip
        for m in self.fc:
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.fc(x.mean((2, 3))).to(x.dtype)[:, :, None, None]

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The same on tokens ``(B, N, C)`` (the pooling is over the tokens); in place when no
        gradient is recorded."""
        gate = self.fc(_token_mean(x)).to(x.dtype)[:, None, :]
        return x.mul_(gate) if not torch.is_grad_enabled() else x * gate


class EfficientChannelAttention(nn.Module):
    """ECA: avg-pool -> 1-D conv across channels (kernel from the channel count, no bias) ->
    sigmoid (or h-sigmoid) -> scale."""

    def __init__(self, channels: int, hard_sigmoid: bool = False, gamma: int = 2, b: int = 1):
        super().__init__()
        t = int(abs((math.log2(channels) + b) / gamma))
        k = t if t % 2 else t + 1  # 5 at 768 channels
        self.conv = nn.Conv1d(1, 1, k, padding=k // 2, bias=False)
        self.gate = nn.Hardsigmoid() if hard_sigmoid else nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.mean((2, 3))[:, None, :])  # (B, 1, C)
        return x * self.gate(y)[:, 0, :, None, None]

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The same on tokens ``(B, N, C)``."""
        return x * self.gate(self.conv(_token_mean(x)[:, None, :])).to(x.dtype)


class LocalityFeedForward(nn.Module):
    """1x1 conv C -> gC (no bias) -> BN -> act -> depth-wise 3x3 (no bias) -> BN -> act ->
    [channel attention] -> 1x1 conv gC -> C (no bias) -> BN, on the image tokens' grid.

    A drop-in ``mlp_layer`` of :class:`Block` (``hidden_features`` = g x C): there is no
    LayerNorm before it (``pre_norm = False``) and no drop path on its branch (``drop_path =
    False``); class tokens in front of the grid skip it (their update is zero).

    Args:
        act: ``relu6``, ``hswish`` or ``gelu`` (after the expansion and the depth-wise conv).
        channel_attn: ``None``, ``"se"``, ``"eca"`` (sigmoid) or ``"eca_hs"`` (h-sigmoid).
        reduction: SE bottleneck = gC // reduction.
        reduction_from_dim: if given, ``reduction = int(C * reduction_from_dim)`` instead (the
            authors' PVT uses the stage width, 1.0; their Swin a quarter of it, 0.25).
        depthwise: the depth-wise 3x3 conv (Table 1's "no DW" rows drop it).
    """

    pre_norm = False
    drop_path = False

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        act: str = "hswish",
        channel_attn: str | None = "se",
        reduction: int = 4,
        depthwise: bool = True,
        reduction_from_dim: float | None = None,
        **_: Any,  # the Block's act_layer / drop: this feed-forward has its own
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act {act!r} is not one of {sorted(ACTIVATIONS)}")
        c, h = in_features, hidden_features
        if reduction_from_dim is not None:
            reduction = max(int(c * reduction_from_dim), 1)
        self.expand = nn.Conv2d(c, h, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(h)
        self.act1 = ACTIVATIONS[act]()
        self.dwconv = nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False) if depthwise else None
        self.bn2 = nn.BatchNorm2d(h) if depthwise else None
        self.act2 = ACTIVATIONS[act]() if depthwise else None
        if channel_attn is None:
            self.attn = None
        elif channel_attn == "se":
            self.attn = SqueezeExcite(h, reduction)
        elif channel_attn in ("eca", "eca_hs"):
            self.attn = EfficientChannelAttention(h, hard_sigmoid=channel_attn == "eca_hs")
        else:
            raise ValueError(f"channel_attn {channel_attn!r}: one of None, 'se', 'eca', 'eca_hs'")
        self.project = nn.Conv2d(h, c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)

    def layers(self) -> list[nn.Module]:
        """The layers in order (the authors' ``nn.Sequential`` order)."""
        seq = [self.expand, self.bn1, self.act1]
        if self.dwconv is not None:
            seq += [self.dwconv, self.bn2, self.act2]
        if self.attn is not None:
            seq.append(self.attn)
        return seq + [self.project, self.bn3]

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, C, H, W)``: the branch, layer by layer as the authors' code
        runs it (the reference :meth:`forward` is tested against)."""
        for layer in self.layers():
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        """The branch on the tokens, without the residual (class tokens get a zero update).

        Tokens ``(B, H*W, C)`` are already the channels-last layout of the map, so the 1x1
        convolutions run as matmuls on them and only the depth-wise conv sees a (channels-last)
        map: no transposes or copies. In eval mode each BatchNorm is folded into the matmul or
        conv before it.
        """
        p = num_prefix_tokens(x, hw)
        t = x[:, p:]  # a view, x itself without class tokens
        B, N, _ = t.shape
        h = _activate(self.act1, _linear_bn(t, self.expand, self.bn1))
        if self.dwconv is not None:
            c = h.shape[-1]
            m = h.reshape(B, hw[0], hw[1], c).permute(0, 3, 1, 2)  # channels-last, no copy
            w, b = _folded(self.dwconv, self.bn2)
            m = F.conv2d(m, w, b, padding=1, groups=c)
            h = m.permute(0, 2, 3, 1).reshape(B, N, c)
            if b is None:  # training: batch statistics
                h = _batch_norm_tokens(h, self.bn2)
            h = _activate(self.act2, h)
        if self.attn is not None:
            h = self.attn.forward_tokens(h)
        return with_prefix_zeros(_linear_bn(h, self.project, self.bn3), p)


def with_prefix_zeros(y: torch.Tensor, p: int) -> torch.Tensor:
    """``y`` after ``p`` zero tokens (the class tokens' update), or ``y`` itself for none."""
    return torch.cat([y.new_zeros(y.shape[0], p, y.shape[2]), y], dim=1) if p else y


# torch.fx: one graph node each (the number of class tokens comes from shapes).
torch.fx.wrap("num_prefix_tokens")
torch.fx.wrap("with_prefix_zeros")
torch.fx.wrap("_token_mean")  # (it branches on the dtype)


def _activate(act: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The activation, in place when nothing keeps ``h`` for a backward pass: these tensors are
    the largest of the model and the copy is most of the op's cost (inference ~10% faster)."""
    if not torch.is_grad_enabled() and isinstance(act, nn.Hardswish | nn.ReLU6):
        return F.hardswish(h, inplace=True) if isinstance(act, nn.Hardswish) else F.relu6(h, True)
    return act(h)


def _folded(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv -> bn`` as one conv (weight, bias) in eval mode; ``(conv.weight, None)`` while
    training (the batch statistics are needed)."""
    if bn.training:
        return conv.weight, None
    scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
    w = conv.weight * scale[:, None, None, None]  # (not from .ndim: fx cannot read it)
    return w, bn.bias - bn.running_mean * scale


def _batch_norm_tokens(t: torch.Tensor, bn: nn.BatchNorm2d) -> torch.Tensor:
    """BatchNorm2d over tokens ``(B, N, C)``: statistics over batch and positions, as over the
    map (a ``(B*N, C, 1, 1)`` view)."""
    return bn(t.reshape(-1, t.shape[-1], 1, 1)).view_as(t)


def _linear_bn(t: torch.Tensor, conv: nn.Conv2d, bn: nn.BatchNorm2d) -> torch.Tensor:
    """A bias-free 1x1 conv + BatchNorm on tokens."""
    w, b = _folded(conv, bn)
    y = F.linear(t, w.flatten(1), b)
    return y if b is not None else _batch_norm_tokens(y, bn)
