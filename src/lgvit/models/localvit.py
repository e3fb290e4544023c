"""LocalViT (Li, Zhang, Timofte, Van Gool, Cao, "LocalViT: Bringing Locality to Vision
Transformers"): the transformer MLP replaced by a locality feed-forward -- 1x1 conv, depth-wise
3x3 conv, 1x1 conv on the token grid -- in DeiT, PVT and Swin.

Everything architectural is shared: the skeletons (``vit.py``, ``pvt.py``, ``swin.py``) take the
feed-forward as ``mlp_layer``, and :class:`~lgvit.models.layers.LocalityFeedForward` drops its
LayerNorm and drop path and lets class tokens skip it. This file holds the ablation keywords,
the mapping of the authors' released checkpoints, and the registered configurations.

Where we follow the authors' code rather than the paper's text: LocalViT-T/S use 4 and 8 heads
(DeiT-T/S use 3 and 6; parameters and MACs are the same), as their released weights do; the SE
bottleneck is the expanded width gC divided by ``reduction`` (192 for LocalViT-T gives 4);
PVT's SE reduction is the stage width, Swin's a quarter of it. The paper's 4.8G FLOPs for
LocalViT-PVT ignore spatial reduction; ``lgvit info`` reports the counted 1.98G.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from lgvit.models.layers import LocalityFeedForward, Mlp
from lgvit.models.pvt import PyramidVisionTransformer
from lgvit.models.registry import ModelConfig, register_model
from lgvit.models.swin import SwinTransformer
from lgvit.models.vit import VisionTransformer


def locality_ffn(
    act: str = "hswish",
    channel_attn: str | None = "se",
    reduction: int = 4,
    depthwise: bool = True,
    reduction_from_dim: float | None = None,
) -> Any:
    """The ``mlp_layer`` of a LocalViT block."""
    return partial(
        LocalityFeedForward, act=act, channel_attn=channel_attn, reduction=reduction,
        depthwise=depthwise, reduction_from_dim=reduction_from_dim,
    )  # fmt: skip


def map_authors_ffn_keys(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict:
    """The authors' ``<block>.conv.conv.<i>.*`` (one ``nn.Sequential``) -> our
    ``<block>.mlp.<name>.*``, by the position of each layer in ``LocalityFeedForward.layers()``."""
    out, names = {}, {}
    for key, value in state_dict.items():
        m = re.fullmatch(r"(.*)\.conv\.conv\.(\d+)\.(.*)", key)
        if m is None:
            out[key] = value
            continue
        block = m[1]
        if block not in names:
            try:
                ffn = model.get_submodule(f"{block}.mlp")
            except AttributeError:
                out[key] = value  # no such block: let the strict load name the key
                continue
            by_id = {id(mod): n for n, mod in ffn.named_children()}
            names[block] = [by_id[id(layer)] for layer in ffn.layers()]
        out[f"{block}.mlp.{names[block][int(m[2])]}.{m[3]}"] = value
    return out


class _AuthorsFeedForwardLayout:
    """The authors' checkpoints: the skeleton's own mapping, then ``conv.conv.<i>``."""

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict:
        return map_authors_ffn_keys(super().checkpoint_filter_fn(state_dict), self)  # type: ignore[misc]


class LocalViT(_AuthorsFeedForwardLayout, VisionTransformer):
    """DeiT with the locality feed-forward.

    Args (besides :class:`VisionTransformer`'s):
        ffn_act: ``hswish`` (default), ``relu6`` or ``gelu``.
        ffn_channel_attn: ``se`` (default), ``eca``, ``eca_hs`` or None.
        ffn_reduction: SE reduction of the expanded width (hidden = g*C // reduction).
        ffn_expansion: g, the expansion of the feed-forward (default ``mlp_ratio``).
        ffn_depthwise: the depth-wise 3x3 conv (False: Table 1's "no DW").
        ffn_layers: the block indices that get the locality feed-forward (Table 3); the others
            keep the plain MLP with its LayerNorm. Default: all.
    """

    def __init__(
        self,
        depth: int = 12,
        ffn_act: str = "hswish",
        ffn_channel_attn: str | None = "se",
        ffn_reduction: int = 4,
        ffn_expansion: float | None = None,
        ffn_depthwise: bool = True,
        ffn_layers: Iterable[int] | None = None,
        **kwargs: Any,
    ) -> None:
        layers = set(range(depth) if ffn_layers is None else ffn_layers)
        if not layers <= set(range(depth)):
            raise ValueError(f"ffn_layers {sorted(layers)} are not all blocks of 0..{depth - 1}")
        ffn = locality_ffn(ffn_act, ffn_channel_attn, ffn_reduction, ffn_depthwise)
        if ffn_expansion is not None:
            kwargs["mlp_ratio"] = ffn_expansion
        mlps = [ffn if i in layers else Mlp for i in range(depth)]
        super().__init__(depth=depth, mlp_layer=mlps, **kwargs)


class LocalViTPVT(_AuthorsFeedForwardLayout, PyramidVisionTransformer):
    """PVT with the locality feed-forward (SE reduction = the stage width, as the authors')."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"mlp_layer": locality_ffn(reduction_from_dim=1.0), **kwargs})


class LocalViTSwin(_AuthorsFeedForwardLayout, SwinTransformer):
    """Swin with the locality feed-forward (SE reduction = a quarter of the width: 16 wide)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"mlp_layer": locality_ffn(reduction_from_dim=0.25), **kwargs})


# ---------------------------------------------------------------------------------------------
# Registered configurations: the paper's models and the ablation rows whose sizes it prints
# ---------------------------------------------------------------------------------------------

_TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=4, drop_path_rate=0.1)
_SMALL = dict(patch_size=16, embed_dim=384, depth=12, num_heads=8, drop_path_rate=0.1)

# name: (architecture, paper numbers). Tables 1-4 of the paper are ablations of LocalViT-T.
Variants = dict[str, tuple[dict[str, Any], dict[str, Any]]]
LOCALVIT_TINY_VARIANTS: Variants = {
    "localvit_tiny": (dict(ffn_reduction=192),
                      dict(params_m=5.91, macs_g=1.27, imagenet_top1=74.8)),
    "localvit_tiny_se4": (dict(ffn_reduction=4),
                          dict(params_m=9.38, macs_g=1.27, imagenet_top1=75.8)),
    # Table 2: activation and channel attention.
    "localvit_tiny_relu6": (dict(ffn_act="relu6", ffn_channel_attn=None),
                            dict(params_m=5.8, imagenet_top1=73.7, table=2)),
    "localvit_tiny_hswish": (dict(ffn_channel_attn=None),
                             dict(params_m=5.83, imagenet_top1=74.4, table=2)),
    "localvit_tiny_eca": (dict(ffn_channel_attn="eca"),
                          dict(params_m=5.83, imagenet_top1=74.5, table=2)),  # noqa: E501
    "localvit_tiny_se96": (dict(ffn_reduction=96),
                           dict(params_m=5.98, imagenet_top1=74.8, table=2)),
    "localvit_tiny_se48": (dict(ffn_reduction=48),
                           dict(params_m=6.13, imagenet_top1=75.0, table=2)),
    # Table 4: the expansion g, with SE.
    "localvit_tiny_g1": (dict(ffn_expansion=1, ffn_reduction=192),
                         dict(params_m=3.10, imagenet_top1=66.2, table=4)),
    "localvit_tiny_g2": (dict(ffn_expansion=2, ffn_reduction=192),
                         dict(params_m=4.04, imagenet_top1=70.6, table=4)),
    "localvit_tiny_g3": (dict(ffn_expansion=3, ffn_reduction=192),
                         dict(params_m=4.97, imagenet_top1=73.1, table=4)),
    # Table 1: g = 6 with the depth-wise conv and ReLU6 (no channel attention).
    "localvit_tiny_g6": (dict(ffn_expansion=6, ffn_act="relu6", ffn_channel_attn=None),
                         dict(params_m=7.66, imagenet_top1=76.1, table=1)),
    # Table 3: which blocks get the locality feed-forward (the others keep the MLP).
    "localvit_tiny_low4": (dict(ffn_reduction=192, ffn_layers=range(0, 4)),
                           dict(params_m=5.78, macs_g=1.26, imagenet_top1=73.1, table=3)),
    "localvit_tiny_mid4": (dict(ffn_reduction=192, ffn_layers=range(4, 8)),
                           dict(params_m=5.78, macs_g=1.26, imagenet_top1=72.1, table=3)),
    "localvit_tiny_high4": (dict(ffn_reduction=192, ffn_layers=range(8, 12)),
                            dict(params_m=5.78, macs_g=1.26, imagenet_top1=69.1, table=3)),
    "localvit_tiny_low8": (dict(ffn_reduction=192, ffn_layers=range(0, 8)),
                           dict(params_m=5.84, imagenet_top1=74.0, table=3)),
}  # fmt: skip


def _register_tiny(name: str, arch: dict[str, Any], paper: dict[str, Any]) -> None:
    def build(**kwargs: Any) -> LocalViT:
        return LocalViT(**{**_TINY, **arch, **kwargs})

    build.__name__ = name
    build.__doc__ = f"LocalViT-T (DeiT-T, 4 heads, g 4) with {arch or 'the paper defaults'}."
    register_model(build, config=ModelConfig(paper=paper))


for _name, (_arch, _paper) in LOCALVIT_TINY_VARIANTS.items():
    _register_tiny(_name, _arch, _paper)


@register_model(config=ModelConfig(paper=dict(params_m=22.43, macs_g=4.62, imagenet_top1=80.8)))
def localvit_small(**kwargs: Any) -> LocalViT:
    """LocalViT-S: DeiT-S (8 heads, as the authors' code), g 4, h-swish + SE (reduction 384)."""
    return LocalViT(**{**_SMALL, "ffn_reduction": 384, **kwargs})


_PVT_MACS_NOTE = "the paper's counter ignored PVT's spatial reduction; 1.98G counted"


@register_model(
    config=ModelConfig(
        paper=dict(params_m=13.46, macs_g=4.8, imagenet_top1=78.2, macs_note=_PVT_MACS_NOTE)
    )
)
def localvit_pvt_tiny(**kwargs: Any) -> LocalViTPVT:
    """LocalViT-PVT: PVT-Tiny with the locality feed-forward in every block.

    The paper prints 4.8G FLOPs, its counter ignoring the spatial reduction; 1.98G is counted.
    """
    return LocalViTPVT(**{"depths": (2, 2, 2, 2), **kwargs})


@register_model(
    config=ModelConfig(
        crop_pct=0.9, smoke_input_size=(3, 112, 112),
        paper=dict(params_m=29.08, macs_g=4.54, imagenet_top1=81.9),
    )
)  # fmt: skip
def localvit_swin_tiny(**kwargs: Any) -> LocalViTSwin:
    """LocalViT-Swin: Swin-T with the locality feed-forward (from the authors' README)."""
    return LocalViTSwin(**kwargs)
