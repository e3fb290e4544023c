"""LSA's local attention over the shifted variants: the softmax over each position's T
variants that both paths share (:func:`attend_variants`), and the fast path of
:class:`~lgvit.models.lsa.LocalShiftAttention`, folded, equal to the plain path
(tests/test_lsa_fold.py).

The plain path builds the T shifted variants of every token, normalises them and projects
them to keys and values. Here the LayerNorm and the key/value projection fold into the
embedding conv, so keys and values come straight from the im2col patches and the variants
are never written (:func:`fold_projection`); the per-position offsets enter the attention as
a logit bias and a value correction (:func:`attend_folded`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.models.layers.attention import Attention, chunked_bmm
from lgvit.models.layers.helpers import autocast_dtype, contiguous_grad


@dataclass(frozen=True)
class FoldedProjection:
    """``linear(norm(variants))`` in parts: ``(scaled @ weight).view(T, B, N, -1) + scale *
    offset[:, None] + bias`` (see :func:`fold_projection`)."""

    scaled: torch.Tensor  # (T, B*N, K): the patches times each token's 1/std
    weight: torch.Tensor  # (T or 1, K, out): conv, norm affine and linear folded together
    scale: torch.Tensor  # (T, B, N, 1): each variant token's 1/std
    offset: torch.Tensor  # (T or 1, N or 1, out)
    bias: torch.Tensor  # (out,)


def fold_projection(
    patches: torch.Tensor,
    weight: torch.Tensor,
    offset: torch.Tensor,
    shape: torch.Size,
    norm: nn.Module,
    linear: nn.Linear,
) -> FoldedProjection | None:
    """``linear(norm(variants))`` as a :class:`FoldedProjection`, or ``None`` (build the
    variants instead) when ``norm`` is not a LayerNorm over the channels or the patch is
    at least as wide as the embedding. Variant t of token n is ``patches[t, b*N + n] @
    weight[t] + offset[t, n]`` (``shape``: ``(T, B, N, C)``).

    With w the conv weight and c the offset, both centred over the channels (LayerNorm
    subtracts each token's mean, so ``v - mean(v) = P w + c``):
    ``linear(norm(v)) = (rstd P) (w diag(g) L) + rstd (c diag(g) L) + (b L + l)`` for the
    norm's weight g and bias b, the linear map L and its bias l, with
    ``1/rstd^2 = ||P w + c||^2 / C + eps = (P G P' + 2 P h + s) / C + eps``,
    ``G = w w'``, ``h = w c'``, ``s = ||c||^2``. The statistics run in float32 whatever
    the autocast precision, as LayerNorm does under autocast.
    """
    T, B, N, C = shape
    if not (isinstance(norm, nn.LayerNorm) and tuple(norm.normalized_shape) == (C,)):
        return None
    if patches.shape[-1] >= C:
        # A patch as wide as the embedding (lsa_tiny_224: 9x9 RGB = 243 values for 192
        # channels): its K x K statistics cost more than building the variants; folded,
        # lsa_tiny_224 ran 1.4x slower (bf16, batch 16).
        return None
    w = weight - weight.mean(-1, keepdim=True)  # (T', K, C)
    c = offset - offset.mean(-1, keepdim=True)  # (T'', N, C)
    lin = linear.weight.t()  # (C, out)
    g_lin = lin if norm.weight is None else norm.weight[:, None] * lin
    e = linear.bias if linear.bias is not None else lin.new_zeros(lin.shape[1])
    if norm.bias is not None:
        e = e + norm.bias @ lin
    dev = patches.device.type
    amp = autocast_dtype(dev)
    with torch.autocast(dev, enabled=False) if amp else contextlib.nullcontext():
        sd = torch.promote_types(patches.dtype, torch.float32)
        p = patches.to(sd)  # (T, B*N, K)
        wf, cf = w.to(sd), c.to(sd)
        gram = wf @ wf.transpose(1, 2)  # (T', K, K)
        h = 2 * cf @ wf.transpose(1, 2)  # (T'', N, K)
        # one (B*N x K) matmul per variant: a batch of T, not T*B (CUDA's grid limit)
        pg = torch.matmul(p, gram).view(T, B, N, -1)
        quad = ((pg + h[:, None]) * p.view(T, B, N, -1)).sum(-1)  # (T, B, N)
        var = (quad + cf.square().sum(-1)[:, None]).clamp_min(0) / C
        rstd = torch.rsqrt(var + norm.eps)[..., None]  # (T, B, N, 1)
        scaled = (p.view(T, B, N, -1) * rstd).view(T, B * N, -1)  # rstd scales K, not `out`
    # cast once here, not in each matmul that reads it: to autocast's type or the weights'
    scaled = scaled.to(amp or w.dtype)
    return FoldedProjection(scaled, w @ g_lin, rstd, c @ g_lin, e)


def attend_variants(
    attn: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    drop: float,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's query attends over its T variants' keys and values.

    ``q (B, N, heads*dh)``; ``k, v (T, B*N, kv_heads*dh)``, variant-major as the projection
    makes them (any strides a view gives); ``logit_bias`` is added to the ``(B, N, kv_heads,
    g, T)`` logits (g query heads per key/value head). Returns the weighted values ``(B, N,
    kv_heads, g, dh)`` and the probabilities ``(B, N, kv_heads, g, T)`` in float32, after
    dropout. Each position and key/value head is one small problem (g x T logits), B*N*kv_heads
    of them: batched matmuls cut by :func:`~lgvit.models.layers.attention.chunked_bmm` to
    CUDA's grid limit, not SDPA, whose CUDA kernels take at most 65,535 problems a call; the
    softmax runs over T in float32 (a tensor dh times smaller than the keys).
    """
    T = k.shape[0]
    B, N = q.shape[:2]
    kvh, dh = attn.kv_heads, attn.head_dim
    g = attn.num_heads // kvh
    rows = B * N * kvh
    kp, vp = _position_major(k, rows, dh), _position_major(v, rows, dh)  # (rows, T, dh)
    logits = chunked_bmm(q.reshape(rows, g, dh), kp.transpose(1, 2)).view(B, N, kvh, g, T)
    if logit_bias is not None:
        logits = logits + logit_bias
    p = (logits.to(torch.promote_types(logits.dtype, torch.float32)) * dh**-0.5).softmax(-1)
    if attn.captured is not None:  # (B, heads, N, T): each position's weights over shifts
        attn.captured.append((p.view(B, N, attn.num_heads, T).transpose(1, 2), None))
    if drop:
        p = F.dropout(p, drop)
    x = chunked_bmm(p.view(rows, g, T).to(vp.dtype), vp)
    return x.view(B, N, kvh, g, dh), p


def _position_major(x: torch.Tensor, rows: int, dh: int) -> torch.Tensor:
    """``(T, B*N, kv_heads*dh)`` -> ``(B*N*kv_heads, T, dh)``: a strided view where the heads'
    blocks are adjacent (the matmuls read it as it is), else a copy. On the CPU always a copy:
    bf16 batched matmuls copy strided operands anyway (in the forward and again in the
    backward); one explicit copy each, whose gradient comes back contiguous, made a bf16
    training step ~5% faster."""
    T = x.shape[0]
    x = x.reshape(T, rows, dh).transpose(0, 1) if x.is_contiguous() else _copy_rows(x, rows, dh)
    return x.contiguous() if x.device.type == "cpu" else x


def _copy_rows(x: torch.Tensor, rows: int, dh: int) -> torch.Tensor:
    T = x.shape[0]
    return x.view(T, -1, x.shape[-1] // dh, dh).permute(1, 2, 0, 3).reshape(rows, T, dh)


def attend_folded(
    attn: Attention, q: torch.Tensor, f: FoldedProjection, drop: float
) -> torch.Tensor:
    """``attn``'s softmax attention of ``q (B, N, C)`` over keys/values ``f`` -> ``(B, N, C)``.

    With ``k_t = (rstd P) Wk + rstd_t dk_t(n) + ek`` (and v alike): ``ek`` is the same for
    every variant, so it cancels in the softmax; ``rstd_t q.dk_t(n)`` is a logit bias;
    ``sum_t p_t (rstd_t dv_t(n)) + ev sum_t p_t`` is added to ``p @ (rstd P) Wv``. Only
    ``(rstd P) Wk`` and ``(rstd P) Wv`` have the size of the variants (T x the tokens,
    ``kv_heads*head_dim`` wide). Measured on lsa_tiny_cifar (bf16, batch 64, 2 cores)
    against building ``kv(LN(variants))`` and attending with SDPA: the whole model 1.18x
    (inference) and 1.19x (training step), peak memory 0.58x.
    """
    T, B, N, _ = f.scale.shape
    kvh, dh = attn.kv_heads, attn.head_dim
    g = attn.num_heads // kvh
    ck = kvh * dh
    k = contiguous_grad(torch.matmul(f.scaled, f.weight[..., :ck]))  # (T, B*N, kvh*dh)
    v = contiguous_grad(torch.matmul(f.scaled, f.weight[..., ck:]))
    offset = f.offset.expand(T, N, -1)
    dk = offset[..., :ck].reshape(T, N, kvh, dh).to(q.dtype)
    dv = offset[..., ck:].reshape(T, N, kvh, dh)
    rstd = f.scale[..., 0].permute(1, 2, 0)[:, :, None, None]  # (B, N, 1, 1, T)
    bias = rstd * torch.einsum("bnjgd,tnjd->bnjgt", q.view(B, N, kvh, g, dh), dk)
    x, p = attend_variants(attn, q, k, v, drop, bias)
    pr = (p * rstd).to(dv.dtype)
    x = x + torch.einsum("bnjgt,tnjd->bnjgd", pr, dv).to(x.dtype)
    x = x + p.sum(-1, keepdim=True).to(x.dtype) * f.bias[ck:].view(kvh, 1, dh).to(x.dtype)
    return x.reshape(B, N, kvh * g * dh)
