"""LSA's local attention within CUDA's limits, and equal to the implementation before it.

On an H200 (torch 2.11) ``lsa_tiny_224`` failed at batch 64: its local attention called SDPA on
``(images x 1024 positions, 4 heads, 1, 48)`` queries, and flash attention's grid has the batch
in a dimension CUDA caps at 65,535 (cuDNN failed too). Each position's attention over its T
variants is now batched matmuls cut into pieces of at most 65,535 matrices. These tests run the
models on the meta device (shapes only, no memory), watch every attention and batched matmul
they make, forward and backward, and compare the outputs and gradients with the previous code
(kept here as the reference) on real tensors.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lgvit
from lgvit.models.layers import as_written, attention, lsa_folded, multihead_sdpa
from lgvit.models.lsa import LocalShiftAttention, ShiftedVariants

LIMIT = 65_535  # CUDA's largest grid y / z size


class _BatchedCalls(TorchDispatchMode):
    """Records the batch of every batched matmul the autograd engine and the ops below
    ``torch.matmul`` / ``torch.einsum`` / SDPA's math path run (the backward's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("bmm", "baddbmm"):
            self.batches.append((name, args[-2].shape[0]))  # (batch, n, k) @ (batch, k, m)
        elif name.startswith("_scaled_dot_product") or name.startswith("_flash_attention"):
            self.batches.append((name, args[0].shape[0] * args[0].shape[1]))
        return func(*args, **(kwargs or {}))


@contextmanager
def _watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every attention and batched matmul: SDPA at the Python level (on the meta device it
    decomposes before the dispatch mode sees it), bmm/baddbmm at the dispatch level."""
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        # batch x heads: flash's grid is (query blocks, batch, heads), and with split keys
        # (batch x heads) in one dimension; checked together, conservatively
        seen.append(("sdpa", q.shape[:-2].numel()))
        return sdpa(q, k, v, *args, **kwargs)

    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    mode = _BatchedCalls()
    with mode:
        yield seen
    seen.extend(mode.batches)


@pytest.mark.parametrize(
    ("name", "size", "written"),
    [
        ("lsa_tiny_224", 224, False),  # the patch is wider than the embedding: plain path
        ("lsa_tiny_cifar", 32, False),  # the folded path, one key/value head
        ("lsa_tiny_cifar", 32, True),  # the variants built (counting MACs runs so)
    ],
)
def test_lsa_runs_no_kernel_over_cudas_grid_limit_at_batch_256(monkeypatch, name, size, written):
    """At batch 256 (262,144 positions x 4 heads for lsa_tiny_224) every attention and batched
    matmul of the forward and the backward has a batch within 65,535."""
    with torch.device("meta"):
        model = lgvit.create_model(name)
        x = torch.empty(256, 3, size, size)
    with as_written() if written else torch.enable_grad(), _watch(monkeypatch) as seen:
        model(x).sum().backward()
    assert any(n == "bmm" for n, _ in seen)
    over = sorted({(n, b) for n, b in seen if b > LIMIT})
    assert not over, f"{name}: calls over CUDA's grid limit (kernel, batch): {over}"


def test_chunked_bmm_equals_bmm_with_gradients(monkeypatch):
    monkeypatch.setattr(attention, "MAX_KERNEL_BATCH", 4)
    torch.manual_seed(0)
    a = torch.randn(11, 2, 3, requires_grad=True)
    b = torch.randn(11, 3, 5).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    with _watch(monkeypatch) as seen:
        y = attention.chunked_bmm(a, b)
        y.square().sum().backward()
    assert max(n for _, n in seen) == 4
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    torch.bmm(a, b).square().sum().backward()
    torch.testing.assert_close(y, torch.bmm(a, b), rtol=0, atol=0)
    torch.testing.assert_close((ga, gb), (a.grad, b.grad), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The previous implementation, as the reference
# ---------------------------------------------------------------------------------------------


def _old_plain(attn: LocalShiftAttention, query, variants, norm) -> torch.Tensor:
    """The plain path before: positions folded into SDPA's batch, one query each."""
    T, B, N, C = variants.shape
    drop = attn.attn_drop if attn.training else 0.0
    q = attn.q(query).reshape(B * N, 1, C)
    kv = attn.kv(variants if norm is None else norm(variants))
    kv = kv.flatten(1, 2).transpose(0, 1).contiguous()  # (B*N, T, 2*kv_heads*head_dim)
    c = attn.kv_heads * attn.head_dim
    x = multihead_sdpa(q, kv[..., :c], kv[..., c:], attn.num_heads, attn.kv_heads, None, drop)
    return attn.proj_drop(attn.proj(x.reshape(B, N, C)))


def _old_attend_folded(attn, q, f, drop: float) -> torch.Tensor:
    """``attend_folded`` before: one bmm over all B*N*kv_heads positions."""
    T, B, N, _ = f.scale.shape
    kvh, dh = attn.kv_heads, attn.head_dim
    g = attn.num_heads // kvh
    ck = kvh * dh
    k = torch.matmul(f.scaled, f.weight[..., :ck])
    v = torch.matmul(f.scaled, f.weight[..., ck:])
    kp = k.view(T, -1, dh).transpose(0, 1).contiguous()
    vp = v.view(T, -1, dh).transpose(0, 1).contiguous()
    offset = f.offset.expand(T, N, -1)
    dk = offset[..., :ck].reshape(T, N, kvh, dh).to(q.dtype)
    dv = offset[..., ck:].reshape(T, N, kvh, dh)
    rstd = f.scale[..., 0].permute(1, 2, 0)[:, :, None, None]
    q5 = q.view(B, N, kvh, g, dh)
    logits = torch.bmm(q.reshape(B * N * kvh, g, dh), kp.transpose(1, 2))
    logits = logits.view(B, N, kvh, g, T) + rstd * torch.einsum("bnjgd,tnjd->bnjgt", q5, dk)
    p = (logits.to(torch.promote_types(logits.dtype, torch.float32)) * dh**-0.5).softmax(-1)
    if drop:
        p = F.dropout(p, drop)
    x = torch.bmm(p.view(-1, g, T).to(vp.dtype), vp)
    pr = (p * rstd).to(dv.dtype)
    x = x.view(B, N, kvh, g, dh) + torch.einsum("bnjgt,tnjd->bnjgd", pr, dv).to(x.dtype)
    x = x + p.sum(-1, keepdim=True).to(x.dtype) * f.bias[ck:].view(kvh, 1, dh).to(x.dtype)
    return x.reshape(B, N, kvh * g * dh)


def _old_forward(self: LocalShiftAttention, query, variants, norm=None) -> torch.Tensor:
    drop = self.attn_drop if self.training else 0.0
    if isinstance(variants, ShiftedVariants):
        folded = variants.fold(norm or nn.Identity(), self.kv)
        if folded is not None:
            return self.proj_drop(self.proj(_old_attend_folded(self, self.q(query), folded, drop)))
        variants = variants.materialize()
    return _old_plain(self, query, variants, norm)


def _run(model: nn.Module, x: torch.Tensor, amp: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
        y = model(x)
    y.float().square().mean().backward()
    return y.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}


# (model, kwargs): each model's embedding conv, shifts and head sharing at a small input,
# width and depth. lsa_tiny_224 runs the plain path (its 9x9 RGB patch is wider than the
# embedding), the others the folded one.
SMALL = dict(dims=(48, 48), depths=(1, 1))
MODELS = [
    ("lsa_tiny_224", dict(img_size=64, **SMALL)),
    ("lsa_tiny_cifar", dict(img_size=16, **SMALL)),
    ("lsa_small_cifar", dict(img_size=12, **SMALL)),
]


@pytest.mark.parametrize("chunk", [LIMIT, 64])  # 64: the matmuls run in pieces here
@pytest.mark.parametrize(("name", "kwargs"), MODELS)
def test_lsa_outputs_and_gradients_equal_the_previous_implementation(
    monkeypatch, name, kwargs, chunk
):
    """float32, training mode (drop path off): logits and every parameter's gradient as the
    previous local attention gave them, to float32 rounding."""
    monkeypatch.setattr(attention, "MAX_KERNEL_BATCH", chunk)
    torch.manual_seed(0)
    model = lgvit.create_model(name, num_classes=7, drop_path_rate=0.0, **kwargs)
    size = model.img_size[0]
    x = torch.randn(3, 3, size, size)
    y, grads = _run(model, x, amp=False)
    with monkeypatch.context() as m:
        m.setattr(LocalShiftAttention, "forward", _old_forward)
        y_ref, grads_ref = _run(model, x, amp=False)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for key, g in grads_ref.items():
        scale = g.abs().max().item() + 1e-12
        torch.testing.assert_close(grads[key] / scale, g / scale, rtol=0, atol=2e-5, msg=key)


@pytest.mark.parametrize(("name", "kwargs"), MODELS)
def test_lsa_under_bf16_autocast_stays_as_close_as_the_previous_implementation(
    monkeypatch, name, kwargs
):
    """bf16 autocast: the new path is as close to float32 as the old one was (both round:
    bf16 gradients of these small random models are 2-20% off float32's either way)."""
    monkeypatch.setattr(attention, "MAX_KERNEL_BATCH", 64)
    torch.manual_seed(0)
    model = lgvit.create_model(name, num_classes=7, drop_path_rate=0.0, **kwargs)
    size = model.img_size[0]
    x = torch.randn(3, 3, size, size)
    y32, g32 = _run(model, x, amp=False)
    y, grads = _run(model, x, amp=True)
    with monkeypatch.context() as m:
        m.setattr(LocalShiftAttention, "forward", _old_forward)
        y_ref, grads_ref = _run(model, x, amp=True)
    err, err_ref = (y - y32).abs().max(), (y_ref - y32).abs().max()
    assert err <= 1.5 * err_ref + 1e-3, (err, err_ref)

    def off(g: torch.Tensor, ref: torch.Tensor) -> float:
        return ((g - ref).norm() / ref.norm()).item()

    flat = {
        k: torch.cat([d[n].flatten() for n in g32]) for k, d in (("new", grads), ("old", grads_ref))
    }
    whole = torch.cat([g.flatten() for g in g32.values()])
    assert off(flat["new"], whole) <= 1.2 * off(flat["old"], whole) + 0.005
    for key, g in g32.items():
        assert off(grads[key], g) <= 2 * off(grads_ref[key], g) + 0.02, key


def test_shifted_patches_are_gathered_in_the_autocast_type():
    """Under autocast the T shifted copies are gathered in bf16 (the type the embedding's
    matmuls cast them to), so the largest stem tensor moves at half the bytes; the same
    values as gathering in float32 and casting."""
    torch.manual_seed(0)
    embed = lgvit.create_model("lsa_tiny_224", img_size=64, dims=(48,), depths=(1,)).patch_embed
    x = torch.randn(2, 3, 64, 64)
    plain = embed(x)[1].patches
    with torch.autocast("cpu", torch.bfloat16):
        variants = embed(x)[1]
    assert plain.dtype == torch.float32 and variants.patches.dtype == torch.bfloat16
    torch.testing.assert_close(variants.patches, plain.to(torch.bfloat16), rtol=0, atol=0)


def test_keys_and_values_are_copied_position_major_on_the_cpu_only():
    """The position-major copy of the keys helps the CPU's batched matmuls; off the CPU (the
    meta device stands for CUDA here) the matmuls read the projection's output as a view."""
    for device in ("cpu", "meta"):
        k = torch.zeros(10, 6, 2 * 8, device=device)  # (T, B*N, kv_heads*dh)
        rows = lsa_folded._position_major(k, 12, 8)
        assert rows.shape == (12, 10, 8)
        assert rows._is_view() == (device == "meta"), device
        assert rows.is_contiguous() == (device == "cpu"), device


def test_benchmark_smoke_run_prints_a_row_for_every_case():
    """benchmarks/bench_lsa_local.py --smoke: old and new timed for every case and precision
    (so the benchmark does not rot before it is run for real)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lsa_local.py"
    run = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if re.match(r"\| \d+\.\d+ \|", line)]
    assert len(rows) == 4 * 2 * 2, run.stdout  # cases x precisions x (forward, fwd+bwd)
