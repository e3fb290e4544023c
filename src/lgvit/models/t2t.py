"""T2T-ViT (Yuan et al., "Tokens-to-Token ViT") and its LocalViT variant.

The tokens-to-token embedding re-structures the image progressively: three soft splits
(overlapping unfolds: 7x7 stride 4, then 3x3 stride 2 twice), with a performer layer (linear
attention through fixed random features) after each of the first two, then a linear projection.
A ViT follows (class token, fixed sinusoidal positions). The LocalViT variant swaps the
feed-forwards for the locality feed-forward: in the backbone blocks (g 2, h-swish + SE) and in
the two performers (g 1, h-swish, no SE).

The performers' random features and the sinusoidal positions are fixed: the authors keep them
as Parameters that do not train, lgvit as persistent buffers, so the checkpoint keys are the
authors' and every parameter trains (as timm's tests ask). The parameter counts are then the
trained ones, as the authors' DeiT-based scripts count them: 4.26M for T2T-ViT-7 and 4.33M for
LocalViT-T2T (both papers: 4.3M). Following the authors' code: no bias in the backbone's
qkv. The backbone's attention logit scale: T2T-ViT-7 uses ``1/sqrt(embed_dim)``, which the
T2T authors' released weights need (their "wrong scale" note); LocalViT-T2T uses the usual
``1/sqrt(head_dim)``, as the LocalViT authors' training (a model built without ``pretrained``)
does. ``qk_scale=`` overrides either.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.convert import drop_keys, rename_keys
from lgvit.models.layers import (
    Attention,
    Grid,
    LocalityFeedForward,
    Mlp,
    contiguous_grad,
    conv_out_size,
    to_2tuple,
    tokens_to_map,
)
from lgvit.models.localvit import locality_ffn, map_authors_ffn_keys
from lgvit.models.registry import ModelConfig, register_model
from lgvit.models.vit import VisionTransformer


def performer_attention(
    k: torch.Tensor, q: torch.Tensor, v: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Linear attention through the positive random features ``phi(x) = exp(w x - |x|^2 / 2) /
    sqrt(m)`` of ``w (m, dim)``, in float32, autocast or not: rounding the exponent's argument
    to bfloat16 moves kernel weights by up to a few percent (seen at random init already)."""

    def features(x: torch.Tensor) -> torch.Tensor:
        sq = x.square().sum(-1, keepdim=True) / 2
        return torch.exp(x @ w.float().T - sq) / math.sqrt(w.shape[0])

    amp = k.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(k.device.type)
    with torch.autocast(k.device.type, enabled=False) if amp else contextlib.nullcontext():
        kp, qp = features(k.float()), features(q.float())  # (B, T, m)
        denom = qp @ kp.sum(1, keepdim=True).transpose(1, 2)  # (B, T, 1)
        return (qp @ (kp.transpose(1, 2) @ v.float())) / (denom + 1e-8)


# torch.fx: one graph node (the autocast check reads the input's device).
torch.fx.wrap("performer_attention")


# One node: torch.fx cannot trace into the autograd.Function behind it. The map a performer's
# tokens become sends back a transposed gradient, and torch.compile's (AOT autograd's) backward
# of the performer's Linear views it, which fails ("view size is not compatible"): made
# contiguous here, as eager's reshape copies it anyway.
torch.fx.wrap("contiguous_grad")


class TokenPerformer(nn.Module):
    """T2T's performer layer: ``v + proj(linear_attention(LN(x)))``, then a feed-forward.

    Linear attention with positive random features ``phi(x) = exp(w x - |x|^2 / 2) / sqrt(m)``
    (``m = in_dim * kernel_ratio`` fixed orthogonal features), one head; the values are the
    skip connection (the width changes from ``dim`` to ``in_dim``). The attention runs in
    float32, under autocast too. ``local=True``: the feed-forward is the locality one, without
    its LayerNorm.
    """

    def __init__(
        self, dim: int, in_dim: int, kernel_ratio: float = 0.5, drop: float = 0.1,
        local: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_dim = in_dim
        self.norm1 = nn.LayerNorm(dim)
        self.kqv = nn.Linear(dim, 3 * in_dim)
        self.proj = nn.Linear(in_dim, in_dim)
        self.dp = nn.Dropout(drop)
        self.m = int(in_dim * kernel_ratio)
        w = nn.init.orthogonal_(torch.randn(self.m, in_dim)) * math.sqrt(self.m)
        self.register_buffer("w", w)  # fixed random features: in checkpoints, never trained
        self.local = local
        if local:
            self.mlp = LocalityFeedForward(in_dim, in_dim, act="hswish", channel_attn=None)
        else:
            self.norm2 = nn.LayerNorm(in_dim)
            self.mlp = Mlp(in_dim, in_dim)
        # dropout after the feed-forward only (the authors' has none between its two linears)
        self.mlp_drop = nn.Dropout(drop) if not local else nn.Identity()

    def _attend(self, k: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return performer_attention(k, q, v, self.w)

    def forward(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        k, q, v = self.kqv(self.norm1(x)).split(self.in_dim, dim=-1)
        y = self._attend(k, q, v)
        x = v + self.dp(self.proj(y.to(v.dtype)))
        if self.local:
            return x + self.mlp(x, hw)
        return x + self.mlp_drop(self.mlp(self.norm2(x)))


class TokensToToken(nn.Module):
    """Soft split 7x7/4 -> performer -> soft split 3x3/2 -> performer -> soft split 3x3/2 ->
    Linear: an image to ``(B, H/16 * W/16, embed_dim)`` tokens."""

    SPLITS = ((7, 4, 2), (3, 2, 1), (3, 2, 1))  # (kernel, stride, padding)

    def __init__(
        self, img_size: Grid, in_chans: int, embed_dim: int, token_dim: int = 64,
        local: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        (k0, _, _), (k1, _, _), _ = self.SPLITS
        self.attention1 = TokenPerformer(in_chans * k0 * k0, token_dim, local=local)
        self.attention2 = TokenPerformer(token_dim * k1 * k1, token_dim, local=local)
        self.project = nn.Linear(token_dim * 9, embed_dim)

    def grid_for(self, img_size: int | Grid) -> Grid:
        h, w = to_2tuple(img_size)
        for k, s, p in self.SPLITS:
            h, w = conv_out_size(h, k, s, p), conv_out_size(w, k, s, p)
        if min(h, w) < 1:
            raise ValueError(f"input {img_size} is too small for the tokens-to-token splits")
        return h, w

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        hw = (x.shape[-2], x.shape[-1])
        for i, (k, s, p) in enumerate(self.SPLITS):
            if i:
                x = tokens_to_map(contiguous_grad(x), hw)
            hw = (conv_out_size(hw[0], k, s, p), conv_out_size(hw[1], k, s, p))
            x = F.unfold(x, k, padding=p, stride=s).transpose(1, 2)  # (B, h*w, C*k*k)
            if i < 2:
                x = (self.attention1 if i == 0 else self.attention2)(x, hw)
        return self.project(x), hw


class T2TViT(VisionTransformer):
    """T2T-ViT: the tokens-to-token embedding on a ViT with fixed sinusoidal positions."""

    def __init__(
        self, local_t2t: bool = False, token_dim: int = 64, qk_scale: float | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        embed = partial(_t2t_embedding, token_dim=token_dim, local=local_t2t)
        kwargs.setdefault("attn_layer", partial(Attention, qk_scale=qk_scale))
        super().__init__(embed_layer=embed, learned_pos=False, **kwargs)

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """The authors' layout: ``tokens_to_token``, performer ``mlp.0/2``, fused qkv, the
        locality feed-forwards as ``conv.conv.<i>``; their local performers keep an unused
        ``norm2``."""
        if not any(k.startswith("tokens_to_token.") for k in state_dict):
            return state_dict
        sd = rename_keys(
            state_dict,
            [
                (r"^tokens_to_token\.", "patch_embed."),
                (r"(attention\d)\.mlp\.0\.", r"\1.mlp.fc1."),
                (r"(attention\d)\.mlp\.2\.", r"\1.mlp.fc2."),
            ],
        )
        if isinstance(self.patch_embed.attention1.mlp, LocalityFeedForward):
            sd = drop_keys(sd, r"attention\d\.norm2\.")
        return map_authors_ffn_keys(super().checkpoint_filter_fn(sd), self)


def _t2t_embedding(img_size: Grid, in_chans: int, embed_dim: int, **kw: Any) -> TokensToToken:
    return TokensToToken(img_size, in_chans, embed_dim, **kw)


# ---------------------------------------------------------------------------------------------
# Registered configurations
# ---------------------------------------------------------------------------------------------

_T2T_7 = dict(
    embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, qkv_bias=False, drop_path_rate=0.1,
    norm_layer=nn.LayerNorm,
)  # fmt: skip
# The first layer on the image: the performer's projection of the unfolded 7x7 patches.
_CFG = dict(first_conv="patch_embed.attention1.kqv")


@register_model(  # the T2T authors evaluate at a 0.9 centre crop
    config=ModelConfig(
        **_CFG, crop_pct=0.9, paper=dict(params_m=4.3, macs_g=1.15, imagenet_top1=71.7)
    )
)
def t2t_vit_7(**kwargs: Any) -> T2TViT:
    """T2T-ViT-7: performer tokens-to-token (token dim 64), 256 wide, depth 7, 4 heads, mlp 2;
    logit scale ``1/sqrt(256)`` (the T2T authors' released weights)."""
    return T2TViT(**{**_T2T_7, "qk_scale": 256**-0.5, **kwargs})


@register_model(  # the LocalViT authors' script evaluates at a 256 -> 224 centre crop
    config=ModelConfig(
        **_CFG, crop_pct=0.875, paper=dict(params_m=4.3, macs_g=1.15, imagenet_top1=72.5)
    )
)
def localvit_t2t_vit_7(**kwargs: Any) -> T2TViT:
    """LocalViT-T2T: T2T-ViT-7 with the locality feed-forward (g 2, h-swish + SE, reduction 128)
    in the blocks and (g 1, h-swish) in the tokens-to-token performers; logit scale
    ``1/sqrt(head_dim)``."""
    ffn = locality_ffn(reduction=128)
    return T2TViT(**{**_T2T_7, "mlp_layer": ffn, "local_t2t": True, **kwargs})
