"""Locally Shifted Attention ViT (Sheynin, Benaim, Polyak, Wolf).

"Locally Shifted Attention With Early Global Integration" (and its first version, "Local-Global
Shifting Vision Transformers").

The image is embedded T times, once per small shift (dy, dx) of the whole image; at every grid
position a *local* attention block lets the unshifted token (the query) attend over its T shifted
variants (keys/values), which yields one "virtually located" token per position. A pyramid of
*global* attention stages follows, with conv3x3 + LayerNorm + max-pool downsampling between them,
and a LayerNorm + mean-pool + linear head.

Where the authors' code (github.com/shellysheynin/Locally-SAG-Transformer) differs we follow
the paper; ``lsa_authors.py`` builds their released models as their code does (``*_authors``;
docs/models.md lists every difference). Here: 3 heads in tiny CIFAR (theirs: 4) and a key/value
head per query head in small and base CIFAR (theirs share one), a LayerNorm pair per block
(theirs: one per stage), drop path rising linearly with depth to ``drop_path_rate`` (theirs: a
constant 0.1), rolled copies (their ImageNet code pads), and an image's output that is the same
alone as inside a batch (their ``(attn @ v).squeeze()`` breaks a batch of one).

Speed: the patches of all T shifted copies are gathered at once (no Python loop over shifts) and
the T per-variant convolutions run as one batched matmul; the T-variant tensor stays T-major so
it is never transposed; the global attentions go through the shared SDPA helper, with query
heads that share a key/value head folded into one call; the local attention, one tiny problem
per position and key/value head, runs as batched matmuls cut to CUDA's grid limit
(:func:`~lgvit.models.layers.lsa_folded.attend_variants`).

Ablation A (``lsa_tiny_cifar_a``, "no shifts, no local block"): stage 1 keeps its depth, a
global block standing where the local block was; 6.8M params, as the paper's Table 5.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.core.errors import LgvitError
from lgvit.models.base import StagedViT, pyramid_feature_info, stem_of_no_images
from lgvit.models.layers import (
    LN_EPS,
    Attention,
    Block,
    Grid,
    Stage,
    WindowAttention,
    autocast_dtype,
    contiguous_grad,
    conv_out_size,
    drop_path_schedule,
    init_vit_weights,
    is_symbolic,
    map_to_tokens,
    multihead_sdpa,
    per_stage,
    register_resize_on_load,
    resize_pos_embed,
    running_as_written,
    to_2tuple,
    tokens_to_map,
    trunc_normal_,
)
from lgvit.models.layers.lsa_folded import (
    FoldedProjection,
    attend_folded,
    attend_variants,
    fold_projection,
)
from lgvit.models.layers.shift import shift_patch_index
from lgvit.models.registry import (
    CIFAR_MEAN,
    CIFAR_STD,
    LSA_PAPER_GPU,
    ModelConfig,
    checkpoint_layout_owner,
    register_model,
)

CIFAR_SHIFTS = (
    (0, 0), (1, 0), (0, 1), (-1, 0), (0, -1), (2, 0), (0, 2), (-2, 0), (0, -2),
    (1, 1), (1, 2), (1, -1), (-1, 1), (-1, 2), (-1, -1), (2, 1), (2, 2), (2, -1),
)  # fmt: skip
AXIS_SHIFTS = ((0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (-1, 0), (-2, 0), (0, -1), (0, -2))
IMAGENET_SHIFTS = (
    (0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (0, 2), (0, 3), (1, 1), (2, 2), (3, 3),
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Shift embedding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShiftedVariants:
    """The T-variant tokens ``(T, B, N, C)``, kept as what they are made of.

    Variant t of token n is ``patches[t, b*N + n] @ weight[t] + offset[t, n]``: the im2col
    patch of the shifted copy, that copy's conv weight, its conv bias plus its position
    embedding. :meth:`fold` gives ``linear(norm(variants))`` without building the variants:
    the LayerNorm statistics come from ``K x K`` Gram matrices of the conv weight (K =
    C_in*k*k = 27 for a 3x3 RGB conv) and the norm's affine map and the linear layer fold into
    the conv weight. For lsa_tiny_cifar that is 27 x 128 multiply-adds per variant token instead
    of 27 x 192 + 192 x 128, and the largest tensor of the model (T x the token stream, 453 MB
    in bf16 at batch 64) is never written, normalised or read.
    """

    patches: torch.Tensor  # (T, B*N, K)
    weight: torch.Tensor  # (T or 1, K, C)
    offset: torch.Tensor  # (T or 1, N or 1, C): conv bias (+ position embedding)
    batch: int
    dense: torch.Tensor | None = None  # the variants themselves, when already built

    @property
    def shape(self) -> torch.Size:
        T, BN, _ = self.patches.shape
        return torch.Size((T, self.batch, BN // self.batch, self.weight.shape[-1]))

    def add(self, pos: torch.Tensor) -> ShiftedVariants:
        """The variants plus a position embedding ``(T or 1, N, C)``."""
        dense = None if self.dense is None else self.dense + pos[:, None].to(self.dense.dtype)
        return ShiftedVariants(self.patches, self.weight, self.offset + pos, self.batch, dense)

    def materialize(self) -> torch.Tensor:
        """The variants themselves, ``(T, B, N, C)``."""
        if self.dense is not None:
            return self.dense
        T, B, N, C = self.shape
        x = torch.matmul(self.patches, self.weight).view(T, B, N, C)
        return x + self.offset[:, None].to(x.dtype)

    def fold(self, norm: nn.Module, linear: nn.Linear) -> FoldedProjection | None:
        """``linear(norm(variants))`` without building the variants (the fast path,
        :func:`~lgvit.models.layers.lsa_folded.fold_projection`), or ``None``: build them,
        where folding does not apply or the model runs :func:`~lgvit.models.layers.as_written`.
        """
        if running_as_written():
            return None
        return fold_projection(self.patches, self.weight, self.offset, self.shape, norm, linear)


class ShiftEmbedding(nn.Module):
    """Embed T shifted copies of the image.

    ``forward`` returns the unshifted tokens ``(B, N, dim)``, the T-variant tokens (variant 0
    included) as :class:`ShiftedVariants` (``.materialize()`` gives ``(T, B, N, dim)``) and
    the token grid. ``conv_per_variant=True`` (the
    paper): copy t is the image rolled circularly by shift t, embedded by its own conv.
    ``conv_per_variant=False`` (ablations C/D): copies are translated with reflection padding and
    share one conv.

    The patches of all T copies are gathered at once (im2col, no Python loop over shifts); the
    variants stay patches until the local block folds their convolutions into its normalised
    key/value projection.
    """

    def __init__(
        self,
        shifts: Sequence[tuple[int, int]],
        in_chans: int = 3,
        dim: int = 192,
        kernel_size: int = 3,
        stride: int = 1,
        padding: int = 1,
        conv_per_variant: bool = True,
    ) -> None:
        super().__init__()
        shifts = tuple(tuple(s) for s in shifts)
        if not shifts or shifts[0] != (0, 0):
            raise ValueError("the first shift must be (0, 0): it is the query variant")
        self.shifts = shifts
        self.num_variants = len(shifts)
        self.dim = dim
        self.in_chans = in_chans
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.conv_per_variant = conv_per_variant
        self.mode = "circular" if conv_per_variant else "reflect"
        n_conv = self.num_variants if conv_per_variant else 1
        self.weight = nn.Parameter(torch.empty(n_conv, dim, in_chans, kernel_size, kernel_size))
        self.bias = nn.Parameter(torch.zeros(n_conv, dim))
        trunc_normal_(self.weight, std=0.02)
        # (H, W, device, inference mode) -> (gather index, token grid)
        self._index_cache: dict[tuple, tuple[torch.Tensor, tuple[int, int]]] = {}

    def _index(self, H: int, W: int, device: torch.device) -> tuple[torch.Tensor, tuple[int, int]]:
        k, s, p = self.kernel_size, self.stride, self.padding
        if is_symbolic((H, W)) or torch.compiler.is_compiling():
            # torch.export with a dynamic height/width: the index is part of the graph, built
            # from the symbolic sizes with tensor ops (a fixed size keeps it a constant); under
            # torch.compile too, whose tracer cannot read the cache key's inference mode.
            idx, grid = shift_patch_index(self.shifts, H, W, k, s, p, self.in_chans, self.mode)
            return idx.to(device), grid
        # An index built under inference_mode is an inference tensor, which autograd may not
        # save (torch.compile's bf16 training graph saves it): one entry per mode.
        key = (H, W, str(device), torch.is_inference_mode_enabled())
        if key not in self._index_cache:
            idx, grid = shift_patch_index(self.shifts, H, W, k, s, p, self.in_chans, self.mode)
            self._index_cache[key] = (idx.to(device), grid)
        return self._index_cache[key]

    def conv_weight(self, variant: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv (weight, bias) that embeds ``variant``, in ``conv2d`` layout."""
        i = variant if self.conv_per_variant else 0
        return self.weight[i], self.bias[i]

    def _embed(self, patches: torch.Tensor, which: slice) -> torch.Tensor:
        """``patches (T', B*N, CKK)`` @ weights -> ``(T', B*N, dim)`` (+ bias)."""
        w = self.weight[which] if self.conv_per_variant else self.weight
        w = w.flatten(2).transpose(1, 2)  # (T' or 1, CKK, dim)
        b = self.bias[which] if self.conv_per_variant else self.bias
        if w.shape[0] == patches.shape[0]:
            return torch.baddbmm(b[:, None], patches, w)
        return torch.addmm(b, patches.flatten(0, 1), w[0]).view(*patches.shape[:2], -1)

    def forward(
        self, x: torch.Tensor, with_variants: bool = True
    ) -> tuple[torch.Tensor, ShiftedVariants | None, tuple[int, int]]:
        B, C, H, W = x.shape
        index, grid = self._index(H, W, x.device)
        amp = autocast_dtype(x.device.type)
        if amp is not None and x.dtype == torch.float32:
            # Gathered in the type the embedding's matmuls cast to under autocast: T copies of
            # the image moved at half the bytes, and no cast in each matmul that reads them.
            x = x.to(amp)
        flat = F.pad(x.flatten(1), (0, 1))  # one trailing zero for padded taps
        if not with_variants or self.num_variants == 1:
            index = index[:1]
        T = index.shape[0]
        patches = flat.index_select(1, index.flatten())  # one gather for all copies
        patches = patches.view(B, T, -1).transpose(0, 1).reshape(T, B * index.shape[1], -1)
        if T == 1:
            return self._embed(patches, slice(0, 1))[0].view(B, -1, self.dim), None, grid
        weight = self.weight.flatten(2).transpose(1, 2)  # (T or 1, CKK, dim)
        variants = ShiftedVariants(patches, weight, self.bias[:, None], B)
        if running_as_written():  # the architecture: T embeddings, variant 0 among them
            dense = variants.materialize()
            return dense[0], dataclasses.replace(variants, dense=dense), grid
        # The unshifted tokens are embedded on their own (1/T of the variants' work).
        return self._embed(patches[:1], slice(0, 1))[0].view(B, -1, self.dim), variants, grid


# ---------------------------------------------------------------------------------------------
# Local attention over the shifted variants
# ---------------------------------------------------------------------------------------------


class LocalShiftAttention(Attention):
    """At each grid position, the unshifted token attends over that position's T variants.

    ``query (B, N, C)``, already normalised, and the variants: a ``(T, B, N, C)`` tensor or
    :class:`ShiftedVariants`, normalised here by ``norm`` (``None``: already normalised) on the
    way into the key/value projection. Output ``(B, N, C)``. Softmax runs over T only;
    ``kv_heads=1`` shares one key/value head across all query heads (the tiny CIFAR model).
    Same projections as the global :class:`Attention`.

    :class:`ShiftedVariants` under a LayerNorm take the folded path: keys and values come
    straight from the patches (:meth:`ShiftedVariants.fold`); the per-position offset terms
    enter as a logit bias and a value correction computed on the small ``(B, N, heads, T)``
    probabilities.
    """

    fuse_qkv = False  # queries from the unshifted tokens, keys and values from the variants

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        variants: torch.Tensor | ShiftedVariants,
        norm: nn.Module | None = None,
    ) -> torch.Tensor:
        T, B, N, C = variants.shape
        drop = self.attn_drop if self.training else 0.0
        if isinstance(variants, ShiftedVariants):
            folded = variants.fold(norm or nn.Identity(), self.kv)
            if folded is not None:
                return self.proj_drop(self.proj(attend_folded(self, self.q(query), folded, drop)))
            variants = variants.materialize()
        # The variants' keys and values, variant-major (T, B*N, ...) as the projection makes
        # them; k and v by split, whose backward hands the projection one contiguous gradient.
        kv = contiguous_grad(self.kv(variants if norm is None else norm(variants)))
        k, v = kv.reshape(T, B * N, -1).split(self.kv_heads * self.head_dim, dim=-1)
        x, _ = attend_variants(self, self.q(query), k, v, drop)
        return self.proj_drop(self.proj(x.reshape(B, N, C)))


class LocalShiftBlock(Block):
    """Pre-norm local block: x0 + Attn(LN(x0), LN(variants)), then + MLP(LN(.)).

    x0 is the unshifted token (with its position embedding); the variants include it. The
    variants' LayerNorm is applied inside the attention, folded into its key/value projection.
    """

    def __init__(self, dim: int, num_heads: int, kv_heads: int | None = None, **kwargs: Any):
        attn = partial(LocalShiftAttention, kv_heads=kv_heads)
        super().__init__(dim, num_heads, attn_layer=attn, **kwargs)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, variants: torch.Tensor | ShiftedVariants, hw: Grid
    ) -> torch.Tensor:
        # LN is per token, so norm1(x) is exactly variant 0 of norm1(variants).
        x = self.residual(x, self.attn(self.norm1(x), variants, self.norm1), self.drop_path1)
        return self.residual(x, self.mlp(self.norm2(x), hw), self.drop_path2)


# ---------------------------------------------------------------------------------------------
# Table 6 replacements for the local block: Swin (variant I) and CvT (variant II)
# ---------------------------------------------------------------------------------------------


class SwinLocalBlock(nn.Module):
    """Table 6 variant I: a Swin block pair (window, then shifted window) as the local block."""

    def __init__(self, dim: int, num_heads: int, window: int = 8, **block_kwargs: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, attn_layer=partial(WindowAttention, window=window, shift=s),
                  **block_kwargs)
            for s in (0, window // 2)
        )  # fmt: skip

    def forward(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x, hw)
        return x


class ConvProjection(nn.Module):
    """CvT's convolutional projection: depth-wise 3x3 conv + BatchNorm, then a linear map."""

    def __init__(self, dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, stride, 1, groups=dim, bias=False)
        self.bn = nn.BatchNorm2d(dim)
        self.linear = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        return self.linear(map_to_tokens(self.bn(self.conv(tokens_to_map(x, hw))))[0])


class ConvProjectionAttention(nn.Module):
    """CvT's attention: queries, keys and values from convolutional projections (keys and
    values at stride 2)."""

    def __init__(self, dim: int, num_heads: int, *, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, **_: Any) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.q = ConvProjection(dim, dim, stride=1)
        self.k = ConvProjection(dim, dim, stride=2)
        self.v = ConvProjection(dim, dim, stride=2)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, hw: Grid) -> torch.Tensor:
        drop = self.attn_drop if self.training else 0.0
        q, k, v = self.q(x, hw), self.k(x, hw), self.v(x, hw)
        return self.proj_drop(self.proj(multihead_sdpa(q, k, v, self.num_heads, dropout_p=drop)))


class ConvTokenEmbedding(nn.Module):
    """CvT's convolutional token embedding: an overlapping conv followed by LayerNorm (takes
    :class:`ShiftEmbedding`'s arguments; it embeds the unshifted image only)."""

    num_variants = 1

    def __init__(
        self, shifts: Sequence, in_chans: int, dim: int, kernel: int, stride: int, padding: int,
        **_: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel, stride, padding)
        self.norm = nn.LayerNorm(dim, eps=LN_EPS)

    def forward(self, x: torch.Tensor, with_variants: bool = False) -> tuple:
        tokens, hw = map_to_tokens(self.proj(x))
        return self.norm(tokens), None, hw


# ---------------------------------------------------------------------------------------------
# Downsampling and the model
# ---------------------------------------------------------------------------------------------


class ConvDownsample(nn.Module):
    """Tokens -> map -> conv3x3 (C_in -> C_out) -> LayerNorm over channels -> max-pool 3x3/2."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim_out, 3, stride=1, padding=1)
        self.norm = nn.LayerNorm(dim_out, eps=LN_EPS)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x: torch.Tensor, hw: Grid) -> tuple[torch.Tensor, Grid]:
        x = self.conv(tokens_to_map(x, hw))
        x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return map_to_tokens(self.pool(x))

    @staticmethod
    def out_grid(grid: Grid) -> Grid:
        return (grid[0] + 1) // 2, (grid[1] + 1) // 2


@dataclass(frozen=True)
class LocalBlockSpec:
    """What stands first in stage 1, and what it needs from the embedding.

    ``build(dim, heads, kv_heads, block_kwargs, window)`` makes the block; ``shifted`` blocks
    are called ``block(x0, variants, hw)`` on the T shifted variants, the others
    ``block(x0, hw)`` on the unshifted image only; ``embed`` makes the embedding;
    ``pos_embed``: whether a stage-1 position embedding is learned (CvT's convolutional
    embedding carries position itself).
    """

    build: Callable[..., nn.Module]
    shifted: bool = False
    embed: Callable[..., nn.Module] = ShiftEmbedding
    pos_embed: bool = True


LOCAL_BLOCKS: dict[str, LocalBlockSpec] = {
    # The paper: local attention over the shifted variants.
    "shift": LocalBlockSpec(lambda d, h, kvh, kw, win: LocalShiftBlock(d, h, kvh, **kw), True),
    # Ablation A: no shifts; a global block stands where the local block was.
    "global": LocalBlockSpec(
        lambda d, h, kvh, kw, win: Block(d, h, attn_layer=partial(Attention, kv_heads=kvh), **kw)
    ),
    # Table 6, variant I: a Swin block pair (windows of `swin_window`, shifted by half).
    "swin": LocalBlockSpec(lambda d, h, kvh, kw, win: SwinLocalBlock(d, h, win, **kw)),
    # Table 6, variant II: CvT's convolutional embedding and attention.
    "cvt": LocalBlockSpec(
        lambda d, h, kvh, kw, win: Block(d, h, attn_layer=ConvProjectionAttention, **kw),
        embed=ConvTokenEmbedding,
        pos_embed=False,
    ),
}


class LocallyShiftedViT(StagedViT):
    """The LSA model: shift embedding -> local block -> pyramid of global stages -> head.

    Args:
        img_size: input size the position embeddings are built for (int or (H, W)).
        shifts: the (dy, dx) list; the first must be (0, 0).
        conv_per_variant: one conv per shifted copy (paper) or one shared conv after a reflection
            pre-shift (ablation C/D).
        pos_per_variant: a stage-1 position embedding per variant (T, N, C) or one shared (N, C).
        local_block: a key of ``LOCAL_BLOCKS``: ``'shift'`` (the paper), ``'global'`` (ablation
            A), ``'swin'`` or ``'cvt'`` (Table 6 variants I and II).
        dims, depths, num_heads: per stage; stage 1's depth counts the local block.
        kv_heads: key/value heads per stage (None = one per query head; 1 = multi-query).
        dynamic_img_size: accept other input sizes at run time by resizing position embeddings on
            the fly (otherwise a mismatching input is an error).
    """

    stem_pattern = r"^(?:patch_embed|pos_embed|local_block)"

    def __init__(
        self,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 3,
        num_classes: int = 10,
        shifts: Sequence[tuple[int, int]] = CIFAR_SHIFTS,
        conv_per_variant: bool = True,
        pos_per_variant: bool = True,
        embed_kernel: int = 3,
        embed_stride: int = 1,
        embed_padding: int = 1,
        dims: Sequence[int] = (192, 192, 192, 192),
        depths: Sequence[int] = (2, 4, 4, 4),
        num_heads: int | Sequence[int] = 3,
        kv_heads: int | Sequence[int | None] | None = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        local_block: str = "shift",
        swin_window: int = 8,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        dynamic_img_size: bool = False,
    ) -> None:
        super().__init__()
        n = len(dims)
        if len(depths) != n:
            raise ValueError(f"dims {tuple(dims)} and depths {tuple(depths)} differ in length")
        if depths[0] < 1:
            raise ValueError("stage 1 needs at least one block (the local block)")
        if local_block not in LOCAL_BLOCKS:
            raise ValueError(f"unknown local_block {local_block!r}; one of {list(LOCAL_BLOCKS)}")
        spec = LOCAL_BLOCKS[local_block]
        num_heads = per_stage(num_heads, n, "num_heads")
        kv_heads = per_stage(kv_heads, n, "kv_heads")
        self.img_size = to_2tuple(img_size)
        self.in_chans = in_chans
        self.dims = tuple(dims)
        self.depths = tuple(depths)
        self.dynamic_img_size = dynamic_img_size
        self.embed_conv = (embed_kernel, embed_stride, embed_padding)
        self.shifted = spec.shifted

        # Stem: embedding (T shifted copies, or the unshifted image alone), position embedding.
        self.patch_embed = spec.embed(
            shifts if spec.shifted else ((0, 0),), in_chans, dims[0], *self.embed_conv,
            conv_per_variant=conv_per_variant,
        )  # fmt: skip
        self.num_variants = self.patch_embed.num_variants
        self.grids = self._stage_grids(self.img_size)
        n_tok = self.grids[0][0] * self.grids[0][1]
        self.pos_per_variant = pos_per_variant and self.num_variants > 1
        self.pos_embed = None
        if spec.pos_embed:
            self.pos_embed = nn.Parameter(
                torch.zeros(self.num_variants if pos_per_variant else 1, n_tok, dims[0])
            )
            register_resize_on_load(self, lambda: {"pos_embed": (self.grids[0], 0)})

        dpr = drop_path_schedule(drop_path_rate, depths)
        block_kwargs = dict(
            mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate, attn_drop=attn_drop_rate
        )
        local_kwargs = dict(block_kwargs, drop_path=dpr[0][0])
        self.local_block = spec.build(dims[0], num_heads[0], kv_heads[0], local_kwargs, swin_window)

        # Stages: stage 1 holds the rest of its blocks; later stages downsample first.
        def block(i: int, rate: float) -> Block:
            attn = partial(Attention, kv_heads=kv_heads[i])
            return Block(dims[i], num_heads[i], attn_layer=attn, drop_path=rate, **block_kwargs)

        self.stages = nn.ModuleList(
            Stage(
                [block(i, r) for r in (dpr[i][1:] if i == 0 else dpr[i])],
                downsample=ConvDownsample(dims[i - 1], dims[i]) if i else None,
                dim=dims[i],
                pos_embed_grid=self.grids[i] if i else None,
            )
            for i in range(n)
        )
        self.init_head(dims[-1], num_classes, "avg", drop_rate)
        stride0 = self.img_size[0] // self.grids[0][0] if self.grids[0][0] else 1
        self.feature_info = pyramid_feature_info(dims, stride0)

        self.apply(init_vit_weights)
        for name, p in self.named_parameters():
            if name.endswith("pos_embed"):
                trunc_normal_(p, std=0.02)
        self._register_load_state_dict_pre_hook(_map_legacy_keys)

    # -- geometry ---------------------------------------------------------------------------

    def _stage_grids(self, img_size: Grid) -> list[Grid]:
        k, s, p = self.embed_conv
        grid = (conv_out_size(img_size[0], k, s, p), conv_out_size(img_size[1], k, s, p))
        if min(grid) < 1:
            raise ValueError(
                f"input {img_size[0]}x{img_size[1]} is too small for the {k}x{k} stride-{s} "
                "embedding conv"
            )
        grids = [grid]
        for _ in self.dims[1:]:
            grids.append(ConvDownsample.out_grid(grids[-1]))
        return grids

    # -- stem -------------------------------------------------------------------------------

    def forward_stem(self, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        """Image -> shift embedding (+ position) -> local block: stage 1's first tokens."""
        x = self.check_input(x)
        return lsa_stem(x, self.patch_embed, self.local_block, self.pos_embed, self.shifted,
                        self.grids[0], self.img_size, self.dynamic_img_size)  # fmt: skip

    def set_dense_mode(self) -> None:
        """Position embeddings resized to each input's grids at run time (bicubic)."""
        super().set_dense_mode()
        self.dynamic_img_size = True

    def checkpoint_filter_fn(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """lgvit's layout passes; the authors' released layout is refused, naming its model."""
        owner = checkpoint_layout_owner(state_dict)
        if owner is not None:
            raise LgvitError(
                f"a checkpoint in the authors' layout of {owner} does not load into the paper's "
                f"LSA models: load it as {owner} (--model {owner})"
            )
        return state_dict


def lsa_stem(
    x: torch.Tensor, embed: nn.Module, block: nn.Module, pos_embed: torch.Tensor | None,
    shifted: bool, built: Grid, img_size: Grid, dynamic: bool,
) -> tuple[torch.Tensor, Grid]:  # fmt: skip
    """:meth:`LocallyShiftedViT.forward_stem` after the input check; one node of a torch.fx
    graph (the variants are no tensor, and the batch and grid checks branch on shapes)."""
    if x.shape[0] == 0:  # the shifted-patch gather cannot run a batch of no images
        stem = partial(lsa_stem, embed=embed, block=block, pos_embed=pos_embed, shifted=shifted,
                       built=built, img_size=img_size, dynamic=dynamic)  # fmt: skip
        return stem_of_no_images(stem, x, embed, block)
    x0, variants, grid = embed(x, shifted)  # (B, N, C), ShiftedVariants
    if not dynamic and grid != built:
        raise ValueError(
            f"input {x.shape[-2]}x{x.shape[-1]} gives a {grid[0]}x{grid[1]} token grid but the "
            f"model was built for {img_size[0]}x{img_size[1]} ({built[0]}x{built[1]}); create "
            "it with img_size=... or dynamic_img_size=True"
        )
    if pos_embed is not None:
        pos = resize_pos_embed(pos_embed, built, grid)  # (T or 1, N, C)
        x0 = x0 + pos[0]
        variants = variants.add(pos) if variants is not None else None
    return (block(x0, variants, grid) if shifted else block(x0, grid)), grid


torch.fx.wrap("lsa_stem")


# Checkpoints saved before the shared model core (lgvit 0.1) named a few modules differently.
_LEGACY_RENAMES = (
    (r"local_block\.block\.", "local_block."),  # ablation A
    (r"local_block\.(q|k|v|proj)\.", r"local_block.attn.\1."),  # CvT block
    (r"local_block\.norms\.([02])\.", lambda m: f"local_block.blocks.{int(m[1]) // 2}.norm1."),
    (r"local_block\.norms\.([13])\.", lambda m: f"local_block.blocks.{int(m[1]) // 2}.norm2."),
    (r"local_block\.mlps\.(\d)\.", r"local_block.blocks.\1.mlp."),
    (r"local_block\.attns\.(\d)\.(proj|qkv)\.", r"local_block.blocks.\1.attn.\2."),
    (r"local_block\.attns\.(\d)\.rel_pos_bias$",
     r"local_block.blocks.\1.attn.rel_pos.relative_position_bias_table"),
)  # fmt: skip


def _map_legacy_keys(state_dict: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
    """Load hook: rename the keys of pre-core checkpoints (Swin's fused qkv keeps its layout)."""
    for key in [k for k in state_dict if k.startswith(prefix + "local_block.")]:
        rest = key[len(prefix) :]
        new = rest
        for pattern, repl in _LEGACY_RENAMES:
            new = re.sub(pattern, repl, new)
        if new != rest:
            state_dict[prefix + new] = state_dict.pop(key)


# ---------------------------------------------------------------------------------------------
# Registered configurations
# ---------------------------------------------------------------------------------------------


_MACS_NOTE = "the paper's FLOPs count one of the T embedding convs; measured MACs count all T"


def _cifar_cfg(params: float | None, **paper: Any) -> ModelConfig:
    ref = {"params_m": params, **paper}
    if "img_s" in paper:
        ref["hardware"] = LSA_PAPER_GPU
    return ModelConfig(
        input_size=(3, 32, 32),
        num_classes=10,
        mean=CIFAR_MEAN,
        std=CIFAR_STD,
        crop_pct=1.0,
        first_conv="patch_embed",
        dataset="cifar10",
        smoke_input_size=(3, 16, 16),
        paper=ref,
    )


def _imagenet_cfg(params: float, **paper: Any) -> ModelConfig:
    return ModelConfig(
        input_size=(3, 224, 224),
        first_conv="patch_embed",
        paper={"params_m": params, **paper, "hardware": LSA_PAPER_GPU},
    )


_TINY_CIFAR = dict(
    img_size=32, dims=(192,) * 4, depths=(2, 4, 4, 4), num_heads=3, kv_heads=1
)  # paper Table 2: tiny CIFAR shares one key/value head across the 3 query heads


def _build(defaults: dict[str, Any], kwargs: dict[str, Any]) -> LocallyShiftedViT:
    return LocallyShiftedViT(**{**defaults, **kwargs})


@register_model(
    config=_cifar_cfg(
        10.2,
        macs_g=2.7,
        cifar10_top1=97.00,
        cifar100_top1=81.80,
        img_s=1700,
        macs_note="the paper prints no CIFAR FLOPs: 2.7G is an estimate from its architecture",
    )  # fmt: skip
)
def lsa_tiny_cifar(**kwargs: Any) -> LocallyShiftedViT:
    """Tiny CIFAR model: 18 shifts, 192-wide, 3 heads, one shared K/V head, depths 2-4-4-4."""
    return _build(_TINY_CIFAR, kwargs)


@register_model(config=_cifar_cfg(36.2, cifar10_top1=97.64, cifar100_top1=83.66, img_s=808))
def lsa_small_cifar(**kwargs: Any) -> LocallyShiftedViT:
    """Small CIFAR model: 18 shifts, 384-wide, 6 heads, depths 2-4-4-4."""
    return _build(dict(img_size=32, dims=(384,) * 4, depths=(2, 4, 4, 4), num_heads=6), kwargs)


@register_model(config=_cifar_cfg(115.8, cifar10_top1=97.75, cifar100_top1=84.70, img_s=277))
def lsa_base_cifar(**kwargs: Any) -> LocallyShiftedViT:
    """Base CIFAR model: 18 shifts, 768-wide, 12 heads, depths 3-3-3-3."""
    return _build(dict(img_size=32, dims=(768,) * 4, depths=(3, 3, 3, 3), num_heads=12), kwargs)


@register_model(
    config=_imagenet_cfg(9.9, macs_g=3.1, imagenet_top1=76.0, img_s=797, macs_note=_MACS_NOTE)
)
def lsa_tiny_224(**kwargs: Any) -> LocallyShiftedViT:
    """Tiny ImageNet model: 10 shifts, 9x9 stride-7 embedding (32x32 tokens), 4 heads.

    The paper's 3.1G FLOPs counted one of the T embedding convs; ``lgvit info`` reports the
    measured MACs.
    """
    return _build(
        dict(
            img_size=224, shifts=IMAGENET_SHIFTS, embed_kernel=9, embed_stride=7,
            embed_padding=1, dims=(192,) * 4, depths=(2, 4, 4, 4), num_heads=4,
        ),
        kwargs,
    )  # fmt: skip


@register_model(
    config=_imagenet_cfg(22.0, macs_g=7.6, imagenet_top1=82.2, img_s=299, macs_note=_MACS_NOTE)
)
def lsa_small_224(**kwargs: Any) -> LocallyShiftedViT:
    """Small ImageNet model: 10 shifts, 4x4 stride-4 embedding (56x56 tokens), 3 stages."""
    return _build(
        dict(
            img_size=224, shifts=IMAGENET_SHIFTS, embed_kernel=4, embed_stride=4,
            embed_padding=0, dims=(64, 192, 384), depths=(2, 2, 10), num_heads=(2, 6, 12),
        ),
        kwargs,
    )  # fmt: skip


# Table 5 ablations of the tiny CIFAR model.
@register_model(config=_cifar_cfg(6.8, cifar10_top1=96.50, ablation="A"))
def lsa_tiny_cifar_a(**kwargs: Any) -> LocallyShiftedViT:
    """Ablation A: no shifts and no local block (a global block takes its place)."""
    return _build({**_TINY_CIFAR, "local_block": "global"}, kwargs)


@register_model(config=_cifar_cfg(8.4, ablation="B"))
def lsa_tiny_cifar_b(**kwargs: Any) -> LocallyShiftedViT:
    """Ablation B: the 9 axis-aligned shifts, conv and position embedding per variant."""
    return _build({**_TINY_CIFAR, "shifts": AXIS_SHIFTS}, kwargs)


@register_model(config=_cifar_cfg(6.8, ablation="C"))
def lsa_tiny_cifar_c(**kwargs: Any) -> LocallyShiftedViT:
    """Ablation C: 18 reflection-padded pre-shifts, one shared conv, one shared position emb."""
    return _build({**_TINY_CIFAR, "conv_per_variant": False, "pos_per_variant": False}, kwargs)


@register_model(config=_cifar_cfg(10.1, ablation="D"))
def lsa_tiny_cifar_d(**kwargs: Any) -> LocallyShiftedViT:
    """Ablation D: 18 reflection-padded pre-shifts, one shared conv, position emb per variant."""
    return _build({**_TINY_CIFAR, "conv_per_variant": False}, kwargs)


@register_model(
    config=_cifar_cfg(
        None,
        paper_params_m=7.6,
        ablation="E",
        params_note="the paper prints 7.6M, which its own architecture does not give",
    )
)
def lsa_tiny_cifar_e(**kwargs: Any) -> LocallyShiftedViT:
    """Ablation E: conv per variant, one shared position embedding.

    The paper lists 7.6M, which its own arithmetic does not give; we report the
    measured count (6.89M).
    """
    return _build({**_TINY_CIFAR, "pos_per_variant": False}, kwargs)


# Table 6: other local blocks in place of ours.
@register_model(config=_cifar_cfg(None, cifar10_top1=96.3, ablation="I"))
def lsa_tiny_cifar_swin_local(**kwargs: Any) -> LocallyShiftedViT:
    """Table 6 variant I: a Swin block pair (8x8 windows, shift 4) replaces the local block."""
    return _build({**_TINY_CIFAR, "local_block": "swin"}, kwargs)


@register_model(  # CvT's embedding is one plain conv
    config=dataclasses.replace(_cifar_cfg(None, ablation="II"), first_conv="patch_embed.proj")
)
def lsa_tiny_cifar_cvt_local(**kwargs: Any) -> LocallyShiftedViT:
    """Table 6 variant II: CvT conv token embedding + conv-projection attention block."""
    return _build({**_TINY_CIFAR, "local_block": "cvt"}, kwargs)


@register_model(config=_cifar_cfg(None))
def lsa_micro_cifar(**kwargs: Any) -> LocallyShiftedViT:
    """A small member of the family for CPU runs (not in the paper).

    Same blocks, fewer and narrower layers: a 3x3 stride-2 embedding (16x16 tokens) with the 9
    axis-aligned shifts -- shifts finer than the stride, as the paper's ImageNet models use.
    """
    return _build(
        dict(
            img_size=32, shifts=AXIS_SHIFTS, embed_kernel=3, embed_stride=2, embed_padding=1,
            dims=(64, 128, 160), depths=(2, 2, 2), num_heads=(2, 4, 5),
        ),
        kwargs,
    )  # fmt: skip
