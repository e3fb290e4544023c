"""Swin Transformer (Liu et al. 2021) on the shared core.

Patch embedding 4x4 + LayerNorm, four stages of pre-norm blocks with (shifted-)window attention
and a relative-position bias, patch merging (2x2 -> one token of twice the width) at the start
of stages 2-4, final LayerNorm, average pool, linear head. The attention of every block and the
merging module are factories, so LIT (MLP-only early stages, global attention with a bias over
the whole stage map, deformable token merging) and LocalViT-Swin (the locality feed-forward)
reuse this skeleton.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.base import StagedViT, pyramid_feature_info
from lgvit.models.convert import drop_keys, rename_keys
from lgvit.models.layers import (
    Block,
    Grid,
    Mlp,
    PatchEmbed,
    PatchMerging,
    Stage,
    WindowAttention,
    drop_path_schedule,
    init_vit_weights,
    per_stage,
    to_2tuple,
)
from lgvit.models.registry import ModelConfig, lit_paper_speed, register_model

# attn_factory(stage, block, grid) -> attention class for that block, or None (MLP-only)
AttnFactory = Callable[[int, int, Grid], Callable[..., nn.Module] | None]
MergeFactory = Callable[[int, int, int], nn.Module]


def window_attention(window: int = 7) -> AttnFactory:
    """Swin's attention: windows of ``window`` (the whole map when it is smaller), shifted by
    half a window in every second block."""

    def factory(stage: int, block: int, grid: Grid) -> Callable[..., nn.Module]:
        w = min(window, *grid)
        shift = 0 if block % 2 == 0 or min(grid) <= window else w // 2
        return partial(WindowAttention, window=w, shift=shift)

    return factory


def patch_merging(in_dim: int, out_dim: int, stage: int) -> nn.Module:
    return PatchMerging(in_dim, out_dim)


class SwinTransformer(StagedViT):
    """Swin.

    Args:
        embed_dim: stage-1 width; stage i is ``embed_dim * 2**i`` wide.
        depths, num_heads: per stage.
        attn_factory: attention of each block (default: shifted windows of ``window_size``).
        merge_layer: ``merge_layer(in_dim, out_dim, stage)`` (default: patch merging).
        mlp_layer: the blocks' feed-forward.
    """

    stem_pattern = r"^patch_embed"
    dense_built_for_input_size = True  # 512 for LIT's segmentation, 800 for detection

    def __init__(
        self,
        img_size: int | Grid = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.2,
        attn_factory: AttnFactory | None = None,
        merge_layer: MergeFactory = patch_merging,
        mlp_layer: Callable[..., nn.Module] = Mlp,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
        patch_norm_layer: Callable[[int], nn.Module] | None = nn.LayerNorm,
    ) -> None:
        super().__init__()
        n = len(depths)
        num_heads = per_stage(num_heads, n, "num_heads")
        attn_factory = attn_factory or window_attention(window_size)
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        dims = [embed_dim * 2**i for i in range(n)]
        self.patch_embed = PatchEmbed(patch_size, in_chans, dims[0], patch_norm_layer)
        self.pos_drop = nn.Dropout(drop_rate)
        grids = [(self.img_size[0] // patch_size, self.img_size[1] // patch_size)]
        for _ in range(1, n):
            grids.append(((grids[-1][0] + 1) // 2, (grids[-1][1] + 1) // 2))
        self.grids = grids
        dpr = drop_path_schedule(drop_path_rate, depths)
        self.stages = nn.ModuleList(
            Stage(
                [
                    Block(
                        dims[i], num_heads[i], mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                        drop=drop_rate, attn_drop=attn_drop_rate, drop_path=dpr[i][j],
                        attn_layer=attn_factory(i, j, grids[i]), mlp_layer=mlp_layer,
                        norm_layer=norm_layer,
                    )
                    for j in range(depths[i])
                ],
                downsample=merge_layer(dims[i - 1], dims[i], i) if i else None,
            )
            for i in range(n)
        )  # fmt: skip
        self.init_head(dims[-1], num_classes, "avg", drop_rate, norm_layer)
        self.feature_info = pyramid_feature_info(dims, patch_size)
        self.apply(partial(init_vit_weights, conv=False))

    def forward_stem(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        x = self.check_input(x)
        x, hw = self.patch_embed(x)
        return self.pos_drop(x), hw

    def dense_size_divisor(self) -> int:
        """The patch size: Swin's dense backbones pad the input to it, as its PatchEmbed does."""
        return self.feature_info[0]["reduction"]

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """The Swin authors' layout (``layers.i.blocks.j``, merging at the end of stage i,
        fused ``qkv``, stored masks and indices) and timm's (merging at the start of stage i,
        ``head.fc``) -> ours; lgvit checkpoints pass through."""
        if not any(k.startswith("layers.") for k in state_dict):
            return state_dict
        sd = drop_keys(state_dict, r"(relative_position_index|attn_mask)$")
        # The authors merge at the end of stage i (so stage 0 has one); timm, as we do, at the
        # start of stage i + 1.
        shift = int(any(k.startswith("layers.0.downsample.") for k in sd))
        sd = rename_keys(
            sd,
            [
                (r"^layers\.(\d+)\.downsample\.",
                 lambda m: f"stages.{int(m[1]) + shift}.downsample."),
                (r"^head\.fc\.", "head."),
                (r"^layers\.(\d+)\.blocks\.", r"stages.\1.blocks."),
                (r"attn\.relative_position_bias_table$",
                 "attn.rel_pos.relative_position_bias_table"),
            ],
        )  # fmt: skip
        return sd


# ---------------------------------------------------------------------------------------------
# Registered baseline
# ---------------------------------------------------------------------------------------------


SWIN_CFG = dict(crop_pct=0.9, smoke_input_size=(3, 112, 112))  # windows of 7 need grids of 7k


@register_model(
    config=ModelConfig(
        **SWIN_CFG,
        paper=dict(
            params_m=28.3, macs_g=4.5, imagenet_top1=81.3, **lit_paper_speed(961, 6211, 1493)
        ),
    )
)
def swin_tiny(**kwargs: Any) -> SwinTransformer:
    """Swin-T: 96 x 2^i, depths 2-2-6-2, heads 3-6-12-24, window 7, drop path 0.2."""
    return SwinTransformer(**kwargs)
