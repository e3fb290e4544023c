"""Timing harness shared by the family benchmarks: step functions, an in-process runner, a
runner in a separate spawned process (for another implementation, built by a named function),
alternating rounds, and the table.

Every configuration is timed once per round, round after round, so machine noise hits all of
them alike; results are per-configuration medians.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

Key = tuple  # (impl, model, mode, precision, batch)

_FROM_MEASURE = ("describe_machine", "make_step", "peak_rss_mb")


def __getattr__(name: str) -> Any:
    """lgvit's measuring helpers, re-exported lazily: importing this module must not import
    lgvit, so that a spawned worker puts another checkout's ``src`` first and imports that."""
    if name in _FROM_MEASURE:
        from lgvit.tools import measure

        return getattr(measure, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def add_device_flag(ap: Any) -> None:
    """``--device`` on an argparse parser: where the benchmark's models run (default cpu)."""
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")


def parse_device(name: str) -> torch.device:
    """``--device``'s value as a device; CUDA where there is none exits with one line."""
    try:
        device = torch.device(name)
    except RuntimeError:
        sys.exit(f"--device {name!r}: not a device (cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {name}: CUDA is not available on this machine")
    return device


def time_infer_train(
    model: nn.Module, infer: Callable[[], Any], loss: Callable[[], torch.Tensor], steps: int,
    bf16: bool, device: torch.device | str = "cpu",
) -> tuple[float, float, float]:  # fmt: skip
    """Median seconds of ``infer()`` (eval mode, no grad) and of a training step (``loss()``,
    backward, the optimizer ``lgvit train`` builds), timed as ``measure.time_fn`` does on
    ``device`` (``steps`` rounds), under bf16 autocast when asked; and the peak memory (GB)
    counted from just before the first training step: RSS on the CPU, allocated on CUDA."""
    from lgvit.tools.measure import peak_rss_mb, reset_peak_rss, time_fn, train_optimizer

    device = torch.device(device)

    def run_infer() -> None:
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            infer()

    opt = train_optimizer(model, device)

    def train() -> None:
        model.train()
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            value = loss()
        value.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_inf = time_fn(run_infer, warmup=1, repeats=steps, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()
    t_train = time_fn(train, warmup=1, repeats=steps, device=device)
    if device.type == "cuda":
        return t_inf, t_train, torch.cuda.max_memory_allocated(device) / 2**30
    return t_inf, t_train, peak_rss_mb() / 1024


def peak_rss_gb() -> float:
    from lgvit.tools.measure import peak_rss_mb

    return peak_rss_mb() / 1024


def _stub_attr(attr: str) -> type:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {"__init__": lambda self, *a, **k: None})


def stub_torchvision() -> None:
    """An empty ``torchvision`` so that old timm (0.3.2) imports where torchvision does not
    (a torch build without it); the model code never calls it. A working torchvision is kept."""
    if "torchvision" in sys.modules:
        return
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 -- missing, or built for another torch
        pass
    else:
        return
    parent = None
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so submodule imports resolve to the entries below
        mod.__getattr__ = _stub_attr
        sys.modules[name] = mod
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], mod)
        parent = mod


def _worker(
    conn, builder: str, args: tuple, threads: int, paths: Sequence[str], tuned_malloc: bool,
    device: str = "cpu", fused: bool = True,
) -> None:  # fmt: skip
    # First, before anything imports lgvit: multiprocessing's spawn gives the child the
    # parent's sys.path (PYTHONPATH alone lost to it: a "baseline" ran the current code).
    sys.path[:0] = list(paths)
    if any(os.path.isdir(os.path.join(p, "lgvit")) for p in paths):
        # spawn re-imports the parent's main script (a benchmark that imports lgvit) before
        # this runs: drop that lgvit so the next import finds the other checkout's.
        for mod in [m for m in sys.modules if m == "lgvit" or m.startswith("lgvit.")]:
            del sys.modules[mod]
    from lgvit.tools import measure

    torch.set_num_threads(threads)
    # The same allocator settings in every process (lgvit's CLI default): without them, a
    # process's speed depended on what it had allocated before (page faults on fresh memory),
    # e.g. the authors' DeiT-T at batch 64 ran at 129 or 197 img/s depending on the
    # configurations prepared before it.
    if not tuned_malloc:  # lgvit's create_model would tune it otherwise
        os.environ["LGVIT_DEFAULT_MALLOC"] = "1"
    if tuned_malloc:
        from lgvit.core.runtime import tune_cpu_allocator

        tune_cpu_allocator()
    module, fn = builder.split(":")
    build = getattr(importlib.import_module(module), fn)
    models: dict[str, nn.Module] = {}
    steps: dict[Key, Callable[[], None]] = {}
    calls: dict[Key, int] = {}
    # On the CPU: one call a round, timed here, so another checkout's measure (--baseline-src)
    # from before the device-aware timing still serves.
    on_cpu = torch.device(device).type == "cpu"
    conn.send(None)
    while True:
        msg = conn.recv()
        if msg[0] == "prepare":
            _, key, name, input_size, train, bf16 = msg
            torch.manual_seed(0)
            if name not in models:
                models[name] = build(name, *args).to(device)
            amp = torch.bfloat16 if bf16 else None
            # Only what differs from make_step's defaults: a --baseline-src checkout's may not
            # take these arguments.
            kw = {} if on_cpu else {"device": device}
            kw.update({} if fused else {"fused": False})
            steps[key] = measure.make_step(models[name], input_size, key[-1], train, amp, **kw)
            if on_cpu:
                steps[key]()
                calls[key] = 1
            else:
                _, calls[key] = measure.warm_up(steps[key], device)
            conn.send(None)
        elif msg[0] == "time":
            if on_cpu:
                t0 = time.perf_counter()
                steps[msg[1]]()
                conn.send(time.perf_counter() - t0)
            else:
                conn.send(measure.timed(steps[msg[1]], device, calls[msg[1]]))
        elif msg[0] == "params":
            if msg[1] not in models:
                models[msg[1]] = build(msg[1], *args)
            conn.send(sum(p.numel() for p in models[msg[1]].parameters()))
        else:
            on_gpu = not on_cpu and torch.cuda.is_available()
            conn.send(torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else peak_rss_gb())
            return


class ProcessRunner:
    """Builds models with ``builder`` ("module:function", called ``function(name, *args)``) in a
    spawned process with ``paths`` on its ``sys.path``, and times steps there.

    ``pythonpath``: the child's PYTHONPATH, ahead of everything (another lgvit checkout's
    ``src``, so the child imports that lgvit); ``tuned_malloc``: lgvit's allocator settings;
    ``device``: where the models run (on CUDA timed as ``measure.timed``, several calls a round);
    ``fused``: ``measure.make_step``'s (False: a plain script's AdamW, as the authors' run).
    """

    def __init__(
        self,
        builder: str,
        args: tuple = (),
        threads: int = 2,
        paths: Sequence[str] = (),
        pythonpath: str | None = None,
        tuned_malloc: bool = True,
        device: str = "cpu",
        fused: bool = True,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = ctx.Process(
            target=_worker,
            args=(
                child,
                builder,
                args,
                threads,
                [*([pythonpath] if pythonpath else []), here, *paths],
                tuned_malloc,
                str(device),
                fused,
            ),
            daemon=True,
        )
        saved = os.environ.get("PYTHONPATH")
        if pythonpath:  # spawn starts a fresh interpreter: it reads the variable at start-up
            os.environ["PYTHONPATH"] = pythonpath
        try:
            self.proc.start()
        finally:
            if pythonpath:
                if saved is None:
                    os.environ.pop("PYTHONPATH")
                else:
                    os.environ["PYTHONPATH"] = saved
        self.conn.recv()

    def params(self, name: str) -> int:
        self.conn.send(("params", name))
        return self.conn.recv()

    def prepare(self, key: Key, name: str, input_size: tuple, train: bool, bf16: bool) -> None:
        self.conn.send(("prepare", key, name, input_size, train, bf16))
        self.conn.recv()

    def time(self, key: Key) -> float:
        self.conn.send(("time", key))
        return self.conn.recv()

    def close(self) -> float:
        """Stops the process; its peak memory (GB): RSS, or on CUDA the most allocated."""
        self.conn.send(("stop",))
        rss = self.conn.recv()
        self.proc.join()
        return rss


def add_authors_malloc_flag(ap: Any) -> None:
    """``--authors-tuned-malloc`` on an argparse parser: ours runs with the allocator as
    ``create_model`` leaves it (tuned), the authors' code by default as their scripts run."""
    ap.add_argument(
        "--authors-tuned-malloc",
        action="store_true",
        help="give the authors' process lgvit's allocator tuning too (ours has it: create_model "
        "applies it; theirs runs by default as their scripts do)",
    )


def build_lgvit(name: str) -> nn.Module:
    import lgvit

    return lgvit.create_model(name)


def alternate(
    runners: dict[str, ProcessRunner], keys: Sequence[Key], rounds: int
) -> dict[Key, float]:
    """Median seconds per key; ``keys[i][0]`` names the runner. One run of every key a round."""
    times: dict[Key, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys:
            times[k].append(runners[k[0]].time(k))
        print(f"round {r + 1}/{rounds} done", flush=True)
    return {k: statistics.median(v) for k, v in times.items()}


def alternate_fns(
    fns: dict[str, Callable[[], Any]], rounds: int, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """In-process: median milliseconds per call of each function, timed once a round, round
    after round, after its warm-up (``measure.warm_up``: on the CPU one call and one call a
    round; on CUDA synchronised, until stable, several calls a round)."""
    from lgvit.tools.measure import timed, warm_up

    calls = {k: warm_up(f, device)[1] for k, f in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(timed(f, device, calls[k]))
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def results_table(medians: dict[Key, float]) -> list[dict[str, Any]]:
    rows = []
    print(f"\n{'impl':8s} {'model':22s} {'mode':5s} {'prec':4s} {'batch':>5s} {'img/s':>8s}")
    for (impl, model, mode, prec, batch), sec in medians.items():
        rows.append(
            dict(impl=impl, model=model, mode=mode, prec=prec, batch=batch, img_s=batch / sec)
        )
        print(f"{impl:8s} {model:22s} {mode:5s} {prec:4s} {batch:5d} {batch / sec:8.1f}")
    return rows
