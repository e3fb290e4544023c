"""The LSA authors' released models, built as their training scripts build them.

Sheynin et al. released the trained models of "Locally Shifted Attention With Early Global
Integration" (github.com/shellysheynin/Locally-SAG-Transformer; its README links the folder).
Their code differs from the paper, which :mod:`lgvit.models.lsa` follows, so their checkpoints
do not fit the paper's models. The five ``*_authors`` models here are the configurations of
their ``main_*.py`` scripts on lgvit's LSA core (the folded shift embedding, fused attention,
timm's interface) and load their checkpoint files as those scripts write them:

* the CIFAR models share one key/value head among all query heads, in every attention (their
  ``Wkv`` maps to 2 x head_dim); tiny CIFAR has 4 query heads (the paper's 3);
* one LayerNorm pair per stage, shared by all its blocks (stage 1's local block included);
* drop path is a constant 0.1 on every block, whatever ``--drop-path`` says
  (``drop_path_rate`` here sets that constant);
* the ImageNet models make their 10 copies with ``F.pad(img, (dx, 0, dy, 0), "circular")``
  rather than a roll, horizontal shifts first; with lsa_tiny_224_authors' 9x9 stride-7 padding-1
  conv the last row and column of windows read image pixels where a roll reads zero padding.

Kept from lgvit: a batch of one gives the same output as inside a larger batch (their
``(attn @ v).squeeze()`` scrambles it) and any input size whose grid forms works (theirs asserts
the training size). ``docs/models.md`` lists every difference, with where it is in their code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from lgvit.core.errors import LgvitError
from lgvit.models.layers import DropPath
from lgvit.models.lsa import LocallyShiftedViT
from lgvit.models.registry import (
    CIFAR_MEAN,
    CIFAR_STD,
    ModelConfig,
    register_checkpoint_layout,
    register_model,
)

# Their ImageNet copies, as (dy, dx) in their order (imagenet_model.py, PatchEmbed.forward):
# F.pad's (left, right, top, bottom) tuples pad the left (dx) first, then the top (dy).
AUTHORS_IMAGENET_SHIFTS = (
    (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0), (1, 1), (2, 2), (3, 3),
)  # fmt: skip


class SharedNorm(nn.Module):
    """Calls a norm it does not own: the authors' blocks of one stage share one LayerNorm pair,
    held by the stage's first block; the state dict keeps it once, under that block."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "shared", norm)  # not a submodule: no second copy of it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)

    def extra_repr(self) -> str:
        return f"shares {self.shared!r}"


class AuthorsLSA(LocallyShiftedViT):
    """:class:`~lgvit.models.lsa.LocallyShiftedViT` as the authors' code builds it.

    Args:
        padded_shifts: make the shifted copies by circular padding on the top/left (their
            ImageNet models) instead of a roll (their CIFAR models, the paper).
        drop_path_rate: the drop-path rate of every block (theirs: a constant 0.1).
        kwargs: :class:`~lgvit.models.lsa.LocallyShiftedViT`'s.
    """

    def __init__(
        self, *, padded_shifts: bool = False, drop_path_rate: float = 0.1, **kwargs: Any
    ) -> None:
        super().__init__(drop_path_rate=drop_path_rate, **kwargs)
        if padded_shifts:
            self.patch_embed.mode = "pad"
        for m in self.modules():
            if isinstance(m, DropPath):
                m.drop_prob = drop_path_rate
        # Stage 1's pair belongs to the local block, later stages' to their first block.
        for i, stage in enumerate(self.stages):
            owner = self.local_block if i == 0 else stage.blocks[0]
            for blk in stage.blocks if i == 0 else stage.blocks[1:]:
                blk.norm1, blk.norm2 = SharedNorm(owner.norm1), SharedNorm(owner.norm2)

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Their layout (``to_patch_embedding``, ``layers.i.{0,1}``, ``mlp_head``) to ours; an
        lgvit checkpoint passes through."""
        if not any(_EMBED.fullmatch(k) for k in state_dict):
            return state_dict
        owner = authors_model_of(state_dict)
        mine = _SIGNATURES.get((self.num_variants, self.embed_conv[0], self.dims[0]))
        if owner is not None and owner != mine:
            raise LgvitError(
                f"a checkpoint of {owner} (the authors' layout) does not load into "
                f"{mine or 'this model'}: load it as {owner} (--model {owner})"
            )
        return from_authors_layout(state_dict)


# ---------------------------------------------------------------------------------------------
# Their checkpoint layout
# ---------------------------------------------------------------------------------------------

_PARTS = {
    "Wq_even": "attn.q", "Wkv_even": "attn.kv",  # the local attention (stage 1, block 1)
    "Wq_odd": "attn.q", "Wkv_odd": "attn.kv",  # the global attentions
    "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
}  # fmt: skip
_EMBED = re.compile(r"to_patch_embedding\.projections\.(\d+)\.(weight|bias)")


def _block(stage: int, block: int) -> str:
    """Our name of their block ``layers.{stage}.0.layers.{block}``."""
    if stage == 0:
        return "local_block" if block == 0 else f"stages.0.blocks.{block - 1}"
    return f"stages.{stage}.blocks.{block}"


def _our_key(key: str) -> str:
    if key.startswith("mlp_head."):
        return "head." + key[len("mlp_head.") :]
    m = re.fullmatch(r"layers\.(\d+)\.1\.(.+)", key)  # the downsampling after stage i
    if m:
        return f"stages.{int(m[1]) + 1}.downsample.{m[2]}"
    m = re.fullmatch(r"layers\.(\d+)\.0\.pos_emb", key)
    if m:
        return "pos_embed" if m[1] == "0" else f"stages.{m[1]}.pos_embed"
    m = re.fullmatch(r"layers\.(\d+)\.0\.(norm[12]\.\w+)", key)  # the stage's shared pair
    if m:
        return f"{_block(int(m[1]), 0)}.{m[2]}"
    m = re.fullmatch(r"layers\.(\d+)\.0\.layers\.(\d+)\.[01]\.(\w+)\.(weight|bias)", key)
    if m:
        return f"{_block(int(m[1]), int(m[2]))}.{_PARTS.get(m[3], m[3])}.{m[4]}"
    return key  # norm.*, and anything else (the strict load names what does not fit)


def from_authors_layout(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The authors' state dict in our names: their T embedding convs stacked into
    ``patch_embed.weight (T, C, 3, k, k)`` / ``patch_embed.bias (T, C)``."""
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[int, torch.Tensor]] = {"weight": {}, "bias": {}}
    for key, value in state_dict.items():
        m = _EMBED.fullmatch(key)
        if m:
            convs[m[2]][int(m[1])] = value
        else:
            out[_our_key(key)] = value
    for part, by_variant in convs.items():
        if not by_variant:
            continue
        shapes = {tuple(v.shape) for v in by_variant.values()}
        if len(shapes) > 1 or sorted(by_variant) != list(range(len(by_variant))):
            raise LgvitError(
                f"to_patch_embedding.projections.*.{part}: variants {sorted(by_variant)} of "
                f"shapes {sorted(shapes)} do not stack into one (T, ...) tensor"
            )
        out[f"patch_embed.{part}"] = torch.stack([by_variant[t] for t in sorted(by_variant)])
    return out


# (variants T, embedding kernel, stage-1 width) -> the model that reads such a checkpoint
_SIGNATURES: dict[tuple[int, int, int], str] = {}
Builder = Callable[..., AuthorsLSA]


@register_checkpoint_layout
def authors_model_of(state_dict: dict[str, torch.Tensor]) -> str | None:
    """Which ``*_authors`` model a state dict in the authors' layout belongs to (None: not
    their layout, or none of their five configurations)."""
    w = state_dict.get("to_patch_embedding.projections.0.weight")
    if w is None or w.ndim != 4:
        return None
    convs = sum(1 for k in state_dict if _EMBED.fullmatch(k) and k.endswith(".weight"))
    return _SIGNATURES.get((convs, w.shape[-1], w.shape[0]))


# ---------------------------------------------------------------------------------------------
# Registered configurations: their main_*.py scripts
# ---------------------------------------------------------------------------------------------


def _register(cifar: bool, defaults: dict[str, Any]) -> Callable[[Builder], Builder]:
    """Register ``fn`` with its config, and the signature of its checkpoints."""

    def wrap(fn: Builder) -> Builder:
        config = ModelConfig(
            input_size=(3, 32, 32) if cifar else (3, 224, 224),
            num_classes=10 if cifar else 1000,
            first_conv="patch_embed",
            **(
                dict(mean=CIFAR_MEAN, std=CIFAR_STD, crop_pct=1.0, dataset="cifar10",
                     smoke_input_size=(3, 16, 16))
                if cifar else {}
            ),
        )  # fmt: skip
        model = register_model(fn, config=config)
        shifts = defaults.get("shifts")
        key = (
            len(shifts) if shifts else 18,
            defaults.get("embed_kernel", 3),
            defaults["dims"][0],
        )
        _SIGNATURES[key] = fn.__name__
        return model

    return wrap


_TINY_CIFAR = dict(img_size=32, dims=(192,) * 4, depths=(2, 4, 4, 4), num_heads=4, kv_heads=1)
_SMALL_CIFAR = dict(_TINY_CIFAR, dims=(384,) * 4, num_heads=6)
_BASE_CIFAR = dict(_TINY_CIFAR, dims=(768,) * 4, depths=(3, 3, 3, 3), num_heads=12)
_TINY_224 = dict(
    img_size=224, shifts=AUTHORS_IMAGENET_SHIFTS, padded_shifts=True, embed_kernel=9,
    embed_stride=7, embed_padding=1, dims=(192,) * 4, depths=(2, 4, 4, 4), num_heads=4,
)  # fmt: skip
_SMALL_224 = dict(
    img_size=224, shifts=AUTHORS_IMAGENET_SHIFTS, padded_shifts=True, embed_kernel=4,
    embed_stride=4, embed_padding=0, dims=(64, 192, 384), depths=(2, 2, 10), num_heads=(2, 6, 12),
)  # fmt: skip


@_register(True, _TINY_CIFAR)
def lsa_tiny_cifar_authors(**kwargs: Any) -> AuthorsLSA:
    """The authors' tiny CIFAR model: 192-wide, 4 heads sharing one K/V head, depths 2-4-4-4."""
    return AuthorsLSA(**{**_TINY_CIFAR, **kwargs})


@_register(True, _SMALL_CIFAR)
def lsa_small_cifar_authors(**kwargs: Any) -> AuthorsLSA:
    """The authors' small CIFAR model: 384-wide, 6 heads sharing one K/V head, depths 2-4-4-4."""
    return AuthorsLSA(**{**_SMALL_CIFAR, **kwargs})


@_register(True, _BASE_CIFAR)
def lsa_base_cifar_authors(**kwargs: Any) -> AuthorsLSA:
    """The authors' base CIFAR model: 768-wide, 12 heads sharing one K/V head, depths 3-3-3-3."""
    return AuthorsLSA(**{**_BASE_CIFAR, **kwargs})


@_register(False, _TINY_224)
def lsa_tiny_224_authors(**kwargs: Any) -> AuthorsLSA:
    """The authors' tiny ImageNet model: 10 padded copies, 9x9 stride-7 embedding, 4 heads."""
    return AuthorsLSA(**{**_TINY_224, **kwargs})


@_register(False, _SMALL_224)
def lsa_small_224_authors(**kwargs: Any) -> AuthorsLSA:
    """The authors' small ImageNet model: 10 padded copies, 4x4 stride-4 embedding, 3 stages."""
    return AuthorsLSA(**{**_SMALL_224, **kwargs})
