"""The rule a device's fp32 gradients are compared against the CPU's by (gpu_check's part a and
tests/test_device.py): every family in float32 passes it against float64 on the CPU, with room
to spare; a gradient that is zero in exact arithmetic cannot fail it on rounding noise; a wrong
gradient still fails it. And the IEEE fp32 block: TF32 off inside, every setting back after."""

from __future__ import annotations

import copy

import pytest
import torch
from test_device import FAMILIES, family_case, one_step

from lgvit.tools.measure import (
    GRAD_FLOOR,
    GRAD_TOL,
    LOGITS_TOL,
    grad_errors,
    ieee_fp32,
    relative_error,
    worst_grad_error,
)


@pytest.fixture(scope="module")
def cases():
    """Per family: the float32 step's logits and gradients, and float64's (the reference)."""
    out = {}
    for family in FAMILIES:
        model, x, y = family_case(family)
        wide = copy.deepcopy(model).double()
        out[family] = (one_step(model, x, y), one_step(wide, x.double(), y))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_in_fp32_passes_against_fp64(cases, family):
    (logits, grads), (want_logits, want) = cases[family]
    assert relative_error(logits, want_logits) < LOGITS_TOL / 10
    err, name = worst_grad_error(grads, want)
    # A tenth of the tolerance at most: room for a GPU's other summation order.
    assert err < GRAD_TOL / 10, (family, name, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gradient_10_percent_off_fails(cases, family):
    """One tensor's gradient scaled by 1.1 fails the rule, whichever tensor it is: the largest,
    the smallest one above the floor, and one between."""
    (_, grads), (_, want) = cases[family]
    total = torch.sqrt(sum(g.square().sum() for g in want.values()))
    sizes = {k: float(g.norm()) for k, g in want.items() if g.norm() > 2 * GRAD_FLOOR * total}
    by_size = sorted(sizes, key=sizes.__getitem__)
    for name in {by_size[0], by_size[len(by_size) // 2], by_size[-1]}:
        wrong = {**grads, name: grads[name] * 1.1}
        err, worst = worst_grad_error(wrong, want)
        assert err > GRAD_TOL and worst == name, (family, name, err)


def test_a_zero_gradient_passes_on_noise_and_fails_on_an_error(cases):
    """LIT's convolution before a BatchNorm has a bias whose gradient is zero in exact
    arithmetic (the norm subtracts the mean): float32 leaves 1e-8 noise where float64 leaves
    1e-17, a relative error of ~1e9 that failed the old per-tensor rule on CUDA. The rule passes
    it; noise of the size of a real error (1e-4 of the whole gradient) fails it."""
    (_, grads), (_, want) = cases["lit"]
    total = torch.sqrt(sum(g.square().sum() for g in want.values()))
    zero = [k for k, g in want.items() if g.norm() < 1e-9 * total]
    assert zero and all(k.endswith(".bias") for k in zero), zero
    name = zero[0]
    assert relative_error(grads[name], want[name]) > 1  # by its own size: noise
    assert grad_errors(grads, want)[name] < GRAD_TOL
    noise = torch.randn_like(grads[name])
    wrong = {**grads, name: grads[name] + noise * (1e-4 * total / noise.norm())}
    err, worst = worst_grad_error(wrong, want)
    assert err > GRAD_TOL and worst == name


def test_missing_gradients_are_an_error():
    a = {"w": torch.ones(2), "b": torch.ones(1)}
    with pytest.raises(ValueError, match="different tensors: b"):
        grad_errors({"w": torch.ones(2)}, a)


def _flags() -> tuple:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())  # fmt: skip


@pytest.mark.parametrize("before", [(True, True, "high"), (False, True, "highest")])
def test_ieee_fp32_turns_tf32_off_and_restores_it(before):
    saved = _flags()
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.set_float32_matmul_precision(before[2])
        with ieee_fp32():
            assert _flags() == (False, False, "highest")
        assert _flags() == before
        with pytest.raises(RuntimeError), ieee_fp32():  # restored on the way out of an error
            raise RuntimeError
        assert _flags() == before
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
