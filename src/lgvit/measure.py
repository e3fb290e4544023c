"""Measuring models the way the paper tables do: params, MACs, throughput."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lgvit.models import create_model, get_model_config


def count_params(model: nn.Module, include_head: bool = True) -> int:
    """Sum of ``numel`` over parameters (works on the meta device)."""
    total = sum(p.numel() for p in model.parameters())
    if not include_head and hasattr(model, "get_classifier"):
        total -= sum(p.numel() for p in model.get_classifier().parameters())
    return total


def count_macs(model: nn.Module, input_size: tuple[int, int, int], batch: int = 1) -> int:
    """Multiply-accumulates of one forward pass: ``FlopCounterMode`` total / 2.

    Counts what FlopCounterMode counts: matmuls, convolutions and attention (SDPA), i.e. every
    multiply-accumulate-bound op; element-wise ops, norms, softmax and pooling are not counted,
    which is also how the papers count. Runs on whatever device the model is on (meta is fine).
    Attention runs through SDPA's math backend here: FlopCounterMode has no formula for the
    fused CPU kernel and would silently count attention as zero.
    """
    p = next(model.parameters())
    x = torch.zeros(batch, *input_size, device=p.device, dtype=p.dtype)
    was_training = model.training
    model.eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    model.train(was_training)
    return counter.get_total_flops() // 2


def model_info(name: str) -> dict[str, Any]:
    """Params (M) and MACs (G) of a registered model at its default input size, on meta."""
    cfg = get_model_config(name)
    with torch.device("meta"):
        model = create_model(name)
    return {
        "name": name,
        "input_size": list(cfg.input_size),
        "params_m": round(count_params(model) / 1e6, 3),
        "macs_g": round(count_macs(model, cfg.input_size) / 1e9, 3),
        "paper": cfg.paper,
    }


def time_fn(fn: Callable[[], Any], warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Measured matmul FLOP/s for ``dtype`` on the CPU (the MFU denominator)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    sec = time_fn(lambda: torch.mm(a, b), warmup=2, repeats=repeats)
    return 2 * n**3 / sec
