"""``lgvit bench``: the papers' efficiency tables, measured, for any registered models.

One row per model: parameters and MACs (counted on the meta device), inference and training
throughput, MFU, peak inference and training memory, each beside the paper's figure where the
paper gives one (the paper's hardware in a footnote).

Method:
- Every model is built and warmed up, then timed in rounds that alternate between the models of
  the run, so machine noise hits all of them alike; a model's figure is its median over rounds.
- Timing (``lgvit.tools.measure``): wall clock between two synchronisations of the device.
  CPU: one warm-up call, one call a round. CUDA: warm-up until two calls agree, then each
  round times enough back-to-back calls to last a set time (``measure.CUDA_TIMING``).
- The training step uses the optimizer ``lgvit train`` builds (fused AdamW on CPU and CUDA).
- CPU: peak memory is measured in a fresh child process per model and step kind: peak RSS
  while running two steps, minus the RSS of the idle process with the model and its input
  built (so one model's memory cannot hide in another's, and weights are not counted).
- CUDA: peak memory is ``torch.cuda.max_memory_allocated`` over the same idle baseline.
- MFU: model FLOPs per second (2 x MACs per image, x3 for a training step) over a matmul peak
  measured in the same run at the run's precision.
- A model that cannot be built or run at the chosen size is a row with the reason.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from lgvit.core.errors import LgvitError
from lgvit.models import create_model, get_model_config, is_model, list_models
from lgvit.tools.measure import (
    count_macs,
    count_params,
    cpu_bf16_note,
    describe_machine,
    make_step,
    matmul_peak_flops,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
    run_in_fresh_process,
    step_timing,
    timed,
    warm_up,
)

DEFAULT_BATCH = 64  # the LIT paper's throughput batch; the LSA and LocalViT papers name none
FORMATS = ("table", "markdown", "csv", "json")


@dataclass
class BenchOptions:
    device: str = "cpu"
    amp: str = "auto"  # one of lgvit.core.runtime.AMP_MODES
    batch_size: int = DEFAULT_BATCH
    img_size: int | None = None  # None: each model's default input size
    train: bool = False
    compile: bool = False
    channels_last: bool = False  # models and inputs in NHWC (timm's --channels-last)
    rounds: int = 3
    warmup: int = 1
    memory: bool = True


def resolve_names(patterns: Sequence[str]) -> list[str]:
    """Model names from names and wildcards (all models when empty), in the order given."""
    if not patterns:
        return list_models()
    names: list[str] = []
    for p in patterns:
        found = [p] if is_model(p) else list_models(p)
        if not found:
            raise LgvitError(f"unknown model {p!r}; `lgvit info` lists them all")
        names += [n for n in found if n not in names]
    return names


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:300]


def _input_size(name: str, img_size: int | None) -> tuple[int, int, int]:
    cfg = get_model_config(name)
    return cfg.input_size if img_size is None else (cfg.input_size[0], img_size, img_size)


def build_model(
    name: str, img_size: int | None, device: torch.device | str, channels_last: bool = False
) -> nn.Module:
    """The model at ``img_size`` (its default when None), on ``device`` (its 4-D weights in
    NHWC with ``channels_last``)."""
    kwargs = {} if img_size is None else {"img_size": img_size}
    model = create_model(name, **kwargs).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


# ----------------------------------------------------------------------------- paper columns


def paper_columns(name: str) -> dict[str, Any]:
    """The paper's figures for a model, under the table's column names."""
    p = get_model_config(name).paper
    top1, top1_on = None, None
    for key, data in (("imagenet_top1", "ImageNet"), ("cifar10_top1", "CIFAR-10")):
        if p.get(key) is not None:
            top1, top1_on = p[key], data
            break
    params_note = p.get("params_note")
    if p.get("params_int_m") is not None:
        with_head = "with" if p.get("params_int_head") else "without"
        params_note = f"the paper prints whole millions, counted {with_head} the classifier head"
    return {
        "paper_params_m": p.get("params_m") or p.get("params_int_m") or p.get("paper_params_m"),
        "paper_params_note": params_note,
        "paper_macs_g": p.get("macs_g"),
        "paper_macs_note": p.get("macs_note"),
        "paper_img_s": p.get("img_s"),
        "paper_train_mem_mb": p.get("train_mem_mb"),
        "paper_test_mem_mb": p.get("test_mem_mb"),
        "paper_hardware": p.get("hardware"),
        "paper_top1": top1,
        "paper_top1_on": top1_on,
    }


# ------------------------------------------------------------------------------ memory probe


def _probe(name, img_size, batch, train, amp, compile_, threads, nhwc) -> float:  # noqa: ANN001
    import gc

    from lgvit.core.runtime import tune_cpu_allocator

    torch.set_num_threads(threads)
    tune_cpu_allocator()  # the allocator lgvit's commands run with
    torch.manual_seed(0)
    model = build_model(name, img_size, "cpu", nhwc)
    if compile_:
        model = torch.compile(model)
    step = make_step(model, _input_size(name, img_size), batch, train, amp, channels_last=nhwc)
    gc.collect()
    base = rss_mb()
    reset_peak_rss()
    step()  # the first step allocates the optimizer's state: part of training memory
    step()
    return peak_rss_mb() - base


def cpu_peak_memory_mb(
    name: str,
    batch: int,
    train: bool,
    img_size: int | None = None,
    amp: torch.dtype | None = None,
    compile_: bool = False,
    threads: int | None = None,
    timeout_s: float = 1800,
    channels_last: bool = False,
) -> float:
    """Peak RSS (MB) of two steps of ``name`` over its idle process, in a fresh child process.

    Raises ``RuntimeError`` with the reason when the child fails or dies (e.g. out of memory).
    """
    threads = threads or torch.get_num_threads()
    args = (name, img_size, batch, train, amp, compile_, threads, channels_last)
    return float(run_in_fresh_process(_probe, args, timeout_s))


def cuda_peak_memory_mb(step: Callable[[], None], device: torch.device) -> float:
    """Peak ``max_memory_allocated`` (MB) of two steps over what was allocated before them."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


# ------------------------------------------------------------------------------------ runner


@dataclass
class _Live:
    name: str
    model: nn.Module
    steps: dict[str, Callable[[], None]]  # "infer" / "train"
    times: dict[str, list[float]]
    calls: dict[str, int]  # calls per timed round, per kind


def run_bench(
    patterns: Sequence[str], opts: BenchOptions, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Measure every model that ``patterns`` names; returns the header and the rows.

    Three phases: build and warm up every model (a row each, a failure as its reason), time the
    ones that run in alternating rounds, then their throughput, MFU and memory."""
    names = resolve_names(patterns)
    device, amp = _device_and_precision(opts)
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp]
    kinds = ["infer", "train"] if opts.train else ["infer"]
    log(f"lgvit bench: {len(names)} models, {describe_machine(device)}, {precision}")
    peak = matmul_peak_flops(amp or torch.float32, device=device)
    rows, live = _build_all(names, opts, kinds, amp, device, log)
    _time_rounds(live, rows, opts, device, log)
    for m in live:
        _throughput(m, rows[m.name], opts.batch_size, peak)
        if opts.memory:
            _measure_memory(m, rows[m.name], opts, amp, device)
            log(f"  measured memory of {m.name}")
    return {
        "machine": describe_machine(device),
        "device": device.type,
        "precision": precision,
        "batch": opts.batch_size,
        "matmul_peak_tflops": peak / 1e12,
        "options": asdict(opts),
        "rows": [rows[n] for n in names],
    }


def _device_and_precision(opts: BenchOptions) -> tuple[torch.device, torch.dtype | None]:
    """The device and autocast dtype the run measures at; bad options refused in one line."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LgvitError("--device cuda: CUDA is not available on this machine")
    if opts.batch_size < 1 or opts.rounds < 1:
        raise LgvitError("--batch-size and --rounds must be at least 1")
    from lgvit.core.runtime import resolve_amp

    return device, resolve_amp(opts.amp, device)


def _build_all(
    names: Sequence[str], opts: BenchOptions, kinds: Sequence[str], amp: torch.dtype | None,
    device: torch.device, log: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], list[_Live]]:  # fmt: skip
    """Phase 1: every model's row, and the models that build and run, warmed up."""
    rows: dict[str, dict[str, Any]] = {}
    live: list[_Live] = []
    for name in names:
        rows[name] = row = _new_row(name, opts, device)
        try:
            live.append(_build_and_warm_up(name, row, opts, kinds, amp, device))
            log(f"  built and warmed up {name}")
        except Exception as e:  # noqa: BLE001 -- one row with the reason, not a crash
            row["error"] = _one_line(e)
            log(f"  {name}: {row['error']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, live


def _new_row(name: str, opts: BenchOptions, device: torch.device) -> dict[str, Any]:
    """A model's row before measuring: its input, batch and the paper's figures."""
    row = {
        "model": name, "input": _input_size(name, opts.img_size)[-1], "batch": opts.batch_size,
        "error": None,
    }  # fmt: skip
    if device.type == "cpu":
        row["cpu_bf16"] = cpu_bf16_note()  # a CSV row alone still says it
    row.update(paper_columns(name))
    return row


def _build_and_warm_up(
    name: str, row: dict[str, Any], opts: BenchOptions, kinds: Sequence[str],
    amp: torch.dtype | None, device: torch.device,
) -> _Live:  # fmt: skip
    """Params and MACs (on the meta device) into ``row``; the model on ``device`` with one
    step per kind, each warmed up (``measure.warm_up``: ``opts.warmup`` calls, on CUDA until
    stable; with --compile the first call compiles, timed), and its calls per timed round."""
    input_size = _input_size(name, opts.img_size)
    with torch.device("meta"):
        meta = build_model(name, opts.img_size, "meta")
    row["params_m"] = count_params(meta) / 1e6
    row["macs_g"] = count_macs(meta, input_size) / 1e9
    del meta
    torch.manual_seed(0)
    model = build_model(name, opts.img_size, device, opts.channels_last)
    run = torch.compile(model) if opts.compile else model
    steps = {
        k: make_step(run, input_size, opts.batch_size, k == "train", amp, device=device,
                     channels_last=opts.channels_last)
        for k in kinds
    }  # fmt: skip
    calls = {}
    for kind, step in steps.items():
        # With --compile the first call compiles (and its backward, training).
        first, calls[kind] = warm_up(step, device, step_timing(device, opts.warmup))
        row[f"{kind}_calls_per_round"] = calls[kind]
        if opts.compile:
            row[f"{kind}_compile_s"] = first
    return _Live(name, model, steps, {k: [] for k in kinds}, calls)


def _time_rounds(
    live: list[_Live], rows: dict[str, dict[str, Any]], opts: BenchOptions,
    device: torch.device, log: Callable[[str], None],
) -> None:  # fmt: skip
    """Phase 2: each round times every live model's steps in turn (alternating, so machine
    noise hits all alike); a model whose step fails leaves ``live`` with the reason."""
    for r in range(opts.rounds):
        for m in list(live):
            for kind, step in m.steps.items():
                try:
                    m.times[kind].append(timed(step, device, m.calls[kind]))
                except Exception as e:  # noqa: BLE001
                    rows[m.name]["error"] = _one_line(e)
                    live.remove(m)
                    break
        log(f"  round {r + 1}/{opts.rounds} done")


def _throughput(m: _Live, row: dict[str, Any], batch: int, peak: float) -> None:
    """Phase 3: images/s from the median round, and MFU against the matmul peak, per kind."""
    flops = 2 * row["macs_g"] * 1e9  # per image, forward
    for kind, times in m.times.items():
        img_s = batch / statistics.median(times)  # seconds per call
        mult = 3 if kind == "train" else 1  # backward ~ 2x forward
        row[f"{kind}_img_s"] = img_s
        row[f"{kind}_mfu"] = mult * flops * img_s / peak


def _measure_memory(
    m: _Live, row: dict[str, Any], opts: BenchOptions, amp: torch.dtype | None,
    device: torch.device,
) -> None:  # fmt: skip
    """Peak memory of each step kind into ``row`` (a failure as the row's error)."""
    for kind in m.steps:
        key = "train_mem_mb" if kind == "train" else "infer_mem_mb"
        try:
            if device.type == "cuda":
                row[key] = cuda_peak_memory_mb(m.steps[kind], device)
            else:
                row[key] = cpu_peak_memory_mb(
                    m.name,
                    opts.batch_size,
                    kind == "train",
                    opts.img_size,
                    amp,
                    opts.compile,
                    channels_last=opts.channels_last,
                )
        except Exception as e:  # noqa: BLE001
            row["error"] = f"memory: {_one_line(e)}"


# ------------------------------------------------------------------------------------ output

# (key, header, decimals); paper columns follow the measured one they compare with.
COLUMNS = (
    ("model", "model", None),
    ("input", "input", None),
    ("params_m", "params (M)", 2),
    ("paper_params_m", "paper", 2),
    ("macs_g", "MACs (G)", 2),
    ("paper_macs_g", "paper", 2),
    ("infer_img_s", "infer img/s", 1),
    ("infer_mfu", "MFU", None),
    ("paper_img_s", "paper img/s", 0),
    ("train_img_s", "train img/s", 1),
    ("train_mfu", "MFU", None),
    ("infer_mem_mb", "infer MB", 0),
    ("paper_test_mem_mb", "paper", 0),
    ("train_mem_mb", "train MB", 0),
    ("paper_train_mem_mb", "paper", 0),
    ("paper_top1", "paper top-1", 1),
    ("infer_compile_s", "compile s", 1),  # --compile: the first call, compiling included
    ("train_compile_s", "train compile s", 1),
    ("error", "why it failed", None),
)


# A paper column is shown only beside the measured column it compares with.
_MEASURED_BESIDE = {
    "paper_img_s": "infer_img_s",
    "paper_test_mem_mb": "infer_mem_mb",
    "paper_train_mem_mb": "train_mem_mb",
}


def _cell(row: dict[str, Any], key: str, decimals: int | None, notes: dict[str, int]) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if key.endswith("_mfu"):
        text = f"{100 * v:.0f}%"
    elif key.startswith("paper_") and isinstance(v, int | float):
        text = f"{v:g}"  # as the paper prints it
    elif decimals is None:
        text = str(v)
    else:
        text = f"{v:.{decimals}f}"
    note = None
    if key == "paper_params_m":
        note = row.get("paper_params_note")
    elif key == "paper_macs_g":
        note = row.get("paper_macs_note")
    elif key in ("paper_img_s", "paper_test_mem_mb", "paper_train_mem_mb"):
        note = row.get("paper_hardware")
    elif key == "paper_top1":
        text += f" {row.get('paper_top1_on')}" if row.get("paper_top1_on") else ""
    if note:
        notes.setdefault(note, len(notes) + 1)
        text += f" [{notes[note]}]"
    return text


def _grid(result: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """Headers, cells and footnotes; columns that are empty in every row are left out."""
    rows = result["rows"]
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    shown = {c[0] for c in cols}
    cols = [c for c in cols if _MEASURED_BESIDE.get(c[0], c[0]) in shown]  # no orphan paper column
    notes: dict[str, int] = {}
    cells = [[_cell(r, k, d, notes) for k, _, d in cols] for r in rows]
    foot = [f"[{i}] {text}" for text, i in notes.items()]
    return [h for _, h, _ in cols], cells, foot


def _method(result: dict[str, Any]) -> str:
    dev = result["device"]
    mem = (
        "peak RSS of a fresh process per model over its idle baseline"
        if dev == "cpu"
        else "max_memory_allocated over the idle baseline"
    )
    return (
        f"{result['machine']}; {result['precision']}, batch {result['batch']}, "
        f"{result['options']['rounds']} alternating rounds (median); MFU against a measured "
        f"matmul peak of {result['matmul_peak_tflops']:.2f} TFLOP/s; memory: {mem}. "
        "MACs: FlopCounterMode / 2 at the input size, batch 1."
    )


def format_result(result: dict[str, Any], fmt: str) -> str:
    """The result as an aligned text table, a markdown table, CSV or JSON."""
    if fmt == "json":
        return json.dumps(result, indent=2, default=str) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        keys = [c[0] for c in COLUMNS] + [
            "batch", "cpu_bf16", "paper_params_note", "paper_macs_note", "paper_hardware",
            "paper_top1_on",
        ]  # fmt: skip
        keys = list(dict.fromkeys(keys))
        writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for r in result["rows"]:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in keys})
        return out.getvalue()
    headers, cells, foot = _grid(result)
    if fmt == "markdown":
        lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
        return "\n".join(lines + [""] + [f"{f}  " for f in foot] + ["", _method(result)]) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        cols = [v.rjust(w) for v, w in zip(vals, widths, strict=True)]
        cols[0] = vals[0].ljust(widths[0])
        if headers[-1] == "why it failed":  # free text, left-aligned and last
            cols[-1] = vals[-1] if vals[-1] != "-" else ""
        return " ".join(cols).rstrip()

    out = [line(headers), "-" * len(line(headers))] + [line(r) for r in cells]
    return "\n".join(out + foot + textwrap.wrap(_method(result), 100)) + "\n"
