"""Part d of benchmarks/gpu_check.py: ``lgvit bench`` rows of lgvit's models, beside timm's
twins and the LSA authors' model in the same process (same steps, rounds, precision, optimizer
and drop path), in bf16: eager with the batch sweep, compiled at one batch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

PAIRS = ("deit_tiny", "deit_small", "swin_tiny")  # beside timm's model (bench_peers.PEERS)
OWN = ("lit_s", "lsa_small_224")
COMPILED_BATCH = 128  # d's compiled steps (the warm-up compiles them): 224 px, in memory beside a
AUTHORS_BATCH = 512
SMOKE_MODEL = "lsa_micro_cifar"  # the smallest model: smoke runs
BF16_LOGITS_TOL = 5e-2  # bf16 against the CPU's fp32; and compiled bf16 against eager bf16


def eager_compiler() -> None:
    """``torch.compile`` with dynamo's ``eager`` backend whatever the mode (smoke: Inductor
    takes minutes on a CPU)."""
    import torch

    real = torch.compile
    torch.compile = lambda model, mode=None, **kw: real(model, backend="eager")


def bench_options(device: str, smoke: bool, compiled: bool, name: str) -> Any:
    """d's measurement: bf16, training too; eager: the batch sweep; compiled: one batch."""
    from lgvit.models import get_model_config
    from lgvit.tools.bench import AUTO, BenchOptions

    img = (get_model_config(name).smoke_input_size[-1] if name == SMOKE_MODEL else 32) \
        if smoke else None  # fmt: skip
    batch = (2 if smoke else COMPILED_BATCH) if compiled else AUTO
    return BenchOptions(device=device, amp="bf16", batch_size=batch, img_size=img, train=True,
                        compile="default" if compiled else None, rounds=1 if smoke else 2,
                        memory=not smoke and not compiled, max_batch=64 if smoke else
                        BenchOptions.max_batch)  # fmt: skip


def timm_peer(name: str, img_size: int | None) -> tuple[Any, float]:
    """timm's model of ``name`` (bench_peers.PEERS) as an extra bench row, with lgvit's drop
    path (the papers' recipes: DeiT 0.1, Swin-T 0.2; timm's defaults are 0 and 0.1), and that
    rate."""
    import timm
    import torch
    from bench_peers import PEERS, drop_path_rates

    from lgvit.models import create_model, get_model_config
    from lgvit.tools.bench import ExtraModel

    kw = {"img_size": img_size} if img_size else {}
    with torch.device("meta"):
        rate = max(drop_path_rates(create_model(name, **kw)), default=0.0)

    def build() -> Any:
        torch.manual_seed(0)
        return timm.create_model(PEERS[name], drop_path_rate=rate, **kw)

    size = (3, img_size, img_size) if img_size else get_model_config(name).input_size
    return ExtraModel(f"timm {PEERS[name]}", build, size), rate


def bench_item(device: str, smoke: bool, name: str, compiled: bool) -> dict[str, Any]:
    """``run_bench`` of ``name``, with timm's twin beside it where timm has one (the same
    process, steps, rounds, precision, optimizer and drop path): rows and lgvit/timm ratios
    (eager: each at its best batch of the sweep; compiled: at the one batch)."""
    from bench_peers import PEERS, drop_path_rates

    from lgvit.tools.bench import run_bench

    opts = bench_options(device, smoke, compiled, name)
    out: dict[str, Any] = {}
    extra = []
    if name in PEERS and importlib.util.find_spec("timm"):
        peer, rate = timm_peer(name, opts.img_size)
        theirs = max(drop_path_rates(peer.build()), default=0.0)
        out["drop_path"] = {"lgvit": rate, "timm": theirs}
        extra.append(peer)
    elif name in PEERS:
        out["note"] = "timm is not installed: lgvit's model alone"
    result = run_bench([name], opts, log=print, extra=extra)
    rows = [brief_row(r) for r in result["rows"]]
    ok = all(r.get("error") is None for r in rows)
    if compiled:  # the old part f: the compiled model computes what eager does (bf16)
        ok = ok and all((r.get("compile_rel_err") or 0) < BF16_LOGITS_TOL for r in rows)
    if extra:
        ok = ok and out["drop_path"]["lgvit"] == out["drop_path"]["timm"]
        best = "" if compiled else "best_"
        for kind in ("infer", "train"):
            ours, theirs = (r.get(f"{kind}_{best}img_s") for r in rows)
            out[f"{kind}_ratio"] = float(f"{ours / theirs:.3g}") if ours and theirs else None
    return {"ok": ok, **out, "matmul_peak_tflops": result["matmul_peak_tflops"], "rows": rows}


BRIEF_KEYS = (
    "model", "input", "batch", "infer_img_s", "infer_mfu", "paper_img_s", "infer_best_batch",
    "infer_best_img_s", "infer_best_mfu", "infer_busy", "infer_sweep", "infer_sweep_stop",
    "train_img_s", "train_mfu", "train_best_batch", "train_best_img_s", "train_best_mfu",
    "train_busy", "train_sweep", "train_sweep_stop", "infer_mem_mb", "train_mem_mb",
    "infer_compile_s", "train_compile_s", "compile_rel_err", "error",
)  # fmt: skip


def brief_row(row: dict[str, Any]) -> dict[str, Any]:
    """A bench row's figures the report keeps, rounded."""
    out = {}
    for k in BRIEF_KEYS:
        v = row.get(k)
        if v is not None:
            out[k] = round(v, 4 if k.endswith(("_mfu", "_busy")) else 1) \
                if isinstance(v, float) and k != "compile_rel_err" else v  # fmt: skip
    return out


def authors_item(device: str, smoke: bool, authors_lsa: str) -> dict[str, Any]:
    """lsa_tiny_cifar beside the LSA authors' model (their ``cifar/cifar_model.py``, imported
    from ``--authors-lsa`` at run time as benchmarks/bench_lsa.py does; nothing of theirs is
    copied), at batch 512 in bf16, eager: the same steps and optimizer for both."""
    from lgvit.tools.bench import BenchOptions, ExtraModel, run_bench

    repo = Path(authors_lsa).resolve()
    if not (repo / "cifar" / "cifar_model.py").is_file():
        raise FileNotFoundError(
            f"--authors-lsa {repo}: no cifar/cifar_model.py there (a "
            "checkout of github.com/shellysheynin/Locally-SAG-Transformer)"
        )
    peer = ExtraModel("LSA authors' ShiftingTransformer", lambda: authors_model(str(repo)),
                      (3, 32, 32))  # fmt: skip
    opts = BenchOptions(device=device, amp="bf16", batch_size=2 if smoke else AUTHORS_BATCH,
                        train=True, rounds=1 if smoke else 3, memory=not smoke)  # fmt: skip
    result = run_bench(["lsa_tiny_cifar"], opts, log=print, extra=[peer])
    rows = [brief_row(r) for r in result["rows"]]
    out: dict[str, Any] = {"ok": all(r.get("error") is None for r in rows), "rows": rows}
    for kind in ("infer", "train"):
        ours, theirs = (r.get(f"{kind}_img_s") for r in rows)
        out[f"{kind}_ratio"] = float(f"{ours / theirs:.3g}") if ours and theirs else None
    return out


def authors_model(repo: str) -> Any:
    """Their tiny CIFAR model as their main_tiny_cifar.py builds it (bench_lsa's builder); a
    missing package of theirs (einops) is one line."""
    from bench_lsa import build_authors_model

    try:
        return build_authors_model(repo)
    except SystemExit as e:  # bench_lsa's one line for a model it cannot import
        raise RuntimeError(str(e)) from None
