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
- ``--batch-size auto``: each model's batch doubles from 64 (the LIT paper's) until it runs out
  of memory or gains under 5% in img/s; the row gives the paper's batch and the best one.
- CUDA: cuDNN autotunes its convolutions while measuring (``cudnn.benchmark``, as timm's
  scripts run). ``--compile MODE``: ``torch.compile`` in that mode; the compiled model's logits
  against the eager model's on the same batch are a column.
- Busy: the share of a short ``torch.profiler`` pass's wall time the GPU runs kernels (on the
  CPU, the time inside torch ops): far under 100% is a step bound by the host, not the GPU.
- A model that cannot be built or run at the chosen size is a row with the reason.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import io
import json
import statistics
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn

from lgvit.core.errors import LgvitError
from lgvit.core.runtime import COMPILE_MODES
from lgvit.models import create_model, get_model_config, is_model, list_models
from lgvit.tools.measure import (
    StepTiming,
    busy_fraction,
    count_macs,
    count_params,
    cpu_bf16_note,
    describe_machine,
    make_step,
    matmul_peak_flops,
    peak_rss_mb,
    relative_error,
    reset_peak_rss,
    rss_mb,
    run_in_fresh_process,
    step_timing,
    timed,
    warm_up,
)

DEFAULT_BATCH = 64  # the LIT paper's throughput batch; the LSA and LocalViT papers name none
FORMATS = ("table", "markdown", "csv", "json")
AUTO = "auto"  # --batch-size auto
AUTO_GAIN = 0.05  # the sweep stops where doubling the batch gains less than this in img/s
AUTO_MAX_BATCH = 8192  # nor past this (a bound on the sweep's time on a large GPU)
BUSY_STEPS = 3  # steps of the profiler pass on CUDA (one on the CPU, where a step is long)


@dataclass
class BenchOptions:
    device: str = "cpu"
    amp: str = "auto"  # one of lgvit.core.runtime.AMP_MODES
    batch_size: int | str = DEFAULT_BATCH  # or AUTO
    img_size: int | None = None  # None: each model's default input size
    train: bool = False
    compile: str | bool | None = None  # a mode of COMPILE_MODES (True: "default"); None: eager
    channels_last: bool = False  # models and inputs in NHWC (timm's --channels-last)
    rounds: int = 3
    warmup: int = 1
    memory: bool = True
    busy: bool = True  # the profiler pass
    max_batch: int = AUTO_MAX_BATCH  # --batch-size auto: the sweep's last batch at most


@dataclass
class ExtraModel:
    """A model outside lgvit's registry measured beside lgvit's in the same run (timm's, an
    author's): the same steps, rounds and columns, no paper figures. ``build`` makes it on the
    CPU; it is moved to the run's device."""

    name: str
    build: Callable[[], nn.Module]
    input_size: tuple[int, int, int]


def compile_mode(opts: BenchOptions) -> str | None:
    """The ``torch.compile`` mode ``opts`` asks for (None: eager); a bad one is one line."""
    mode = "default" if opts.compile is True else (opts.compile or None)
    if mode is not None and mode not in COMPILE_MODES:
        raise LgvitError(f"--compile {mode!r}: choose {', '.join(COMPILE_MODES)}")
    return mode


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
        model = torch.compile(model, mode=None if compile_ is True else compile_)
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
    compile_: bool | str | None = None,
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

Key = tuple[str, int]  # a step: its kind ("infer" / "train") and batch


@dataclass
class _Live:
    name: str
    model: nn.Module
    steps: dict[Key, Callable[[], None]]
    times: dict[Key, list[float]]
    calls: dict[Key, int]  # calls per timed round, per step


def run_bench(
    patterns: Sequence[str], opts: BenchOptions, log: Callable[[str], None] = print,
    extra: Sequence[ExtraModel] = (),
) -> dict[str, Any]:  # fmt: skip
    """Measure every model that ``patterns`` names (all when empty and no ``extra``), then the
    ``extra`` ones; returns the header and the rows.

    Three phases: build and warm up every model (a row each, a failure as its reason; with
    ``--batch-size auto`` each model's sweep), time the ones that run in alternating rounds,
    then their throughput, MFU, busy share and memory."""
    names = resolve_names(patterns) if patterns or not extra else []
    device, amp = _device_and_precision(opts)
    mode = compile_mode(opts)
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp]
    kinds = ["infer", "train"] if opts.train else ["infer"]
    specs = [ExtraModel(n, lambda n=n: build_model(n, opts.img_size, "cpu"),
                        _input_size(n, opts.img_size)) for n in names] + list(extra)  # fmt: skip
    log(f"lgvit bench: {len(specs)} models, {describe_machine(device)}, {precision}")
    with measuring(device, mode):
        peak = matmul_peak_flops(amp or torch.float32, device=device)
        rows, live = _build_all(specs, set(names), opts, kinds, amp, device, log)
        _time_rounds(live, rows, opts, device, log)
        for m in live:
            _throughput(m, rows[m.name], peak)
            if opts.busy:
                _measure_busy(m, rows[m.name], device)
            if opts.memory:
                _measure_memory(m, rows[m.name], opts, amp, device, m.name in names)
                log(f"  measured memory of {m.name}")
    return {
        "machine": describe_machine(device),
        "device": device.type,
        "precision": precision,
        "batch": opts.batch_size,
        "compile": mode,
        "matmul_peak_tflops": peak / 1e12,
        "options": asdict(opts),
        "rows": [rows[s.name] for s in specs],
    }


@contextlib.contextmanager
def measuring(device: torch.device, mode: str | None) -> Iterator[None]:
    """The settings a measurement runs under, restored after: on CUDA cuDNN autotunes each
    convolution shape (``cudnn.benchmark``, as timm's scripts and training run); compiling,
    dynamo may keep a graph per batch and step kind of the sweep (its default limit of 8 would
    send the rest back to eager, silently)."""
    saved = torch.backends.cudnn.benchmark
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    with contextlib.ExitStack() as stack:
        if mode is not None:
            from torch import _dynamo  # only when compiling: lgvit bench alone never imports it

            cfg = _dynamo.config
            limits = {k: 64 for k in ("cache_size_limit", "recompile_limit") if hasattr(cfg, k)}
            stack.enter_context(cfg.patch(**limits))
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = saved


def _device_and_precision(opts: BenchOptions) -> tuple[torch.device, torch.dtype | None]:
    """The device and autocast dtype the run measures at; bad options refused in one line."""
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LgvitError("--device cuda: CUDA is not available on this machine")
    batch = opts.batch_size
    if batch != AUTO and (not isinstance(batch, int) or batch < 1):
        raise LgvitError(f"--batch-size {batch!r}: a positive count or {AUTO}")
    if opts.rounds < 1:
        raise LgvitError("--rounds must be at least 1")
    from lgvit.core.runtime import resolve_amp

    return device, resolve_amp(opts.amp, device)


def _build_all(
    specs: Sequence[ExtraModel], registered: set[str], opts: BenchOptions, kinds: Sequence[str],
    amp: torch.dtype | None, device: torch.device, log: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], list[_Live]]:  # fmt: skip
    """Phase 1: every model's row, and the models that build and run, warmed up."""
    rows: dict[str, dict[str, Any]] = {}
    live: list[_Live] = []
    for spec in specs:
        rows[spec.name] = row = _new_row(spec, spec.name in registered, opts, device)
        try:
            live.append(_build_and_warm_up(spec, row, spec.name in registered, opts, kinds, amp,
                                           device))  # fmt: skip
            log(f"  built and warmed up {spec.name}")
        except Exception as e:  # noqa: BLE001 -- one row with the reason, not a crash
            row["error"] = _one_line(e)
            log(f"  {spec.name}: {row['error']}")
        _free(device)
    return rows, live


def _free(device: torch.device) -> None:
    """What the last model or batch left behind, released (CUDA's cache included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _new_row(
    spec: ExtraModel, registered: bool, opts: BenchOptions, device: torch.device
) -> dict[str, Any]:
    """A model's row before measuring: its input, batch and the paper's figures."""
    batch = DEFAULT_BATCH if opts.batch_size == AUTO else opts.batch_size
    row = {"model": spec.name, "input": spec.input_size[-1], "batch": batch, "error": None}
    if device.type == "cpu":
        row["cpu_bf16"] = cpu_bf16_note()  # a CSV row alone still says it
    if registered:
        row.update(paper_columns(spec.name))
    return row


def _build_and_warm_up(
    spec: ExtraModel, row: dict[str, Any], registered: bool, opts: BenchOptions,
    kinds: Sequence[str], amp: torch.dtype | None, device: torch.device,
) -> _Live:  # fmt: skip
    """Params and MACs into ``row`` (a registered model's on the meta device); the model on
    ``device`` with its steps, each warmed up (``measure.warm_up``: ``opts.warmup`` calls, on
    CUDA until stable; compiling, the first call compiles, timed), and its calls per timed
    round. ``--batch-size auto``: each kind's sweep (:func:`sweep_batch`), whose first and best
    batches are kept."""
    mode = compile_mode(opts)
    if registered:
        with torch.device("meta"):
            meta = build_model(spec.name, opts.img_size, "meta")
        row["params_m"] = count_params(meta) / 1e6
        row["macs_g"] = count_macs(meta, spec.input_size) / 1e9
        del meta
    torch.manual_seed(0)
    model = spec.build().to(device)
    if opts.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if not registered:  # on the device: foreign code need not build on meta
        row["params_m"] = count_params(model) / 1e6
        row["macs_g"] = count_macs(model, spec.input_size) / 1e9
    # Static shapes: each batch of a sweep gets its own graph, as a run at a fixed batch has
    # (dynamo would otherwise turn the batch symbolic at the second one).
    run = torch.compile(model, mode=mode, dynamic=False) if mode else model

    def make(kind: str, batch: int) -> Callable[[], None]:
        return make_step(run, spec.input_size, batch, kind == "train", amp, device=device,
                         channels_last=opts.channels_last,
                         cudagraphs=mode == "reduce-overhead")  # fmt: skip

    timing = step_timing(device, opts.warmup)
    live = _Live(spec.name, model, {}, {}, {})
    for kind in kinds:
        if opts.batch_size == AUTO:
            sweep = sweep_batch(lambda b, kind=kind: make(kind, b), device, timing,
                                limit=opts.max_batch,
                                cleanup=lambda: model.zero_grad(set_to_none=True))  # fmt: skip
            kept, first = sweep.kept, sweep.first_s
            row.update({f"{kind}_best_batch": sweep.best, f"{kind}_sweep": sweep.img_s,
                        f"{kind}_sweep_stop": sweep.stop})  # fmt: skip
        else:
            step = make(kind, row["batch"])
            first, calls = warm_up(step, device, timing)
            kept = {row["batch"]: (step, calls)}
        for batch, (step, calls) in kept.items():
            live.steps[kind, batch], live.calls[kind, batch] = step, calls
            live.times[kind, batch] = []
        row[f"{kind}_calls_per_round"] = live.calls[kind, row["batch"]]
        if mode:
            row[f"{kind}_compile_s"] = first
    if mode:
        row["compile_rel_err"] = _compile_error(model, run, spec.input_size, row["batch"], amp,
                                                device, opts.channels_last, mode)  # fmt: skip
    return live


@dataclass
class Sweep:
    """A batch sweep's outcome: img/s per batch tried, the best, why it stopped, the seconds of
    the first call (compiling, the compile), and the steps kept: the first batch's and the
    best's, each with its calls per timed round."""

    img_s: dict[int, float]
    best: int
    stop: str
    first_s: float
    kept: dict[int, tuple[Callable[[], None], int]] = field(default_factory=dict)


def sweep_batch(
    make: Callable[[int], Callable[[], None]], device: torch.device | str,
    timing: StepTiming | None = None, start: int = DEFAULT_BATCH, limit: int = AUTO_MAX_BATCH,
    gain: float = AUTO_GAIN, cleanup: Callable[[], None] | None = None,
) -> Sweep:  # fmt: skip
    """The batch doubled from ``start`` (``make(batch)`` builds the step), each warmed up and
    timed for one round, until a step runs out of memory, doubling gains under ``gain`` in
    img/s, or the next batch would pass ``limit``. Out of memory at ``start`` itself raises."""
    device = torch.device(device)
    timing = timing or step_timing(device)
    img_s: dict[int, float] = {}
    kept: dict[int, tuple[Callable[[], None], int]] = {}
    batch, first_s = start, 0.0
    while True:
        step = None
        try:
            step = make(batch)
            first, calls = warm_up(step, device, timing)
            img_s[batch] = batch / timed(step, device, calls)
        except Exception as e:
            if not is_out_of_memory(e) or batch == start:
                raise
        if batch not in img_s:  # out of memory; out of the handler, its frames are gone
            del step
            if cleanup:
                cleanup()
            _free(device)
            stop = f"out of memory at batch {batch}"
            break
        first_s = first if batch == start else first_s
        best = max(img_s, key=img_s.__getitem__)
        kept = {b: v for b, v in {**kept, batch: (step, calls)}.items() if b in (start, best)}
        del step
        if batch > start and img_s[batch] < img_s[batch // 2] * (1 + gain):
            stop = f"under {gain:.0%} gain at batch {batch}"
            break
        if 2 * batch > limit:
            stop = f"at the sweep's limit, batch {batch}"
            break
        batch *= 2
    _free(device)
    return Sweep({b: round(v, 1) for b, v in img_s.items()}, best, stop, first_s, kept)


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is a device (or the CPU's allocator) running out of memory, also where a
    compiler wrapped it."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e).lower()
    return "out of memory" in text or "can't allocate memory" in text


def _compile_error(
    model: nn.Module, run: nn.Module, input_size: tuple[int, int, int], batch: int,
    amp: torch.dtype | None, device: torch.device, channels_last: bool, mode: str,
) -> float:  # fmt: skip
    """The compiled model's inference logits against the eager model's on one batch, as the
    inference step runs (eval, ``inference_mode``, autocast): no new graph is compiled."""
    x = torch.randn(batch, *input_size, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    ctx = torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
    model.eval()
    with torch.inference_mode(), ctx:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        got = run(x).float().clone()  # a CUDA graph's output is overwritten by its next replay
        want = model(x).float()
    return relative_error(got, want)


def _time_rounds(
    live: list[_Live], rows: dict[str, dict[str, Any]], opts: BenchOptions,
    device: torch.device, log: Callable[[str], None],
) -> None:  # fmt: skip
    """Phase 2: each round times every live model's steps in turn (alternating, so machine
    noise hits all alike); a model whose step fails leaves ``live`` with the reason."""
    for r in range(opts.rounds):
        for m in list(live):
            for key, step in m.steps.items():
                try:
                    m.times[key].append(timed(step, device, m.calls[key]))
                except Exception as e:  # noqa: BLE001
                    rows[m.name]["error"] = _one_line(e)
                    live.remove(m)
                    break
        log(f"  round {r + 1}/{opts.rounds} done")


def _throughput(m: _Live, row: dict[str, Any], peak: float) -> None:
    """Phase 3: images/s from the median round, and MFU against the matmul peak, per step; the
    row's batch under ``{kind}_``, a sweep's best under ``{kind}_best_``."""
    flops = 2 * row["macs_g"] * 1e9  # per image, forward
    for (kind, batch), times in m.times.items():
        img_s = batch / statistics.median(times)  # seconds per call
        mult = 3 if kind == "train" else 1  # backward ~ 2x forward
        for prefix, at in ((kind, row["batch"]), (f"{kind}_best", row.get(f"{kind}_best_batch"))):
            if batch == at:
                row[f"{prefix}_img_s"] = img_s
                row[f"{prefix}_mfu"] = mult * flops * img_s / peak


def _measure_busy(m: _Live, row: dict[str, Any], device: torch.device) -> None:
    """The busy share of each kind's step at its best batch (the row's without a sweep)."""
    for kind in {k for k, _ in m.steps}:
        batch = row.get(f"{kind}_best_batch", row["batch"])
        steps = BUSY_STEPS if device.type == "cuda" else 1
        try:
            row[f"{kind}_busy"] = busy_fraction(m.steps[kind, batch], device, steps)
        except Exception as e:  # noqa: BLE001 -- a profiler that cannot run here: no figure
            row[f"{kind}_busy_error"] = _one_line(e)


def _measure_memory(
    m: _Live, row: dict[str, Any], opts: BenchOptions, amp: torch.dtype | None,
    device: torch.device, registered: bool,
) -> None:  # fmt: skip
    """Peak memory of each step kind at the row's batch into ``row`` (a failure as the row's
    error). The CPU's probe builds the model by name in a fresh process: registered ones only."""
    for kind in {k for k, _ in m.steps}:
        key = "train_mem_mb" if kind == "train" else "infer_mem_mb"
        try:
            if device.type == "cuda":
                row[key] = cuda_peak_memory_mb(m.steps[kind, row["batch"]], device)
            elif registered:
                row[key] = cpu_peak_memory_mb(
                    m.name, row["batch"], kind == "train", opts.img_size, amp,
                    compile_mode(opts), channels_last=opts.channels_last,
                )  # fmt: skip
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
    ("infer_best_batch", "best batch", None),  # --batch-size auto: the sweep's best
    ("infer_best_img_s", "img/s", 1),
    ("infer_best_mfu", "MFU", None),
    ("infer_busy", "busy", None),
    ("train_img_s", "train img/s", 1),
    ("train_mfu", "MFU", None),
    ("train_best_batch", "best batch", None),
    ("train_best_img_s", "img/s", 1),
    ("train_best_mfu", "MFU", None),
    ("train_busy", "busy", None),
    ("infer_mem_mb", "infer MB", 0),
    ("paper_test_mem_mb", "paper", 0),
    ("train_mem_mb", "train MB", 0),
    ("paper_train_mem_mb", "paper", 0),
    ("paper_top1", "paper top-1", 1),
    ("infer_compile_s", "compile s", 1),  # --compile: the first call, compiling included
    ("train_compile_s", "train compile s", 1),
    ("compile_rel_err", "compiled vs eager", None),
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
    if key.endswith(("_mfu", "_busy")):
        text = f"{100 * v:.0f}%"
    elif key == "compile_rel_err":
        text = f"{v:.1e}"
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
    batch = result["batch"]
    if batch == AUTO:
        batch = (f"batch {DEFAULT_BATCH} and the best of a sweep doubling it until out of "
                 f"memory or under {AUTO_GAIN:.0%} gain")  # fmt: skip
    else:
        batch = f"batch {batch}"
    busy = "the GPU runs kernels" if dev == "cuda" else "inside torch ops"
    mode = result.get("compile")
    return (
        f"{result['machine']}; {result['precision']}, {batch}, "
        + (f"torch.compile mode {mode}, " if mode else "eager, ")
        + ("cuDNN autotuning, " if dev == "cuda" else "")
        + f"{result['options']['rounds']} alternating rounds (median); MFU against a measured "
        f"matmul peak of {result['matmul_peak_tflops']:.2f} TFLOP/s; busy: share of a profiled "
        f"pass's wall time {busy}; memory: {mem}. "
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
            "paper_top1_on", "infer_sweep", "infer_sweep_stop", "train_sweep",
            "train_sweep_stop",
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
