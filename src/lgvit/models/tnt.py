"""TNT (Han et al., "Transformer in Transformer") and its LocalViT variant.

Each 16x16 patch is also a 4x4 grid of "pixel" tokens (a 7x7 stride-4 conv of the image): an
inner transformer block attends among the pixels of each patch, their tokens are projected into
the patch token, then an outer block attends among the patches. The stages pass ``(pixels,
patches)`` on; the patch tokens are the features. LocalViT-TNT swaps only the outer
feed-forward for the locality one (g 4, h-swish + SE, reduction = the width).

Following the authors' (timm's) code: no bias in the q/k/v projections, LayerNorm epsilon 1e-5,
drop path on the inner branches too.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.base import StagedViT, block_feature_info
from lgvit.models.convert import rename_keys
from lgvit.models.layers import (
    Block,
    Grid,
    Mlp,
    drop_path_schedule,
    init_vit_weights,
    register_resize_on_load,
    resize_pos_embed,
    to_2tuple,
    trunc_normal_,
)
from lgvit.models.localvit import locality_ffn, map_authors_ffn_keys
from lgvit.models.registry import ModelConfig, register_model

# torch.fx: one graph node (it compares the grid with the built one).
torch.fx.wrap("resize_pos_embed")

Tokens = tuple[torch.Tensor, torch.Tensor]  # (pixel tokens (B*N, P, d), patch tokens (B, 1+N, C))


class PixelEmbed(nn.Module):
    """7x7 stride-``stride`` conv, then each patch's ``p x p`` pixels become its pixel tokens."""

    def __init__(self, in_chans: int, in_dim: int, patch_size: int = 16, stride: int = 4):
        super().__init__()
        self.pixels = math.ceil(patch_size / stride)  # pixels per patch side
        self.proj = nn.Conv2d(in_chans, in_dim, 7, stride=stride, padding=3)

    def forward(self, x: torch.Tensor, pixel_pos: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        B = x.shape[0]
        p = self.pixels
        x = self.proj(x)
        hw = (x.shape[-2] // p, x.shape[-1] // p)
        x = F.unfold(x, p, stride=p).transpose(1, 2)  # (B, N, d*p*p)
        x = x.reshape(B * hw[0] * hw[1], -1, p, p) + pixel_pos
        return x.flatten(2).transpose(1, 2), hw  # (B*N, p*p, d)


class TNTBlock(nn.Module):
    """Inner block over each patch's pixels -> pixels projected into the patch tokens -> outer
    block over the patches. ``forward((pixels, patches), hw)``."""

    def __init__(
        self, dim: int, in_dim: int, num_pixel: int, num_heads: int, in_num_heads: int,
        mlp_ratio: float, drop_path: float, mlp_layer: Any = Mlp, drop: float = 0.0,
        attn_drop: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        norm = nn.LayerNorm
        common = dict(qkv_bias=False, drop=drop, attn_drop=attn_drop, drop_path=drop_path)
        self.inner = Block(in_dim, in_num_heads, mlp_ratio=4.0, norm_layer=norm, **common)
        self.norm1_proj = norm(in_dim)
        self.proj = nn.Linear(in_dim * num_pixel, dim)
        self.outer = Block(
            dim, num_heads, mlp_ratio=mlp_ratio, norm_layer=norm, mlp_layer=mlp_layer, **common
        )

    def forward(self, x: Tokens, hw: Grid) -> Tokens:
        pixels, patches = x
        pixels = self.inner(pixels)
        B = patches.shape[0]
        update = self.proj(self.norm1_proj(pixels).reshape(B, hw[0] * hw[1], -1))
        patches = torch.cat([patches[:, :1], patches[:, 1:] + update], dim=1)
        return pixels, self.outer(patches, hw)


class TNT(StagedViT):
    """Transformer in Transformer: a plain (single-grid) model whose blocks pass pixel and
    patch tokens; class-token head."""

    stages_attr = "blocks"
    norm_intermediates = True
    stem_pattern = r"^(?:pixel_embed|norm1_proj|proj|norm2_proj|cls_token|patch_pos|pixel_pos)"
    no_weight_decay_patterns = ("cls_token", "patch_pos", "pixel_pos")

    def __init__(
        self,
        img_size: int | Grid = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        in_dim: int = 12,
        depth: int = 12,
        num_heads: int = 3,
        in_num_heads: int = 3,
        mlp_ratio: float = 4.0,
        first_stride: int = 4,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        mlp_layer: Any = Mlp,
    ) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.pixel_embed = PixelEmbed(in_chans, in_dim, patch_size, first_stride)
        p = self.pixel_embed.pixels
        self.grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        num_pixel = p * p
        self.norm1_proj = nn.LayerNorm(num_pixel * in_dim)
        self.proj = nn.Linear(num_pixel * in_dim, embed_dim)
        self.norm2_proj = nn.LayerNorm(embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.patch_pos = nn.Parameter(torch.zeros(1, 1 + self.grid[0] * self.grid[1], embed_dim))
        self.pixel_pos = nn.Parameter(torch.zeros(1, in_dim, p, p))
        self.pos_drop = nn.Dropout(drop_rate)
        register_resize_on_load(self, lambda: {"patch_pos": (self.grid, 1)})
        dpr = drop_path_schedule(drop_path_rate, [depth])[0]
        self.blocks = nn.ModuleList(
            TNTBlock(
                embed_dim, in_dim, num_pixel, num_heads, in_num_heads, mlp_ratio, dpr[i],
                mlp_layer, drop_rate, attn_drop_rate,
            )
            for i in range(depth)
        )  # fmt: skip
        self.init_head(embed_dim, num_classes, "token", drop_rate, nn.LayerNorm)
        self.feature_info = block_feature_info(embed_dim, patch_size, depth)
        self.apply(partial(init_vit_weights, conv=False))
        for t in (self.cls_token, self.patch_pos, self.pixel_pos):
            trunc_normal_(t, std=0.02)

    @property
    def num_prefix_tokens(self) -> int:  # type: ignore[override]
        return 1

    def tokens_of(self, x: Tokens) -> torch.Tensor:
        return x[1]

    def forward_stem(self, x: torch.Tensor) -> tuple[Tokens, Grid]:  # type: ignore[override]
        x = self.check_input(x)
        B = x.shape[0]
        pixels, hw = self.pixel_embed(x, self.pixel_pos)
        patches = self.norm2_proj(self.proj(self.norm1_proj(pixels.reshape(B, hw[0] * hw[1], -1))))
        patches = torch.cat([self.cls_token.expand(B, -1, -1).to(patches.dtype), patches], dim=1)
        pos = resize_pos_embed(self.patch_pos, self.grid, hw, 1)  # the same on the built grid
        return (pixels, self.pos_drop(patches + pos)), hw

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """The authors' (timm's) TNT layout -> ours: inner/outer blocks, ``qk`` + ``v``
        projections, the locality feed-forward as ``conv.conv.<i>``."""
        if not any(".attn_in." in k for k in state_dict):
            return state_dict
        sd = rename_keys(
            state_dict,
            [
                (r"\.norm_in\.", ".inner.norm1."),
                (r"\.attn_in\.", ".inner.attn."),
                (r"\.norm_mlp_in\.", ".inner.norm2."),
                (r"\.mlp_in\.", ".inner.mlp."),
                (r"\.norm_out\.", ".outer.norm1."),
                (r"\.attn_out\.", ".outer.attn."),
                (r"\.norm_mlp\.", ".outer.norm2."),
                (r"^(blocks\.\d+)\.mlp\.", r"\1.outer.mlp."),
                (r"^(blocks\.\d+)\.conv\.", r"\1.outer.conv."),
            ],
        )
        out = {}
        for k, v in sd.items():  # qk (q rows, then k rows) + v  ->  qkv (rows q, k, v)
            if k.endswith(".attn.qk.weight"):
                base = k[: -len("qk.weight")]
                out[base + "qkv.weight"] = torch.cat([v, sd[base + "v.weight"]])
            elif not k.endswith(".attn.v.weight"):
                out[k] = v
        return map_authors_ffn_keys(out, self)


# ---------------------------------------------------------------------------------------------
# Registered configurations
# ---------------------------------------------------------------------------------------------

_TNT_T = dict(embed_dim=192, in_dim=12, depth=12, num_heads=3, in_num_heads=3)
# Both were trained by the LocalViT authors' script, whose data pipeline normalises with the
# ImageNet mean/std and evaluates at a 256 -> 224 centre crop for every model (not timm's TNT
# defaults of 0.5/0.5 and 0.9).
_CFG = dict(crop_pct=0.875, first_conv="pixel_embed.proj")


@register_model(
    config=ModelConfig(**_CFG, paper=dict(params_m=6.07, macs_g=1.40, imagenet_top1=73.6))
)
def tnt_tiny(**kwargs: Any) -> TNT:
    """TNT-T: outer 192 wide, 12 blocks, 3 heads; inner 12 wide, 3 heads; 4x4 pixels a patch."""
    return TNT(**{**_TNT_T, **kwargs})


@register_model(
    config=ModelConfig(**_CFG, paper=dict(params_m=6.26, macs_g=1.42, imagenet_top1=75.9))
)
def localvit_tnt_tiny(**kwargs: Any) -> TNT:
    """LocalViT-TNT: TNT-T with the locality feed-forward as the outer feed-forward (g 4,
    h-swish + SE with reduction = the width)."""
    ffn = locality_ffn(reduction_from_dim=1.0)
    return TNT(**{**_TNT_T, "mlp_layer": ffn, **kwargs})
