"""Plain vision transformers (ViT / DeiT): one grid of tokens through a stack of blocks.

``VisionTransformer`` is DeiT's architecture on the shared core: patch embedding, class token,
learned position embedding, pre-norm blocks, final LayerNorm, class-token head. Other families
reuse it by passing their own pieces: ``embed_layer`` (T2T-ViT's tokens-to-token module),
``mlp_layer`` (LocalViT's locality feed-forward, one per block if a sequence), a fixed
sinusoidal position embedding (T2T-ViT).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.base import StagedViT, block_feature_info
from lgvit.models.layers import (
    Block,
    Grid,
    Mlp,
    PatchEmbed,
    default_norm,
    drop_path_schedule,
    grid_differs,
    init_vit_weights,
    register_resize_on_load,
    resize_pos_embed,
    to_2tuple,
    trunc_normal_,
)
from lgvit.models.registry import ModelConfig, lit_paper_speed, register_model


def sinusoid_table(n: int, dim: int) -> torch.Tensor:
    """``(n, dim)`` fixed sinusoidal position table (Transformer / T2T-ViT)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(dim)[None]
    angle = pos / torch.pow(10000.0, 2 * (i // 2) / dim)
    table = torch.where(i % 2 == 0, torch.sin(angle), torch.cos(angle))
    return table.float()


def pos_embed_for(
    pos: torch.Tensor, built: Grid, grid: Grid, prefix: int, image: torch.Tensor,
    img_size: Grid, dynamic: bool,
) -> torch.Tensor:  # fmt: skip
    """The position embedding ``pos`` (built for the ``built`` grid) for tokens on ``grid``:
    resized, or -- unless ``dynamic`` -- an error naming the ``image``'s size and the one the
    model takes. One torch.fx graph node (it branches on the grid)."""
    if not grid_differs(grid, built):
        return pos
    if not dynamic:
        raise ValueError(
            f"input {image.shape[-2]}x{image.shape[-1]} gives a {grid[0]}x{grid[1]} token grid "
            f"but the model takes {img_size[0]}x{img_size[1]} images ({built[0]}x{built[1]} "
            "tokens); create it with img_size=... or dynamic_img_size=True"
        )
    return resize_pos_embed(pos, built, grid, prefix)


torch.fx.wrap("pos_embed_for")


class VisionTransformer(StagedViT):
    """ViT / DeiT.

    Args:
        embed_layer: ``embed_layer(img_size, in_chans, embed_dim) -> module`` with
            ``forward(img) -> (tokens, grid)`` and a ``grid_for(img_size)`` method; default a
            ``patch_size`` conv.
        mlp_layer: the blocks' feed-forward, or one per block.
        attn_layer: the blocks' attention.
        learned_pos: learned position embedding (DeiT) or a fixed sinusoidal one (T2T-ViT).
        global_pool: ``token`` (class token, DeiT) or ``avg``.
    """

    stages_attr = "blocks"
    norm_intermediates = True

    def __init__(
        self,
        img_size: int | Grid = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        embed_layer: Callable[..., nn.Module] | None = None,
        mlp_layer: Callable[..., nn.Module] | Sequence[Callable[..., nn.Module]] = Mlp,
        attn_layer: Callable[..., nn.Module] | None = None,
        norm_layer: Callable[[int], nn.Module] = default_norm,
        act_layer: type[nn.Module] = nn.GELU,
        class_token: bool = True,
        learned_pos: bool = True,
        global_pool: str = "token",
        dynamic_img_size: bool = False,
    ) -> None:
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.dynamic_img_size = dynamic_img_size
        if embed_layer is None:
            self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
            if self.img_size[0] % patch_size or self.img_size[1] % patch_size:
                raise ValueError(f"input {self.img_size} is not divisible by patch {patch_size}")
            self.grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
            stride = patch_size
        else:
            self.patch_embed = embed_layer(self.img_size, in_chans, embed_dim)
            self.grid = self.patch_embed.grid_for(self.img_size)
            stride = self.img_size[0] // self.grid[0]
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        n = int(class_token) + self.grid[0] * self.grid[1]
        if learned_pos:
            self.pos_embed = nn.Parameter(torch.zeros(1, n, embed_dim))
        else:  # fixed, so a persistent buffer: in checkpoints under the authors' key, not trained
            self.register_buffer("pos_embed", sinusoid_table(n, embed_dim)[None])
        self.pos_drop = nn.Dropout(drop_rate)
        register_resize_on_load(self, lambda: {"pos_embed": (self.grid, int(class_token))})

        mlps = list(mlp_layer) if isinstance(mlp_layer, Sequence) else [mlp_layer] * depth
        if len(mlps) != depth:
            raise ValueError(f"{len(mlps)} mlp layers for {depth} blocks")
        dpr = drop_path_schedule(drop_path_rate, [depth])[0]
        extra = {"attn_layer": attn_layer} if attn_layer is not None else {}
        self.blocks = nn.ModuleList(
            Block(
                embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
                attn_drop=attn_drop_rate, drop_path=dpr[i], mlp_layer=mlps[i],
                norm_layer=norm_layer, act_layer=act_layer, **extra,
            )
            for i in range(depth)
        )  # fmt: skip
        self.init_head(embed_dim, num_classes, global_pool, drop_rate, norm_layer)
        self.feature_info = block_feature_info(embed_dim, stride, depth)
        self.apply(partial(init_vit_weights, conv=False))
        if learned_pos:
            trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)

    @property
    def num_prefix_tokens(self) -> int:  # type: ignore[override]
        return int(self.cls_token is not None)

    def forward_stem(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        image = self.check_input(x)
        x, hw = self.patch_embed(image)
        pos = pos_embed_for(self.pos_embed, self.grid, hw, self.num_prefix_tokens, image,
                            self.img_size, self.dynamic_img_size)  # fmt: skip
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return self.pos_drop(x + pos), hw

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """timm / DeiT layout: lgvit's own (the fused ``attn.qkv`` included)."""
        return state_dict


# ---------------------------------------------------------------------------------------------
# Registered baselines (DeiT, Touvron et al. 2021)
# ---------------------------------------------------------------------------------------------


def _cfg(**paper: Any) -> ModelConfig:
    return ModelConfig(crop_pct=0.875, paper=paper)


def deit(kwargs: dict[str, Any], **defaults: Any) -> VisionTransformer:
    return VisionTransformer(**{**defaults, **kwargs})


DEIT_TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
DEIT_SMALL = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)


@register_model(
    config=_cfg(params_m=5.72, macs_g=1.25, imagenet_top1=72.2, **lit_paper_speed(3398, 2170, 314))
)
def deit_tiny(**kwargs: Any) -> VisionTransformer:
    """DeiT-Tiny: 192 wide, 12 blocks, 3 heads, patch 16 (the LocalViT paper's baseline)."""
    return deit(kwargs, **DEIT_TINY, drop_path_rate=0.1)


@register_model(
    config=_cfg(params_m=22.05, macs_g=4.60, imagenet_top1=79.8, **lit_paper_speed(1551, 4550, 713))
)
def deit_small(**kwargs: Any) -> VisionTransformer:
    """DeiT-Small: 384 wide, 12 blocks, 6 heads, patch 16."""
    return deit(kwargs, **DEIT_SMALL, drop_path_rate=0.1)
