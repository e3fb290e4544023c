"""Multi-head attention: one SDPA helper every attention uses, and one ``Attention`` module.

``Attention`` covers the variants the three families need with keyword arguments:
``kv_heads`` (grouped / multi-query keys and values, LSA's tiny CIFAR model), ``sr_ratio``
(PVT's spatial-reduction attention: keys and values from a strided-conv-reduced map) and
``rel_pos_grid`` (a learned relative-position bias over a token grid: Swin windows, LIT's whole
stage map).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.core.runtime import cpu_bf16_support
from lgvit.models.layers.helpers import Grid, to_2tuple, tokens_to_map
from lgvit.models.layers.pos_embed import (
    grid_differs,
    grid_of_rel_table,
    is_symbolic,
    resize_rel_pos_table,
)
from lgvit.models.layers.weight_init import trunc_normal_

LN_EPS = 1e-6  # DeiT / the LSA authors' LayerNorm epsilon


def multihead_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    kv_heads: int | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q (B, N, H*d)`` over ``k, v (B, M, Hkv*d)`` -> ``(B, N, H*d)``.

    Heads are the channel blocks (head h = channels ``h*d : (h+1)*d``). With fewer key/value
    heads than query heads, the query heads that share one are stacked along the query length
    (the grouped-query trick): one ``(g*N x M)`` attention per key/value head instead of ``g``
    separate ones, with no copy of the keys and values. ``attn_mask`` is an additive bias
    broadcastable to ``(B, H, N, M)``, or ``(P, H or 1, N, M)`` with ``P`` dividing ``B``: sample
    ``b`` then takes mask ``b % P`` (Swin's shifted windows: one mask per window of an image,
    repeating over the images, never copied ``B / P`` times on the CPU); ``scale`` defaults to
    ``1/sqrt(d)``. Runs in ``F.scaled_dot_product_attention``.
    """
    B, N, _ = q.shape
    M = k.shape[1]
    kvh = kv_heads or num_heads
    g = num_heads // kvh
    d = q.shape[-1] // num_heads
    q = q.view(B, N, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * N, d)
    k = k.view(B, M, kvh, d).transpose(1, 2)
    v = v.view(B, M, kvh, d).transpose(1, 2)
    if attn_mask is not None:
        mask = attn_mask.expand(*attn_mask.shape[:-3], num_heads, N, M)
        attn_mask = mask.reshape(*mask.shape[:-3], kvh, g * N, M)
    cpu = q.device.type == "cpu"
    low = cpu and q.dtype != torch.float32
    if (low and (torch.is_grad_enabled() or not _amx())) or (
        attn_mask is not None and (cpu or _is_exporting())
    ):
        # bf16 on the CPU: the fused kernel's backward is slow (see _explicit_attention), and
        # without AMX its forward too (AMD EPYC avx512_bf16, batch 32 inference: DeiT-T 91.6
        # -> 104.8 img/s, LocalViT-T 72.0 -> 81.5; with AMX the fused forward was level with
        # explicit timm 0.3.2: DeiT-T 195 vs 189 img/s). fp32: fused (DeiT-T 60.6 vs 58.5).
        # With a mask on the CPU the fused call often falls back to torch's math kernel, whose
        # safe softmax scans every row for full masking (aten::all + where: 62 of 1381 ms of a
        # Swin-T bf16 batch): explicit is faster (Swin-T bf16 inference, batch 32, AMD EPYC
        # avx512_bf16: 24.7 -> 29.4 img/s; fp32 and training unchanged; bench_peers.py).
        # Exporting with a mask: the fused CPU kernel's output layout makes the ONNX
        # exporter's decomposition record a view its own graph cannot take.
        if attn_mask is not None and torch.is_grad_enabled():
            # training: bf16 logits (Swin-T bf16 step 10.3 img/s, with float32 logits 10.1)
            attn_mask = attn_mask.to(q.dtype)
        x = _explicit_attention(q, k, v, attn_mask, dropout_p, scale)
    else:
        if attn_mask is not None:  # cast before the copy per sample: one small cast
            attn_mask = per_sample_mask(attn_mask.to(q.dtype), B)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale
        )
    return x.view(B, kvh, g, N, d).permute(0, 3, 1, 2, 4).reshape(B, N, num_heads * d)


# torch.compiler.is_exporting came in torch 2.6 (on 2.4 and 2.5 its call was an AttributeError
# for masked attention off the CPU); there an export takes the fused kernel.
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)

# CUDA's limit on a grid's y and z sizes, where kernels put a batch: flash attention's grid is
# (query blocks, batch, heads), batched GEMV/GEMM kernels put the batch in z. LSA's local
# attention is one tiny problem per position and head (B*N*heads of them: 262,144 for
# lsa_tiny_224 at batch 64), so its batched matmuls are cut to pieces of at most this many.
MAX_KERNEL_BATCH = 65535


def chunked_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``, run as bmm calls of at most :data:`MAX_KERNEL_BATCH` matrices each.

    ``split`` rather than slices: its backward writes each operand's gradient once (a cat).
    Under torch.compile or torch.export (a symbolic batch) it is one bmm: the graph must not
    depend on the batch size, and the compiler chooses its own kernels."""
    n = a.shape[0]
    if torch.compiler.is_compiling() or isinstance(n, torch.SymInt) or n <= MAX_KERNEL_BATCH:
        return torch.bmm(a, b)
    pieces = zip(a.split(MAX_KERNEL_BATCH), b.split(MAX_KERNEL_BATCH), strict=True)
    return torch.cat([torch.bmm(x, y) for x, y in pieces])


# Read once at import (/proc/cpuinfo): torch.compile then reads a constant instead of tracing a
# file read. (torch.compiler.assume_constant_result would do it too, but applying it imports
# torch._dynamo: +1.0 s on every `import lgvit`.)
_AMX = cpu_bf16_support() == "amx_bf16"


def _amx() -> bool:
    return _AMX


def per_sample_mask(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """A periodic mask (see :func:`multihead_sdpa`) repeated to one per sample, as the fused
    kernel takes it; any other mask as it is."""
    if not _periodic(mask, batch):
        return mask
    return mask.expand(batch // mask.shape[0], *mask.shape).flatten(0, 1)


def _periodic(mask: torch.Tensor | None, batch: int) -> bool:
    return mask is not None and mask.dim() == 4 and mask.shape[0] not in (1, batch)


def _add_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits (B, ...) + mask``, a periodic mask (see :func:`multihead_sdpa`) added through a
    ``(B / P, P, ...)`` view: broadcast, not copied per sample."""
    if not _periodic(mask, logits.shape[0]):
        return logits + mask
    P = mask.shape[0]
    return (logits.view(-1, P, *logits.shape[1:]) + mask).flatten(0, 1)


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    num_heads: int,
    kv_heads: int | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The probabilities :func:`multihead_sdpa` weights the values with: ``(B, H, N, M)`` in
    float32, from the same ``q (B, N, H*d)``, ``k (B, M, Hkv*d)``, mask and scale."""
    B, N, _ = q.shape
    M = k.shape[1]
    kvh = kv_heads or num_heads
    d = q.shape[-1] // num_heads
    qh = q.float().view(B, N, num_heads, d).transpose(1, 2)
    kh = k.float().view(B, M, kvh, d).transpose(1, 2).repeat_interleave(num_heads // kvh, dim=1)
    logits = (qh * (scale or d**-0.5)) @ kh.transpose(-2, -1)
    if attn_mask is not None:
        logits = _add_mask(logits, attn_mask.float())
    return logits.softmax(-1)


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with batched matmuls. Used on the CPU for masked
    attention (see :func:`multihead_sdpa`) and for bf16/fp16 training: the fused kernel's
    backward is slow there (DeiT-T, batch 64: 41 ms per block against about 18 ms for these
    matmuls and softmax; a training step 1.35x faster). In fp32 the fused kernel is as fast or
    faster (lsa_tiny_cifar: 10.6 vs 8.3-10.0 img/s), so it stays."""
    a = (q * (scale or q.shape[-1] ** -0.5)) @ k.transpose(-2, -1)
    if attn_mask is not None:
        # In inference a float32 mask (a bias under autocast) makes float32 logits, so the
        # softmax runs in float32 as timm's: Swin-T's first-stage window attention, bf16,
        # batch 64, AMD EPYC avx512_bf16: 142 -> 128 ms, the model 30.0 -> 30.7 img/s (LIT-S
        # level). Without a mask bf16's softmax is faster (DeiT-T's shapes: 10%).
        a = _add_mask(a, attn_mask)
    a = a.softmax(-1)
    if dropout_p:
        a = F.dropout(a, dropout_p)
    return a.to(v.dtype) @ v


def stacked_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear computing ``parts`` at once (their rows stacked), their initial values kept;
    ``row_parts`` lets a later initialisation draw each part's rows as it drew the part's."""
    with torch.device("meta"):  # no draw from the random stream: the parts have drawn
        out = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                        bias=parts[0].bias is not None)  # fmt: skip
    out.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]))
    if out.bias is not None:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]))
    out.row_parts = tuple(p.out_features for p in parts)
    return out


class RelativePositionBias(nn.Module):
    """Learned bias per head for every relative offset inside an ``H x W`` token grid.

    The table has ``(2H-1)(2W-1)`` rows (Swin's layout); ``forward()`` gives the
    ``(heads, H*W, H*W)`` bias. The index is rebuilt from the grid, not stored.
    """

    def __init__(self, grid: int | Grid, num_heads: int) -> None:
        super().__init__()
        self.grid = to_2tuple(grid)
        H, W = self.grid
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * H - 1) * (2 * W - 1), num_heads)
        )
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(H, W), False)
        # (grid, device, inference mode) -> the index of another grid, built once, not on
        # every call (on the host, then copied to the device); not part of the state dict
        self._indices: dict[tuple, torch.Tensor] = {}
        self._register_load_state_dict_pre_hook(self._resize_on_load)

    def _resize_on_load(self, state_dict: dict, prefix: str, *args: object) -> None:
        """A table trained for another grid (another input size) is resized, bicubic."""
        key = prefix + "relative_position_bias_table"
        old = state_dict.get(key)
        table = self.relative_position_bias_table
        if old is not None and old.shape[0] != table.shape[0] and old.shape[1:] == table.shape[1:]:
            state_dict[key] = resize_rel_pos_table(
                old, grid_of_rel_table(old.shape[0], self.grid), self.grid
            )

    def forward(self, hw: Grid | None = None) -> torch.Tensor:
        """``(heads, N, N)`` bias for the built grid, or for ``hw`` (another input size): then
        the table is resized, bicubic, on the fly."""
        table, index = self.relative_position_bias_table, self.relative_position_index
        return relative_bias(table, index, self.grid, hw, self._indices)


def relative_bias(
    table: torch.Tensor,
    index: torch.Tensor,
    built: Grid,
    hw: Grid | None,
    indices: dict[tuple, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:meth:`RelativePositionBias.forward`: ``(heads, N, N)`` from the table built for the
    ``built`` grid, resized when ``hw`` differs (its index kept in ``indices``)."""
    if hw is not None and grid_differs(hw, built):
        table = resize_rel_pos_table(table, built, hw)
        index = _grid_index(hw, table.device, indices)
    n = index.shape[0]
    return table[index.view(-1)].view(n, n, -1).permute(2, 0, 1)


def _grid_index(
    hw: Grid, device: torch.device, indices: dict[tuple, torch.Tensor] | None
) -> torch.Tensor:
    """:func:`relative_position_index` of ``hw`` on ``device``, built once per grid. Built in
    the graph under torch.compile (a cache entry added while tracing) and for a symbolic grid;
    one entry per inference mode: autograd may not save an inference tensor (the gather's
    backward saves the index)."""
    if indices is None or is_symbolic(hw) or torch.compiler.is_compiling():
        return relative_position_index(*hw).to(device)
    key = (tuple(hw), str(device), torch.is_inference_mode_enabled())
    if key not in indices:
        indices[key] = relative_position_index(*hw).to(device)
    return indices[key]


def relative_position_index(H: int, W: int) -> torch.Tensor:
    """``(H*W, H*W)``: row of the relative-bias table for each (query, key) pair."""
    coords = torch.stack(torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    return (rel[..., 0] + H - 1) * (2 * W - 1) + (rel[..., 1] + W - 1)


class Attention(nn.Module):
    """Multi-head self-attention over all tokens.

    Args:
        kv_heads: number of key/value heads: ``num_heads`` (default) is standard attention, 1 is
            multi-query attention (one key/value head shared by every query head).
        sr_ratio: PVT's spatial reduction: keys and values come from the map reduced by a
            ``sr x sr`` stride-``sr`` conv + LayerNorm (``forward`` then needs the grid).
        rel_pos_grid: add a learned relative-position bias over this token grid (the tokens
            must then form exactly that grid).
        qk_scale: the logit scale (default ``1/sqrt(head_dim)``; T2T-ViT's released weights were
            trained with ``1/sqrt(dim)``).

    Without spatial reduction the projections are one ``qkv`` Linear (timm's layout), else
    ``q`` and ``kv``; either layout loads into either (:meth:`_qkv_layout_on_load`).
    """

    # Whether queries, keys and values may come from one projection of the same tokens (False
    # in LSA's local attention: keys and values come from the shifted variants).
    fuse_qkv = True

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        kv_heads: int | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        sr_ratio: int = 1,
        rel_pos_grid: int | Grid | None = None,
        norm_layer: type[nn.Module] | None = None,
        qk_scale: float | None = None,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        kv_heads = kv_heads or num_heads
        if num_heads % kv_heads:
            raise ValueError(f"num_heads {num_heads} is not divisible by kv_heads {kv_heads}")
        self.num_heads = num_heads
        self.kv_heads = kv_heads
        self.head_dim = dim // num_heads
        # One projection where queries, keys and values come from the same tokens (timm's
        # ``qkv``: one GEMM, no concatenation of q's and kv's weights on every call); separate
        # ``q`` and ``kv`` where keys and values come from other tokens (spatial reduction,
        # LSA's shifted variants).
        self.fused = self.fuse_qkv and sr_ratio == 1
        ckv = 2 * kv_heads * self.head_dim
        if self.fused:  # drawn as q then kv: a seed gives the weights it gave before the fusion
            self.qkv = stacked_linear(nn.Linear(dim, dim, qkv_bias), nn.Linear(dim, ckv, qkv_bias))
        else:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(dim, ckv, bias=qkv_bias)
        self._register_load_state_dict_pre_hook(self._qkv_layout_on_load)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, sr_ratio, stride=sr_ratio)
            self.norm = (norm_layer or _default_norm)(dim)
        self.rel_pos = RelativePositionBias(rel_pos_grid, num_heads) if rel_pos_grid else None
        self.qk_scale = qk_scale
        # A list while attention is being captured (lgvit.tools.viz.capture_attention): each call
        # appends (probabilities (B, H, N, M), grid). None costs one test per call.
        self.captured: list[tuple[torch.Tensor, Grid | None]] | None = None

    def _qkv_layout_on_load(self, state_dict: dict, prefix: str, *args: object) -> None:
        """Load hook: lgvit's checkpoints before the fused projection (and the layouts mapped
        onto them) hold ``q`` and ``kv``; timm's and the authors' hold ``qkv`` (rows q, k, v).
        Either loads into this module's layout."""
        for part in ("weight", "bias"):
            q, kv, qkv = (f"{prefix}{name}.{part}" for name in ("q", "kv", "qkv"))
            if self.fused and q in state_dict and kv in state_dict:
                state_dict[qkv] = torch.cat([state_dict.pop(q), state_dict.pop(kv)])
            elif not self.fused and qkv in state_dict:
                w = state_dict.pop(qkv)
                c = self.num_heads * self.head_dim
                state_dict[q], state_dict[kv] = w[:c], w[c:]

    def _keys_values(self, x: torch.Tensor, hw: Grid | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sr_ratio > 1:
            if hw is None:  # (tokens_to_map checks that the tokens form it)
                raise ValueError("spatial-reduction attention needs the image tokens' grid")
            x = self.norm(self.sr(tokens_to_map(x, hw)).flatten(2).transpose(1, 2))
        kv = self.kv(x)
        c = self.kv_heads * self.head_dim
        return kv[..., :c], kv[..., c:]

    def _split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of the same tokens from the one ``qkv`` matmul."""
        c, ckv = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        # split, not three slices: its backward writes the (B, N, 3C) gradient once (a cat),
        # where each slice's backward zero-fills a full-size tensor and they are then added
        # (DeiT-T fp32 training, batch 32: 36 fills and 24 adds of that size, 25 ms a step).
        q, k, v = self.qkv(x).split([c, ckv, ckv], dim=-1)
        return q, k, v

    def forward(
        self, x: torch.Tensor, hw: Grid | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.fused:
            q, k, v = self._split_qkv(x)
        else:
            k, v = self._keys_values(x, hw)
            q = self.q(x)
        if self.rel_pos is not None:
            bias = self.rel_pos(hw)
            attn_mask = bias if attn_mask is None else attn_mask + bias
        drop = self.attn_drop if self.training else 0.0
        if self.captured is not None:
            p = attention_probs(q, k, self.num_heads, self.kv_heads, attn_mask, self.qk_scale)
            self.captured.append((p, hw))
        x = multihead_sdpa(q, k, v, self.num_heads, self.kv_heads, attn_mask, drop, self.qk_scale)
        return self.proj_drop(self.proj(x))


# torch.fx: one graph node each (they choose a kernel by device and dtype, or compare grids,
# at run time).
torch.fx.wrap("multihead_sdpa")
torch.fx.wrap("relative_bias")


def unfused_qkv_names(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Each fused ``qkv`` parameter of ``model`` -> the ``q`` and ``kv`` parameters lgvit
    stored in its place before the fusion (their rows, in that order, are ``qkv``'s). What a
    resumed run needs to carry an older run's optimizer state and weight average over."""
    names: dict[str, tuple[str, str]] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, Attention) and m.fused:
            p = f"{prefix}." if prefix else ""
            for part in ("weight", "bias"):
                if getattr(m.qkv, part) is not None:
                    names[f"{p}qkv.{part}"] = (f"{p}q.{part}", f"{p}kv.{part}")
    return names


def fuse_older_qkv(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a state dict of ``model``'s architecture, e.g. a weight average) with an older
    run's ``q`` + ``kv`` entries stacked into ``qkv``, as the load hook does for weights."""
    state = dict(state)
    for fused, (q, kv) in unfused_qkv_names(model).items():
        if q in state and kv in state and fused not in state:
            state[fused] = torch.cat([state.pop(q), state.pop(kv)])
    return state


def _default_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=LN_EPS)
