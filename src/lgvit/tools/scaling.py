"""``lgvit bench --scaling KIND``: the papers' complexity claims as measured curves (CSV + PNG).

- ``lsa``: LSA's local attention (at each grid position, a softmax over its T shifted variants)
  against full self-attention over all T x N variant tokens and against the plain global
  attention over the N tokens of stage 1, for inputs from 32 to 224 px (4x4 patches, so N = 64
  to 3136 tokens; T = 10 shifts, 192 wide, 3 heads sharing one key/value head).
- ``lit``: LIT's MLP-only early stages (``lit_ti``) against the same stages with attention (PVT-S
  with full MSA, ``pvt_small_full_msa``) and with PVT's spatial-reduction attention
  (``pvt_small``): the stem and stages 1-2, inputs from 224 to 640 px.
- ``localvit``: one block with the locality feed-forward (g 4, h-swish, SE, as LocalViT-T)
  against one with the plain MLP (LayerNorm, g 4, GELU), widths 64 to 768 on a 14x14 grid.

Every point: batch 1 (``lit``: 1; ``localvit``: 8), float32, inference (``inference_mode``,
eval mode); time is the median of alternating rounds; memory is the peak RSS over the idle
process while the point runs (one fresh child process per curve, points in increasing size, the
peak window reset before each); MACs are FlopCounterMode / 2 on the meta device. A power law is
fitted to the upper half of each curve (least squares on log-log) and its exponent is printed,
written to the CSV and shown in the legend beside the exponent the claim predicts.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lgvit.core.errors import LgvitError
from lgvit.tools.measure import (
    count_macs_of,
    describe_machine,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
    run_in_fresh_process,
    timed,
)

Run = Callable[[], Any]


@dataclass(frozen=True)
class Curve:
    label: str
    expected: str  # the asymptotic form the claim predicts
    expected_exponent: float  # in the x quantity of the study (tokens or width)


@dataclass(frozen=True)
class Study:
    title: str
    xs: tuple[int, ...]  # input sizes (px) or widths
    quick_xs: tuple[int, ...]
    x_label: str
    curves: dict[str, Curve]
    tokens: Callable[[int], int]  # the quantity the exponents are in


# ------------------------------------------------------------------------------------- lsa

_LSA_DIM, _LSA_HEADS, _LSA_SHIFTS = 192, 3, 10


def _lsa_case(curve: str, size: int) -> Run:
    from lgvit.models.layers import Attention
    from lgvit.models.lsa import LocalShiftAttention

    n = (size // 4) ** 2
    x = torch.randn(1, n, _LSA_DIM)
    if curve == "local":
        attn = LocalShiftAttention(_LSA_DIM, _LSA_HEADS, kv_heads=1).eval()
        variants = torch.randn(_LSA_SHIFTS, 1, n, _LSA_DIM)
        return lambda: attn(x, variants)
    attn = Attention(_LSA_DIM, _LSA_HEADS, kv_heads=1).eval()
    if curve == "full":
        tokens = torch.randn(1, _LSA_SHIFTS * n, _LSA_DIM)
        return lambda: attn(tokens)
    return lambda: attn(x)


# ------------------------------------------------------------------------------------- lit

_LIT_MODELS = {"mlp": "lit_ti", "msa": "pvt_small_full_msa", "sra": "pvt_small"}


def _lit_case(curve: str, size: int) -> Run:
    from lgvit.models import create_model

    model = create_model(_LIT_MODELS[curve], img_size=size).eval()
    x = torch.randn(1, 3, size, size)
    return lambda: model.forward_intermediates(
        x, indices=[1], stop_early=True, intermediates_only=True
    )


# -------------------------------------------------------------------------------- localvit


def _localvit_case(curve: str, width: int) -> Run:
    from lgvit.models.layers import Block, LocalityFeedForward, Mlp

    mlp = Mlp if curve == "mlp" else partial(LocalityFeedForward, reduction_from_dim=1.0)
    block = Block(width, attn_layer=None, mlp_layer=mlp).eval()
    x = torch.randn(8, 14 * 14, width)
    return lambda: block(x, (14, 14))


STUDIES: dict[str, tuple[Study, Callable[[str, int], Run]]] = {
    "lsa": (
        Study(
            title="LSA: local attention over T=10 shifts vs global and full attention",
            xs=(32, 48, 64, 96, 128, 160, 192, 224),
            quick_xs=(32, 48),
            x_label="tokens per image N (input 32-224 px, 4x4 patches)",
            curves={
                "local": Curve("local attention (LSA)", "T*N*C^2 + T*N*C: ~N", 1.0),
                "global": Curve("global attention over N", "N*C^2 + N^2*C: ~N^2", 2.0),
                "full": Curve("full attention over T*N", "T*N*C^2 + T^2*N^2*C: ~N^2", 2.0),
            },
            tokens=lambda s: (s // 4) ** 2,
        ),
        _lsa_case,
    ),
    "lit": (
        Study(
            title="LIT: MLP-only stages 1-2 vs the same stages with attention",
            xs=(224, 288, 384, 512, 640),
            quick_xs=(64, 96),
            x_label="stage-1 tokens N (input 224-640 px)",
            curves={
                "mlp": Curve("MLP-only (lit_ti)", "~N", 1.0),
                "msa": Curve("full MSA (pvt_small_full_msa)", "~N^2", 2.0),
                "sra": Curve("spatial-reduction MSA (pvt_small)", "N^2/R^2 (R=8): ~N^2", 2.0),
            },
            tokens=lambda s: (s // 4) ** 2,
        ),
        _lit_case,
    ),
    "localvit": (
        Study(
            title="LocalViT: locality feed-forward vs MLP, one block, 196 tokens, batch 8",
            xs=(64, 96, 128, 192, 256, 384, 512, 768),
            quick_xs=(32, 48),
            x_label="width C (channels)",
            curves={
                "mlp": Curve("MLP (LN, 1x1 C->4C->C)", "8*N*C^2: ~C^2", 2.0),
                "locality": Curve(
                    "locality feed-forward (+DW 3x3, SE)", "8*N*C^2 + 36*N*C: ~C^2", 2.0
                ),
            },
            tokens=lambda c: c,
        ),
        _localvit_case,
    ),
}
STUDY_NAMES = tuple(STUDIES)  # what ``lgvit bench --scaling`` takes


# --------------------------------------------------------------------------------- measure


def _macs(case: Callable[[str, int], Run], curve: str, x: int) -> int:
    with torch.device("meta"):
        run = case(curve, x)
    return count_macs_of(run)


def _memory_points(kind: str, curve: str, xs: Sequence[int], threads: int) -> list[float]:
    torch.set_num_threads(threads)
    case = STUDIES[kind][1]
    with torch.inference_mode():  # first-call allocations (thread pools, kernel caches)
        case(curve, xs[0])()  # belong to no point
    out = []
    for x in xs:
        run = case(curve, x)
        base = rss_mb()
        reset_peak_rss()
        with torch.inference_mode():
            run()
            run()
        out.append(peak_rss_mb() - base)
        del run
    return out


def _memory_curve(kind: str, curve: str, xs: Sequence[int]) -> list[float | None]:
    """Peak MB per point, in a fresh process (default allocator, so freed blocks return)."""
    try:
        return run_in_fresh_process(
            _memory_points, (kind, curve, list(xs), torch.get_num_threads())
        )
    except RuntimeError as e:
        print(f"lgvit bench --scaling: memory of {curve} not measured: {e}")
        return [None] * len(xs)


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Slope of log(y) against log(x), least squares."""
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def measure_study(kind: str, quick: bool = False, rounds: int = 3) -> list[dict[str, Any]]:
    """One row per (curve, point): time (ms), peak memory (MB), MACs (G)."""
    study, case = STUDIES[kind]
    xs = study.quick_xs if quick else study.xs
    rounds = 1 if quick else rounds
    rows = []
    for x in xs:
        runs = {c: case(c, x) for c in study.curves}
        times: dict[str, list[float]] = {c: [] for c in study.curves}
        with torch.inference_mode():
            for run in runs.values():
                run()  # warm-up
            for _ in range(rounds):  # alternating, so noise hits every curve alike
                for c, run in runs.items():
                    times[c].append(timed(run))
        for c in study.curves:
            rows.append(
                dict(
                    curve=c, x=x, tokens=study.tokens(x),
                    time_ms=1000 * statistics.median(times[c]),
                    macs_g=_macs(case, c, x) / 1e9,
                )
            )  # fmt: skip
        print(f"  {kind}: {x} done", flush=True)
        del runs
    for c in study.curves:
        mem = _memory_curve(kind, c, xs)
        for row, m in zip([r for r in rows if r["curve"] == c], mem, strict=True):
            row["mem_mb"] = m
    return rows


def exponents(kind: str, rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Fitted exponents of time, memory and MACs per curve, over the upper half of the points."""
    study = STUDIES[kind][0]
    out = {}
    for c in study.curves:
        pts = [r for r in rows if r["curve"] == c]
        upper = pts[len(pts) // 2 :] if len(pts) >= 4 else pts
        fits = {}
        for key in ("time_ms", "mem_mb", "macs_g"):
            good = [r for r in upper if r.get(key) and r[key] > 0]
            if len(good) >= 2:
                fits[key] = fit_exponent([r["tokens"] for r in good], [r[key] for r in good])
        out[c] = fits
    return out


# ------------------------------------------------------------------------------------ write


def _plot(kind: str, rows: list[dict[str, Any]], fits: dict, png: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = STUDIES[kind][0]
    panels = (("time_ms", "time per forward (ms)"), ("mem_mb", "peak memory (MB)"),
              ("macs_g", "MACs (G)"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for c, curve in study.curves.items():
            pts = [r for r in rows if r["curve"] == c and r.get(key)]
            if not pts:
                continue
            slope = fits[c].get(key)
            label = f"{curve.label}: slope {slope:.2f}" if slope is not None else curve.label
            ax.plot([r["tokens"] for r in pts], [r[key] for r in pts], "o-", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(study.x_label)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    expected = "; ".join(f"{c.label.split(' (')[0]} {c.expected}" for c in study.curves.values())
    fig.suptitle(f"{study.title}\nexpected: {expected}\n{machine}, float32", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=72)
    plt.close(fig)


def run_scaling(kind: str, out: str, quick: bool = False) -> list[str]:
    """Measure one study; write ``<out>.csv`` and ``<out>.png``; return their paths."""
    if kind not in STUDIES:
        raise LgvitError(f"--scaling {kind!r}: choose one of {', '.join(STUDIES)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LgvitError(
            "--scaling draws with matplotlib, which is not installed: pip install 'lgvit[viz]'"
        ) from None
    base = Path(out)
    if base.suffix in (".csv", ".png"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    print(f"lgvit bench --scaling {kind}: {machine}", flush=True)
    rows = measure_study(kind, quick)
    fits = exponents(kind, rows)
    study = STUDIES[kind][0]
    csv_path, png_path = base.with_suffix(".csv"), base.with_suffix(".png")
    keys = ["curve", "x", "tokens", "time_ms", "mem_mb", "macs_g"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in keys})
        for c, fit in fits.items():  # the fitted exponents, one row per curve
            w.writerow({"curve": c, "x": "slope", **{k: f"{v:.3f}" for k, v in fit.items()}})
    _plot(kind, rows, fits, png_path, machine)
    for c, curve in study.curves.items():
        got = ", ".join(f"{k.split('_')[0]} {v:.2f}" for k, v in fits[c].items())
        print(f"  {curve.label}: expected {curve.expected}; measured slopes: {got}")
    return [str(csv_path), str(png_path)]
