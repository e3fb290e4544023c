"""Blocks shared by the model families; one idea per module."""

from lgvit.models.layers.attention import (
    LN_EPS,
    Attention,
    RelativePositionBias,
    attention_probs,
    multihead_sdpa,
    relative_position_index,
)
from lgvit.models.layers.block import Block, default_norm
from lgvit.models.layers.deform import (
    DEFORM_IMPLS,
    DeformableTokenMerging,
    DeformConv2d,
    deform_conv2d,
    set_deform_impl,
)
from lgvit.models.layers.drop import DropPath, drop_path, drop_path_schedule, residual_add
from lgvit.models.layers.features import FeatureInfo, feature_take_indices
from lgvit.models.layers.helpers import (
    Grid,
    as_written,
    autocast_dtype,
    contiguous_grad,
    conv_out_size,
    map_to_tokens,
    num_prefix_tokens,
    per_stage,
    running_as_written,
    to_2tuple,
    tokens_to_map,
)
from lgvit.models.layers.locality import (
    EfficientChannelAttention,
    LocalityFeedForward,
    SqueezeExcite,
)
from lgvit.models.layers.merge import PatchMerging
from lgvit.models.layers.mlp import Mlp
from lgvit.models.layers.patch_embed import PatchEmbed
from lgvit.models.layers.pos_embed import (
    grid_differs,
    grid_from_tokens,
    is_symbolic,
    register_resize_on_load,
    resize_pos_embed,
    resize_rel_pos_table,
)
from lgvit.models.layers.stage import Stage, frozen_norm_stats, run_block
from lgvit.models.layers.weight_init import init_vit_weights, trunc_normal_
from lgvit.models.layers.window import WindowAttention, shifted_window_mask

__all__ = [
    "LN_EPS",
    "Attention",
    "Block",
    "as_written",
    "autocast_dtype",
    "running_as_written",
    "DEFORM_IMPLS",
    "DeformConv2d",
    "DeformableTokenMerging",
    "DropPath",
    "EfficientChannelAttention",
    "FeatureInfo",
    "LocalityFeedForward",
    "Grid",
    "Mlp",
    "PatchEmbed",
    "PatchMerging",
    "RelativePositionBias",
    "SqueezeExcite",
    "Stage",
    "WindowAttention",
    "contiguous_grad",
    "conv_out_size",
    "default_norm",
    "deform_conv2d",
    "set_deform_impl",
    "drop_path",
    "residual_add",
    "drop_path_schedule",
    "feature_take_indices",
    "frozen_norm_stats",
    "grid_from_tokens",
    "init_vit_weights",
    "map_to_tokens",
    "attention_probs",
    "multihead_sdpa",
    "num_prefix_tokens",
    "per_stage",
    "register_resize_on_load",
    "relative_position_index",
    "resize_pos_embed",
    "grid_differs",
    "is_symbolic",
    "resize_rel_pos_table",
    "run_block",
    "shifted_window_mask",
    "to_2tuple",
    "tokens_to_map",
    "trunc_normal_",
]
