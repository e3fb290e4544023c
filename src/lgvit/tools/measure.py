"""Measuring models the way the paper tables do: params, MACs, throughput, memory; how busy a
step keeps the device; and whether two devices compute the same model (IEEE fp32, the gradient
agreement rule)."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import re
import resource
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lgvit.models import create_model, get_model_config
from lgvit.models.layers import as_written


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
    fused CPU kernel and would silently count attention as zero. The model runs
    :func:`~lgvit.models.layers.as_written`: the count is the architecture's (LSA's folded
    key/value projection executes fewer MACs than the architecture it computes).
    """
    p = next(model.parameters())
    x = torch.zeros(batch, *input_size, device=p.device, dtype=p.dtype)
    was_training = model.training
    model.eval()
    macs = count_macs_of(lambda: model(x))
    model.train(was_training)
    return macs


def count_macs_of(fn: Callable[[], Any]) -> int:
    """Multiply-accumulates of ``fn()`` as :func:`count_macs` counts them (attention through
    SDPA's math backend so it is counted; meta tensors are fine)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), as_written():
        with FlopCounterMode(display=False) as counter:
            fn()
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


def device_sync(device: torch.device | str = "cpu") -> Callable[[], None]:
    """What waits for the work queued on ``device``: ``torch.cuda.synchronize`` on CUDA (its
    kernels run asynchronously, so a clock read without it times their launches), nothing on
    the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed(fn: Callable[[], Any], device: torch.device | str = "cpu", steps: int = 1) -> float:
    """Seconds per call of ``steps`` calls of ``fn`` back to back: wall clock between two
    synchronisations of the device (so work queued before is not counted, and all of the
    calls' work is, with no sync between the calls)."""
    sync = device_sync(device)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps


@dataclass(frozen=True)
class StepTiming:
    """How a step is warmed up and how many calls one timed round makes."""

    warmup: int = 1  # warm-up calls at least (under torch.compile the first one compiles)
    max_warmup: int = 1  # at most: more until two calls in a row agree within ``stable``
    stable: float = 0.05
    min_steps: int = 1  # calls per timed round at least,
    round_s: float = 0.0  # and enough to last about this long at the warmed-up speed,
    max_steps: int = 1  # but no more than this


# A GPU step can take a millisecond: one per round would time the launch and the sync, and its
# clocks and caches settle over several calls. The CPU rounds stay one call each, as measured.
CUDA_TIMING = StepTiming(warmup=3, max_warmup=30, min_steps=10, round_s=0.5, max_steps=1000)


def step_timing(device: torch.device | str = "cpu", warmup: int = 1) -> StepTiming:
    """The timing of a step on ``device`` with at least ``warmup`` warm-up calls."""
    if torch.device(device).type == "cuda":
        c = CUDA_TIMING
        return replace(c, warmup=max(warmup, c.warmup), max_warmup=max(warmup, c.max_warmup))
    return StepTiming(warmup=warmup, max_warmup=warmup)


def warm_up(
    fn: Callable[[], Any], device: torch.device | str = "cpu", timing: StepTiming | None = None
) -> tuple[float, int]:
    """Calls ``fn`` until warm: ``timing.warmup`` calls, then more (up to ``max_warmup``) until
    two in a row agree within ``stable``. Returns the seconds of the first call (under
    torch.compile: the compile) and the calls a timed round makes: enough for ``round_s`` at
    the last call's speed, within ``min_steps`` and ``max_steps``."""
    t = timing or step_timing(device)
    first = last = timed(fn, device)
    prev, calls = None, 1
    while calls < t.warmup or (
        calls < t.max_warmup and (prev is None or abs(last - prev) > t.stable * prev)
    ):
        prev, last = last, timed(fn, device)
        calls += 1
    steps = math.ceil(t.round_s / max(last, 1e-9))
    return first, min(max(steps, t.min_steps), t.max_steps)


def time_fn(
    fn: Callable[[], Any], warmup: int = 2, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` rounds, after warm-up (see
    :func:`step_timing`: on the CPU ``warmup`` calls and one call a round)."""
    _, steps = warm_up(fn, device, step_timing(device, warmup))
    return statistics.median(timed(fn, device, steps) for _ in range(repeats))


def matmul_peak_flops(
    dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Measured matmul FLOP/s for ``dtype`` on ``device`` (the MFU denominator): the fastest of
    ``repeats`` runs, since a peak is what the hardware can do (on a shared 2-core machine the
    median of 5 came out up to 10% under the best)."""
    if torch.device(device).type == "cuda":
        n = max(n, 8192)  # a 2048 matmul does not fill a large GPU
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    steps = step_timing(device).min_steps  # on CUDA several, so no sync sits inside one mm
    sec = min(timed(lambda: torch.mm(a, b), device, steps) for _ in range(repeats))
    return 2 * n**3 / sec


def train_optimizer(model: nn.Module, device: torch.device | str) -> torch.optim.Optimizer:
    """The optimizer ``lgvit train`` builds for ``model`` on ``device`` with the run config's
    defaults: the run's own factory and parameter groups (fused AdamW on the CPU and CUDA)."""
    from lgvit.run.config import TrainConfig
    from lgvit.run.optim import build_optimizer, param_groups

    cfg = TrainConfig()
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the names groups match
    groups = param_groups(model, cfg.weight_decay, cfg.offset_lr_factor)
    return build_optimizer(cfg, groups, cfg.lr, torch.device(device))


def make_step(
    model: nn.Module,
    input_size: tuple[int, int, int],
    batch: int,
    train: bool,
    amp_dtype: torch.dtype | None = None,
    fused: bool = True,
    device: torch.device | str = "cpu",
    channels_last: bool = False,
    cudagraphs: bool = False,
) -> Callable[[], None]:
    """One inference batch (``inference_mode``) or one training step (forward, cross-entropy,
    backward, optimizer step), on random data of the model's input size, under autocast to
    ``amp_dtype`` on ``device`` when given. ``fused``: the optimizer training builds
    (:func:`train_optimizer`: fused AdamW); False: the multi-tensor AdamW of a plain script.
    ``channels_last``: the input batch in that memory format (for a model converted to it).
    ``cudagraphs``: each call starts a new CUDA-graph step (``torch.compile``'s
    ``reduce-overhead`` mode replays graphs whose outputs the next step may overwrite).

    The model's mode is set on every call, so one model can serve both kinds of step.
    """
    device = torch.device(device)
    x = torch.randn(batch, *input_size, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    mark = torch.compiler.cudagraph_mark_step_begin if cudagraphs else lambda: None
    if not train:

        def infer() -> None:
            mark()
            model.eval()
            with torch.inference_mode(), amp:
                model(x)

        return infer
    classes = getattr(model, "num_classes", 10) or 10
    y = torch.randint(0, classes, (batch,), device=device)
    if fused:
        opt = train_optimizer(model, device)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None

    def step() -> None:
        mark()
        model.train()
        with amp:
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------ CPU memory


def _child(conn, target: Callable[..., Any], args: tuple) -> None:  # noqa: ANN001
    try:
        conn.send(("ok", target(*args)))
    except BaseException as e:  # noqa: BLE001 -- sent back as the reason
        conn.send(("error", f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]))


def run_in_fresh_process(target: Callable[..., Any], args: tuple, timeout_s: float = 3600) -> Any:
    """``target(*args)`` in a freshly spawned process (its own peak memory, nothing inherited);
    returns its result. A failure or a dead child is a ``RuntimeError`` with the reason."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, target, args), daemon=True)
    proc.start()
    child.close()
    msg = parent.recv() if parent.poll(timeout_s) else None
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if msg is None:
        code = proc.exitcode
        why = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        hint = " (killed: out of memory?)" if code == -9 else ""
        raise RuntimeError(f"child process died with {why}{hint}")
    status, value = msg
    if status != "ok":
        raise RuntimeError(value)
    return value


def _status_kb(field: str) -> int | None:
    try:
        text = open("/proc/self/status").read()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m[1]) if m else None


def rss_mb() -> float:
    """This process's resident memory now (MB)."""
    kb = _status_kb("VmRSS")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux: ``/proc/self/clear_refs`` 5); False if unsupported,
    in which case the peak counts from process start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident memory of this process (MB) since start or the last ``reset_peak_rss``."""
    kb = _status_kb("VmHWM")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def describe_machine(device: torch.device | str = "cpu") -> str:
    """CPU model name and whether it has native bf16 (or the GPU's name), the thread count and
    the torch version, for the header of a result."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (
        f"{cpu} ({cpu_bf16_note()}), {torch.get_num_threads()} threads, torch {torch.__version__}"
    )


def cpu_bf16_note() -> str:
    """``'native bf16: amx_bf16'`` (or the flag found), or ``'bf16 emulated'``."""
    from lgvit.core.runtime import cpu_bf16_support

    flag = cpu_bf16_support()
    return f"native bf16: {flag}" if flag else "bf16 emulated"


# ------------------------------------------------------------------------ how busy a step is


def busy_fraction(
    fn: Callable[[], Any], device: torch.device | str = "cpu", steps: int = 2
) -> float | None:
    """The share of the wall time of ``steps`` calls of ``fn`` that the device is busy, from a
    ``torch.profiler`` trace: on CUDA the union of the kernels' intervals (only CUDA activity is
    traced, so the host pays no per-op tracing), on the CPU the union of the torch ops'
    intervals (the host's equivalent: the rest is Python and framework overhead). A step far
    under 1 on CUDA is bound by the host's launches, not by the GPU. None where the trace holds
    no activity of the device (a profiler build without CUDA support)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # kineto's progress lines on stderr: errors only
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = device_sync(device)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == kind]
    return busy_share(spans, wall_us)


def busy_share(spans: list[tuple[float, float]], wall: float) -> float | None:
    """The length of the union of ``spans`` (start, end) over ``wall`` (same unit), at most 1:
    overlapping kernels (several streams) or nested ops count once. None without spans."""
    if not spans or wall <= 0:
        return None
    busy, end = 0.0, -math.inf
    for s, e in sorted(spans):
        if e > end:
            busy += e - max(s, end)
            end = e
    return min(1.0, busy / wall)


# ----------------------------------------------------------------- agreement between devices

# The rule both benchmarks/gpu_check.py (part a) and tests/test_device.py compare a device's
# fp32 logits and gradients against the CPU's by. Calibrated on fp32's own error: every family
# in float32 against float64 on the CPU is at most 1e-5 off (tests/test_agreement.py), so 1e-3
# leaves a GPU's different summation order a factor 100 and still fails a tensor 10% wrong.
LOGITS_TOL = 1e-3
GRAD_TOL = 1e-3
# A tensor's error is taken relative to its own gradient, but to no less than this share of the
# whole gradient's norm: a gradient that is zero in exact arithmetic (a bias feeding a
# BatchNorm) is rounding noise on both devices, and its relative error means nothing.
GRAD_FLOOR = 1e-3


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 on the CPU (inf where ``want`` is zero and
    ``got`` is not)."""
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    diff, size = float((a - b).norm()), float(b.norm())
    return diff / size if size else (0.0 if diff == 0 else math.inf)


def grad_errors(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], floor: float = GRAD_FLOOR
) -> dict[str, float]:
    """Each gradient's error against the reference ``want``: ``||got - want||`` over
    ``max(||want||, floor * ||all of want||)``, in float64 on the CPU. A missing or extra
    tensor is a ``ValueError`` naming it."""
    if got.keys() != want.keys():
        odd = sorted(set(got) ^ set(want))
        raise ValueError(f"the gradients name different tensors: {', '.join(odd[:5])}")
    ref = {k: v.detach().double().cpu() for k, v in want.items()}
    total = math.sqrt(sum(float(v.square().sum()) for v in ref.values()))
    out = {}
    for k, v in ref.items():
        diff = float((got[k].detach().double().cpu() - v).norm())
        size = max(float(v.norm()), floor * total)
        out[k] = diff / size if size else (0.0 if diff == 0 else math.inf)
    return out


def worst_grad_error(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], floor: float = GRAD_FLOOR
) -> tuple[float, str]:
    """The largest of :func:`grad_errors` and the tensor it belongs to; the gradients agree
    when it is under :data:`GRAD_TOL`."""
    errors = grad_errors(got, want, floor)
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in IEEE fp32 on CUDA (TF32 off for cuBLAS and cuDNN,
    matmul precision ``highest``) inside the block, every setting restored after. TF32's 10-bit
    mantissa would put a 1e-2 error between a GPU and the CPU that no kernel is to blame for.
    torch>=2.9 refuses to read the legacy flags back once its per-backend ``fp32_precision``
    settings have been written: then those are saved and restored instead (writing them back
    would leave the legacy flags unreadable to code that reads them, such as a run's start)."""
    saved = _fp32_settings()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        _restore_fp32_settings(saved)


# torch>=2.9's per-backend settings, the generic one first (it is the specific ones' default).
_FP32_PRECISION = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn",
                   "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")  # fmt: skip


def _backend(path: str) -> Any:
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
    return obj


def _fp32_settings() -> tuple[str, Any]:
    try:  # the legacy flags while they read back: writing them keeps them readable
        legacy = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                  torch.get_float32_matmul_precision())  # fmt: skip
        return "legacy", legacy
    except RuntimeError:  # written through the per-backend API (torch>=2.9): save that one
        found = {p: _backend(p).fp32_precision for p in _FP32_PRECISION
                 if hasattr(_backend(p), "fp32_precision")}  # fmt: skip
        return "per-backend", found


def _restore_fp32_settings(saved: tuple[str, Any]) -> None:
    kind, values = saved
    if kind == "legacy":
        matmul_tf32, cudnn_tf32, precision = values
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32  # before the precision it implies
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        torch.set_float32_matmul_precision(precision)
        return
    for path, value in values.items():  # the generic one first: the others' default
        _backend(path).fp32_precision = value


def without_randomness(model: nn.Module) -> nn.Module:
    """``model`` with its dropout, attention dropout and drop path at 0 (in place): a training
    step the same on two devices, whose random streams differ, with batch statistics kept."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "drop_prob", None), float):
            m.drop_prob = 0.0
        if isinstance(getattr(m, "attn_drop", None), float):
            m.attn_drop = 0.0
    return model
