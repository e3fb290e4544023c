"""Pyramid Vision Transformer (PVT v1, Wang et al. 2021) on the shared core.

Four stages, each a strided patch embedding (conv + LayerNorm) that merges the previous
stage's tokens, a learned absolute position embedding, and pre-norm blocks whose attention
takes keys and values from a map reduced by ``sr_ratio``; a class token joins in stage 4 and
the head reads it. Stages can be made MLP-only and the merging module swapped, which is what
LIT and the LIT paper's PVT ablations (Tables 3 and 4) need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.base import StagedViT, pyramid_feature_info
from lgvit.models.convert import rename_keys
from lgvit.models.layers import (
    Attention,
    Block,
    Grid,
    Mlp,
    PatchEmbed,
    Stage,
    default_norm,
    drop_path_schedule,
    init_vit_weights,
    per_stage,
    to_2tuple,
)
from lgvit.models.registry import ModelConfig, lit_paper_speed, register_model

# merge_layer(in_dim, out_dim, stage_index) -> module(x, hw) -> (x, hw)
MergeFactory = Callable[[int, int, int], nn.Module]


def conv_merge(in_dim: int, out_dim: int, stage: int) -> nn.Module:
    """PVT's merging between stages: a 2x2 stride-2 conv + LayerNorm (eps 1e-5)."""
    return PatchEmbed(2, in_dim, out_dim, norm_layer=nn.LayerNorm)


class PyramidVisionTransformer(StagedViT):
    """PVT v1.

    Args:
        embed_dims, depths, num_heads, mlp_ratios, sr_ratios: per stage.
        attn_stages: which stages have attention; the others hold MLP-only blocks
            (``x + MLP(LN(x))``, LIT). Default: all.
        merge_layer: ``merge_layer(in_dim, out_dim, stage)`` merges tokens between stages
            (default: PVT's 2x2 conv + LayerNorm; LIT's deformable token merging).
        mlp_layer: the blocks' feed-forward (LocalViT passes the locality feed-forward).
        pos_resize_mode: interpolation of the absolute position embeddings for other grids.
    """

    stem_pattern = r"^patch_embed"
    dense_out_norms = "none"  # PVT's and LIT-Ti's dense backbones add no norm on the maps

    def __init__(
        self,
        img_size: int | Grid = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: Sequence[int] = (64, 128, 320, 512),
        depths: Sequence[int] = (2, 2, 2, 2),
        num_heads: Sequence[int] = (1, 2, 5, 8),
        mlp_ratios: Sequence[float] = (8, 8, 4, 4),
        sr_ratios: Sequence[int] = (8, 4, 2, 1),
        attn_stages: Sequence[int] | None = None,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        merge_layer: MergeFactory = conv_merge,
        mlp_layer: Callable[..., nn.Module] = Mlp,
        norm_layer: Callable[[int], nn.Module] = default_norm,
        patch_norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
        class_token: bool = True,
        pos_resize_mode: str = "bilinear",
    ) -> None:
        super().__init__()
        n = len(embed_dims)
        num_heads = per_stage(num_heads, n, "num_heads")
        mlp_ratios = per_stage(mlp_ratios, n, "mlp_ratios")
        sr_ratios = per_stage(sr_ratios, n, "sr_ratios")
        attn_stages = set(range(n) if attn_stages is None else attn_stages)
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.embed_dims = tuple(embed_dims)
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dims[0], patch_norm_layer)
        grids = [(self.img_size[0] // patch_size, self.img_size[1] // patch_size)]
        for _ in range(1, n):
            grids.append((grids[-1][0] // 2, grids[-1][1] // 2))
        if min(grids[-1]) < 1:
            raise ValueError(f"input {self.img_size} is too small for a {n}-stage pyramid")
        self.grids = grids
        dpr = drop_path_schedule(drop_path_rate, depths)

        def block(i: int, rate: float) -> Block:
            attn = (
                partial(Attention, sr_ratio=sr_ratios[i], norm_layer=nn.LayerNorm)
                if i in attn_stages
                else None
            )
            return Block(
                embed_dims[i], num_heads[i], mlp_ratio=mlp_ratios[i], qkv_bias=qkv_bias,
                drop=drop_rate, attn_drop=attn_drop_rate, drop_path=rate, attn_layer=attn,
                mlp_layer=mlp_layer, norm_layer=norm_layer,
            )  # fmt: skip

        self.stages = nn.ModuleList(
            Stage(
                [block(i, r) for r in dpr[i]],
                downsample=merge_layer(embed_dims[i - 1], embed_dims[i], i) if i else None,
                dim=embed_dims[i],
                pos_embed_grid=grids[i],
                cls_token=class_token and i == n - 1,
                pos_drop=drop_rate,
                pos_resize_mode=pos_resize_mode,
            )
            for i in range(n)
        )
        self.init_head(
            embed_dims[-1], num_classes, "token" if class_token else "avg", drop_rate, norm_layer
        )
        self.feature_info = pyramid_feature_info(embed_dims, patch_size)
        self.apply(partial(init_vit_weights, conv=False))

    def forward_stem(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        x = self.check_input(x)
        return self.patch_embed(x)

    def set_dense_mode(self) -> None:
        """Stage 4's class token (and its position row) left out, as PVT's and LIT-Ti's dense
        backbones do."""
        super().set_dense_mode()
        for m in self.modules():
            if isinstance(m, Stage):
                m.use_cls_token = False

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """The PVT authors' layout (``patch_embed{i}``, ``pos_embed{i}``, ``block{i}``,
        ``cls_token``) -> ours; lgvit checkpoints pass through."""
        if "patch_embed1.proj.weight" not in state_dict:
            return state_dict
        n = len(self.stages)
        sd = rename_keys(
            state_dict,
            [
                (r"^patch_embed1\.", "patch_embed."),
                (r"^patch_embed(\d)\.", lambda m: f"stages.{int(m[1]) - 1}.downsample."),
                (r"^pos_embed(\d)$", lambda m: f"stages.{int(m[1]) - 1}.pos_embed"),
                (r"^block(\d)\.", lambda m: f"stages.{int(m[1]) - 1}.blocks."),
                (r"^cls_token$", f"stages.{n - 1}.cls_token"),
            ],
        )
        # Their position embeddings are (1, N, C); a Stage keeps (N, C).
        return {k: v[0] if k.endswith(".pos_embed") and v.ndim == 3 else v for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# Registered baselines
# ---------------------------------------------------------------------------------------------


@register_model(
    config=ModelConfig(
        paper=dict(
            params_m=13.23, macs_g=1.93, imagenet_top1=75.1, **lit_paper_speed(1768, 4316, 1269)
        )
    )
)
def pvt_tiny(**kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Tiny: 64/128/320/512, depths 2-2-2-2 (the LocalViT paper's baseline)."""
    return PyramidVisionTransformer(**{"depths": (2, 2, 2, 2), **kwargs})


@register_model(
    config=ModelConfig(
        paper=dict(
            params_m=24.5, macs_g=3.8, imagenet_top1=79.8, **lit_paper_speed(1007, 6996, 1356)
        )
    )
)
def pvt_small(**kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Small: 64/128/320/512, depths 3-4-6-3 (LIT's skeleton)."""
    return PyramidVisionTransformer(**{"depths": (3, 4, 6, 3), **kwargs})
