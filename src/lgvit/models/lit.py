"""LIT (Pan, Zhuang, He, Liu, Cai, "Less is More: Pay Less Attention in Vision Transformers").

Early stages hold MLP-only blocks (``x + MLP(LN(x))``: no attention where the maps are large and
attention would be mostly local), later stages pre-norm global attention, and tokens are merged
between stages by :class:`~lgvit.models.layers.DeformableTokenMerging`, which learns where to
sample. LIT-Ti is built on the PVT-S skeleton (absolute positions per stage, class token in
stage 4, no spatial reduction); LIT-S/M/B on the Swin skeleton (a relative-position bias over
the whole stage map instead of windows; average-pooled head). This file holds the attention and
merging factories, the mapping of the authors' checkpoints, and the registered configurations:
the four LIT models and the paper's ablations (Tables 2-4).

Where we follow the authors' code: LIT-Ti's LayerNorm epsilon is 1e-6 in the blocks and 1e-5
in the first patch embedding, S/M/B use 1e-5 everywhere; only the offset conv's weight trains
at 0.01 x the learning rate (``offset_lr_factor``). Unlike their code, any input size whose
grids form works (position embeddings and bias tables are resized), odd batch sizes are fine,
and the deformable convolution runs without a CUDA extension: ``deform_impl`` (``"auto"``,
``"torchvision"``, ``"pure"``; :class:`~lgvit.models.layers.DeformConv2d`) chooses its kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.convert import rename_keys
from lgvit.models.layers import (
    Attention,
    DeformableTokenMerging,
    Grid,
    PatchMerging,
    set_deform_impl,
)
from lgvit.models.layers.deform import check_deform_impl
from lgvit.models.pvt import PyramidVisionTransformer, conv_merge
from lgvit.models.registry import (
    ModelArgumentError,
    ModelConfig,
    lit_paper_speed,
    register_model,
)
from lgvit.models.swin import SwinTransformer


def dtm_merge(in_dim: int, out_dim: int, stage: int) -> nn.Module:
    """Deformable token merging between stages (2x2, stride 2)."""
    return DeformableTokenMerging(in_dim, out_dim)


def uniform_merge(in_dim: int, out_dim: int, stage: int) -> nn.Module:
    """Swin's plain 2x2 patch merging (LIT-S*'s uniform merging, Table 2)."""
    return PatchMerging(in_dim, out_dim)


def global_attention(mlp_stages: int = 2) -> Callable[[int, int, Grid], Any]:
    """LIT-S/M/B attention: none in the first ``mlp_stages`` stages, then global attention with
    a relative-position bias over the whole stage map."""

    def factory(stage: int, block: int, grid: Grid) -> Any:
        return None if stage < mlp_stages else partial(Attention, rel_pos_grid=grid)

    return factory


_DTM_RENAMES = [
    (r"downsample\.dconv\.conv_offset\.", "downsample.offset_conv."),
    (r"downsample\.dconv\.", "downsample.conv."),
    (r"downsample\.norm_layer\.", "downsample.norm."),
]


def _deform_impl(impl: object) -> str:
    """``deform_impl`` checked before anything is built (a bad one: one line)."""
    try:
        return check_deform_impl(impl)
    except ValueError as e:
        raise ModelArgumentError(str(e)) from None


class LITPyramid(PyramidVisionTransformer):
    """LIT-Ti and the PVT-S ablations: the PVT skeleton with MLP-only stages and DTM.
    ``deform_impl``: the deformable kernel of its DTM layers (not saved with the weights)."""

    def __init__(self, *args: Any, deform_impl: str = "auto", **kwargs: Any) -> None:
        impl = _deform_impl(deform_impl)
        super().__init__(*args, **kwargs)
        set_deform_impl(self, impl)

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """The LIT-Ti authors' layout (PVT's, plus ``dconv``/``norm_layer`` and fused qkv)."""
        sd = super().checkpoint_filter_fn(state_dict)
        return rename_keys(sd, _DTM_RENAMES)


class LITSwin(SwinTransformer):
    """LIT-S/M/B and the Swin ablation: the Swin skeleton with global attention and DTM.
    ``deform_impl``: as :class:`LITPyramid`'s."""

    def __init__(self, *args: Any, deform_impl: str = "auto", **kwargs: Any) -> None:
        impl = _deform_impl(deform_impl)
        super().__init__(*args, **kwargs)
        set_deform_impl(self, impl)

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        """The LIT-S/M/B authors' layout (Swin's, plus ``dconv``/``norm_layer``)."""
        return rename_keys(super().checkpoint_filter_fn(state_dict), _DTM_RENAMES)


# ---------------------------------------------------------------------------------------------
# Registered configurations
# ---------------------------------------------------------------------------------------------

_PVT_S = dict(depths=(3, 4, 6, 3))
_LIT_TI = dict(
    _PVT_S, sr_ratios=1, attn_stages=(2, 3), merge_layer=dtm_merge, drop_path_rate=0.1,
    norm_layer=partial(nn.LayerNorm, eps=1e-6), pos_resize_mode="bilinear",
)  # fmt: skip
_LIT_S = dict(
    embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24),
    attn_factory=global_attention(2), merge_layer=dtm_merge, drop_path_rate=0.2,
)  # fmt: skip
_LIT_M = dict(_LIT_S, depths=(2, 2, 18, 2), drop_path_rate=0.3)
_LIT_B = dict(_LIT_M, embed_dim=128, num_heads=(4, 8, 16, 32), drop_path_rate=0.5)


def _cfg(**paper: Any) -> ModelConfig:
    return ModelConfig(crop_pct=0.875, paper=paper)


@register_model(
    config=_cfg(
        params_m=19.89, macs_g=3.61, imagenet_top1=81.1, **lit_paper_speed(1294, 5868, 1194)
    )
)
def lit_ti(**kwargs: Any) -> LITPyramid:
    """LIT-Ti: PVT-S skeleton (64/128/320/512, depths 3-4-6-3), MLP-only stages 1-2, global
    attention in 3-4, deformable token merging, class token in stage 4."""
    return LITPyramid(**{**_LIT_TI, **kwargs})


@register_model(
    config=_cfg(
        params_m=27.97, macs_g=4.08, imagenet_top1=81.5, **lit_paper_speed(1298, 5973, 1264)
    )
)
def lit_s(**kwargs: Any) -> LITSwin:
    """LIT-S: Swin-T skeleton, MLP-only stages 1-2, global attention with a relative-position
    bias over the stage map in 3-4, deformable token merging."""
    return LITSwin(**{**_LIT_S, **kwargs})


@register_model(
    config=_cfg(
        params_m=49.37, macs_g=8.59, imagenet_top1=83.0, **lit_paper_speed(638, 12248, 1473)
    )
)
def lit_m(**kwargs: Any) -> LITSwin:
    """LIT-M: LIT-S with Swin-S depths 2-2-18-2."""
    return LITSwin(**{**_LIT_M, **kwargs})


@register_model(
    config=_cfg(
        params_m=87.29, macs_g=15.03, imagenet_top1=83.4, **lit_paper_speed(444, 16766, 2150)
    )
)
def lit_b(**kwargs: Any) -> LITSwin:
    """LIT-B: LIT-M at Swin-B widths (128 x 2^i, heads 4-8-16-32)."""
    return LITSwin(**{**_LIT_B, **kwargs})


# Ablations. The paper prints their sizes in whole millions: `params_int_m`, counted with the
# classifier head where `params_int_head` (Table 3, as PVT's and Swin's papers count) and
# without it otherwise (Tables 2 and 4, as LIT's own rows).
@register_model(
    config=_cfg(params_int_m=19, params_int_head=False, macs_g=3.6, imagenet_top1=80.4, table=2)
)
def lit_ti_uniform(**kwargs: Any) -> LITPyramid:
    """Table 2, LIT-Ti*: PVT's plain 2x2 conv patch merging instead of DTM."""
    return LITPyramid(**{**_LIT_TI, "merge_layer": conv_merge, **kwargs})


@register_model(
    config=_cfg(params_int_m=27, params_int_head=False, macs_g=4.1, imagenet_top1=81.3, table=2)
)
def lit_s_uniform(**kwargs: Any) -> LITSwin:
    """Table 2, LIT-S*: Swin's plain 2x2 patch merging instead of DTM."""
    return LITSwin(**{**_LIT_S, "merge_layer": uniform_merge, **kwargs})


@register_model(
    config=_cfg(params_int_m=25, params_int_head=True, macs_g=3.8, imagenet_top1=80.5, table=3)
)
def pvt_small_dtm(**kwargs: Any) -> LITPyramid:
    """Table 3: PVT-S with deformable token merging between its stages."""
    return LITPyramid(**{**_PVT_S, "merge_layer": dtm_merge, **kwargs})


@register_model(
    config=ModelConfig(
        crop_pct=0.9,
        smoke_input_size=(3, 224, 224),  # windows of 7 on grids that merge evenly
        paper=dict(params_int_m=28, params_int_head=True, macs_g=4.5, imagenet_top1=81.6, table=3),
    )
)
def swin_tiny_dtm(**kwargs: Any) -> LITSwin:
    """Table 3: Swin-T with deformable token merging."""
    return LITSwin(**{"merge_layer": dtm_merge, **kwargs})


# Table 4: PVT-S with full attention (no spatial reduction), then with attention removed from
# the first stages (MLP-only blocks there).
_TABLE4 = {
    "pvt_small_full_msa": ((0, 1, 2, 3), dict(params_int_m=20, macs_g=8.4, imagenet_top1=80.9)),
    "pvt_small_mlp_1": ((1, 2, 3), dict(params_int_m=20, macs_g=4.5, imagenet_top1=80.8)),
    "pvt_small_mlp_12": ((2, 3), dict(params_int_m=19, macs_g=3.6, imagenet_top1=80.4)),
    "pvt_small_mlp_123": ((3,), dict(params_int_m=17, macs_g=3.0, imagenet_top1=75.0)),
    "pvt_small_mlp_1234": ((), dict(params_int_m=14, macs_g=2.8, imagenet_top1=66.8)),
}


def _register_table4(name: str, attn_stages: tuple[int, ...], paper: dict[str, Any]) -> None:
    def build(**kwargs: Any) -> LITPyramid:
        return LITPyramid(**{**_PVT_S, "sr_ratios": 1, "attn_stages": attn_stages, **kwargs})

    build.__name__ = name
    build.__doc__ = f"Table 4: PVT-S, no spatial reduction, attention in stages {attn_stages}."
    register_model(build, config=_cfg(**paper, params_int_head=False, table=4))


for _name, (_stages, _paper) in _TABLE4.items():
    _register_table4(_name, _stages, _paper)
