"""The process: distributed set-up and seeding, the CPU allocator, and the precision a device
runs fast. Shared by training, evaluation and benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import os
import re
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lgvit.core.errors import LgvitError, first_line

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_cpu_allocator() -> bool:
    """Keep freed large blocks in glibc's heap instead of returning them to the kernel.

    glibc serves every allocation above its mmap threshold (a few MB) with a fresh ``mmap``
    and unmaps it on free, so each large activation tensor (the T-variant tensor of
    lsa_tiny_cifar is 450 MB at batch 64) is page-faulted and zeroed by the kernel on first
    touch: measured here, a bf16 add over such a tensor took 182 ms with fresh pages and 33 ms
    with reused ones. Raising the mmap and trim thresholds makes ``free`` keep the memory for
    the next step, as jemalloc/tcmalloc would. Called by the ``lgvit`` command line and the
    benchmarks; a library user can call it too. Set ``LGVIT_DEFAULT_MALLOC=1`` to skip it.
    Returns True when the setting was applied (Linux with glibc).
    """
    global _done
    if _done:
        return True
    if os.environ.get("LGVIT_DEFAULT_MALLOC") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31)
    except (OSError, AttributeError):
        return False
    _done = bool(ok)
    return _done


# --------------------------------------------------------------------------------- precision

# CPU flags (Linux /proc/cpuinfo) under which bf16 matmuls run in hardware, best first.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512, Arm (BF16)


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` text (its ``flags`` line on x86,
    ``Features`` on Arm); None when the text has neither."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return None


def native_bf16(flags: set[str]) -> str | None:
    """The first of :data:`NATIVE_BF16_FLAGS` among ``flags``, or None."""
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


@functools.cache
def cpu_bf16_support() -> str | None:
    """The CPU feature that runs bf16 natively (``'amx_bf16'``, ``'avx512_bf16'``, Arm's
    ``'bf16'``), or None: bf16 is emulated there, and slower than fp32.

    Read from the CPU's flags, not from oneDNN, which also says yes on AVX-512 CPUs without
    bf16 instructions (emulated). Where the flags cannot be read (not Linux), oneDNN's answer.
    """
    text = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            text = f.read()
    flags = cpu_flags(text)
    if flags is not None:
        return native_bf16(flags)
    try:
        return "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    except (AttributeError, RuntimeError):
        return None


def cpu_supports_bf16() -> bool:
    """The CPU runs bf16 matmuls in hardware (AMX, AVX512-BF16, Arm BF16)."""
    return cpu_bf16_support() is not None


def bf16_matmul_slowdown(n: int = 512, repeats: int = 3) -> float:
    """How many times slower an ``n x n`` bf16 matmul runs than fp32 on this CPU (measured)."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(a.bfloat16(), b.bfloat16()) / best(a, b)


def warn_if_bf16_emulated(device: torch.device) -> None:
    """One warning line when bf16 is asked for on a CPU that emulates it, with the slowdown
    measured here (lsa_tiny_cifar ran 4x slower inference and 14x slower training steps under
    emulated bf16 autocast than in fp32 on an AVX2-only AMD EPYC)."""
    if device.type != "cpu" or cpu_supports_bf16():
        return
    slow = bf16_matmul_slowdown()
    warnings.warn(
        "bf16 is emulated on this CPU (no amx_bf16 / avx512_bf16 / bf16 flag): a 512x512 "
        f"matmul measured {slow:.1f}x slower in bf16 than in fp32 here; --amp auto (fp32 on "
        "this CPU) is faster",
        stacklevel=3,
    )


# The precisions every --amp flag and the config's ``amp`` take (resolve_amp reads them).
AMP_MODES = ("auto", "bf16", "fp16", "none")
# The torch.compile modes `lgvit bench --compile` and `lgvit train --compile` (the config's
# ``compile``) take; reduce-overhead runs CUDA graphs (on CUDA only).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """'auto' -> bf16 where the hardware runs it fast, else full precision; an explicit bf16
    on a CPU that emulates it runs, with one warning line saying so. A name outside
    ``AMP_MODES`` is refused (it would otherwise run as auto)."""
    if amp not in AMP_MODES:
        raise LgvitError(f"--amp {amp!r}: must be one of {', '.join(AMP_MODES)}")
    if amp == "none":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise LgvitError("--amp fp16 needs a CUDA GPU; use --amp bf16 or none on the CPU")
        return torch.float16
    if amp == "bf16":
        warn_if_bf16_emulated(device)
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else None


def precision_name(dtype: torch.dtype | None) -> str:
    """What ran, in words for a result line: ``fp32``, ``bf16 autocast`` or ``fp16 autocast``."""
    if dtype is None:
        return "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype)) + " autocast"


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``'s type; nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# --------------------------------------------------------------------------------- numerics

# cuBLAS's setting for deterministic results (CUDA's documentation; torch asks for it).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_saved_numerics: dict[str, object] | None = None


def _numerics_now() -> dict[str, object]:
    try:
        precision: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through torch's newer per-backend API: not ours to read back
        precision = None
    return {
        "precision": precision,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def set_numerics(device: torch.device, tf32: bool, deterministic: bool) -> None:
    """The run's numerics, set once at its start (:func:`restore_numerics` undoes them).

    On CUDA, ``tf32``: fp32 matmuls and convolutions run in TF32 (``'high'`` matmul precision,
    as timm's train.py); off, in IEEE fp32. ``deterministic``: torch's deterministic algorithms
    (an op without one warns once rather than stopping the run), cuDNN without autotuning and
    cuBLAS's fixed workspace (set before the run's first matmul); off, cuDNN autotunes (timm's
    choice). On the CPU only the deterministic-algorithm switch applies: TF32 is a GPU format.
    """
    global _saved_numerics
    if _saved_numerics is None:
        _saved_numerics = _numerics_now()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = not deterministic
        torch.backends.cudnn.deterministic = deterministic
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


def restore_numerics() -> None:
    """The settings from before the first :func:`set_numerics` (a run inside a longer process
    leaves it as it found it)."""
    global _saved_numerics
    saved, _saved_numerics = _saved_numerics, None
    if saved is None:
        return
    if saved["precision"] is not None:
        torch.set_float32_matmul_precision(str(saved["precision"]))
    torch.backends.cudnn.allow_tf32 = bool(saved["cudnn_tf32"])
    torch.backends.cudnn.benchmark = bool(saved["benchmark"])
    torch.backends.cudnn.deterministic = bool(saved["cudnn_deterministic"])
    torch.use_deterministic_algorithms(
        bool(saved["deterministic"]), warn_only=bool(saved["warn_only"])
    )
    if saved["cublas"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = str(saved["cublas"])


# --------------------------------------------------------------------------------- processes


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def _int_var(name: str, value: str, who: str = "torchrun sets it") -> int:
    try:
        return int(value)
    except ValueError:
        raise LgvitError(f"{name}={value!r}: expected an integer ({who})") from None


def _env_int(name: str, default: int) -> int:
    return _int_var(name, os.environ.get(name, str(default)))


def check_ranks(
    rank: tuple[str, int],
    world: tuple[str, int],
    local: tuple[str, int] | None = None,
    local_world: tuple[str, int] | None = None,
) -> None:
    """A process's place in the run, each a (variable, value): a world of at least one process,
    a rank inside it, a local rank inside the machine's processes where their count is known.
    Outside, the rendezvous would wait forever for ranks that cannot come: one line now."""
    (rn, r), (wn, w) = rank, world
    if w < 1:
        raise LgvitError(f"{wn}={w}: a run needs at least 1 process")
    if not 0 <= r < w:
        raise LgvitError(f"{rn}={r} with {wn}={w}: the rank must be 0 to {w - 1}")
    if local is not None:
        (ln, lr) = local
        if lr < 0 or (local_world is not None and lr >= local_world[1]):
            bound = f" with {local_world[0]}={local_world[1]}" if local_world else ""
            top = f" to {local_world[1] - 1}" if local_world else " or more"
            raise LgvitError(f"{ln}={lr}{bound}: the local rank must be 0{top}")


def check_local_rank(local: int, local_world: int) -> None:
    """One GPU per process: a process whose LOCAL_RANK has no CUDA device of its own is refused
    (torchrun --nproc_per_node 2 on a one-GPU machine would ask for ``cuda:1``). Every process
    of the machine checks the machine's highest local rank, so all of them stop with the same
    line at once instead of the others waiting for the missing one."""
    count = torch.cuda.device_count()
    highest = max(local, local_world - 1)
    if highest >= count:
        devices = f"{count} CUDA device" + ("" if count == 1 else "s")
        raise LgvitError(
            f"LOCAL_RANK {highest} but this machine has {devices}: start at most {count} "
            f"process(es) per machine (torchrun --nproc_per_node {count}), one per GPU, "
            "or use --device cpu"
        )


# SLURM launches (srun) without torchrun: the rendezvous port on the job's first host, unless
# MASTER_PORT is set. Offset by the job id, so two jobs sharing a first node do not collide.
SLURM_PORT_BASE = 29500
_TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``gpu[07-09,12],cpu3`` -> ``gpu07``), as ``scontrol
    show hostnames`` would print first, without needing scontrol."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level item
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    # each bracket group: its first range's first value (zero padding kept)
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], item)
    if not host or "[" in host or "]" in host:
        raise LgvitError(f"SLURM_NODELIST={nodelist!r}: not a SLURM node list")
    return host


def slurm_environment(env: dict[str, str]) -> dict[str, str]:
    """torchrun's variables for a process ``srun`` started (``SLURM_PROCID``, ``SLURM_NTASKS``,
    ``SLURM_LOCALID``, ``SLURM_NODELIST``), when no torchrun variable is set; empty otherwise
    (a single task, or torchrun started by srun: torchrun's own variables win)."""
    if "SLURM_PROCID" not in env or any(k in env for k in _TORCHRUN_VARS):
        return {}
    count = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    tasks = env.get(count) or "1"
    world = _int_var(count, tasks, "srun sets it")
    if world == 1:
        return {}
    rank = ("SLURM_PROCID", _int_var("SLURM_PROCID", env["SLURM_PROCID"], "srun sets it"))
    check_ranks(rank, (count, world))  # before the others: SLURM_NTASKS=0 is the fault
    missing = [k for k in ("SLURM_LOCALID", "SLURM_NODELIST") if k not in env]
    if missing:
        raise LgvitError(f"SLURM_PROCID is set but {', '.join(missing)} is not: launch each "
                         "process with srun, or use torchrun")  # fmt: skip
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    check_ranks(
        rank, (count, world),
        ("SLURM_LOCALID", _int_var("SLURM_LOCALID", env["SLURM_LOCALID"], "srun sets it")),
        ("SLURM_NTASKS_PER_NODE", int(per_node)) if per_node.isdigit() else None,
    )  # fmt: skip
    job = env.get("SLURM_JOB_ID", "0")
    port = env.get("MASTER_PORT") or str(SLURM_PORT_BASE + int(job) % 1000 if job.isdigit()
                                         else SLURM_PORT_BASE)  # fmt: skip
    out = {
        "RANK": env["SLURM_PROCID"], "WORLD_SIZE": tasks, "LOCAL_RANK": env["SLURM_LOCALID"],
        "MASTER_ADDR": first_host(env["SLURM_NODELIST"]), "MASTER_PORT": port,
    }  # fmt: skip
    if "SLURM_NTASKS_PER_NODE" in env and env["SLURM_NTASKS_PER_NODE"].isdigit():
        out["LOCAL_WORLD_SIZE"] = env["SLURM_NTASKS_PER_NODE"]
    return out


def setup_distributed(device_name: str = "auto") -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: gloo on CPU, nccl on CUDA; a process srun
    started without torchrun takes them from SLURM's (:func:`slurm_environment`).
    ``device_name``: ``auto`` (CUDA when there is one), ``cpu`` or ``cuda`` (each process its
    local GPU)."""
    os.environ.update(slurm_environment(dict(os.environ)))
    world = _env_int("WORLD_SIZE", 1)
    local = _env_int("LOCAL_RANK", 0)
    if "WORLD_SIZE" in os.environ:
        known = "LOCAL_WORLD_SIZE" in os.environ
        local_world = ("LOCAL_WORLD_SIZE", _env_int("LOCAL_WORLD_SIZE", 1)) if known else None
        check_ranks(("RANK", _env_int("RANK", 0)), ("WORLD_SIZE", world), ("LOCAL_RANK", local),
                    local_world)  # fmt: skip
    use_cuda = torch.cuda.is_available() if device_name == "auto" else device_name == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise LgvitError("--device cuda: no CUDA device is available here (use --device cpu)")
    if use_cuda:
        check_local_rank(local, _env_int("LOCAL_WORLD_SIZE", local + 1))
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts it
            dist.init_process_group(backend)
        else:
            rank = _env_int("RANK", 0)
            store = rendezvous(rank, world, *_master(), rendezvous_timeout())
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    rank = dist.get_rank() if world > 1 else 0
    return Dist(rank, world, local, device)


# How long the processes of a run started without torchrun's agent (srun, or RANK/WORLD_SIZE
# set by hand) wait for each other: torch's own default for a process group (30 minutes).
RENDEZVOUS_TIMEOUT_VAR = "LGVIT_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_TIMEOUT_S = 1800.0


def rendezvous_timeout() -> float:
    """Seconds to wait for every process to join (``LGVIT_RENDEZVOUS_TIMEOUT``, else 1800)."""
    text = os.environ.get(RENDEZVOUS_TIMEOUT_VAR, "").strip()
    if not text:
        return RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise LgvitError(f"{RENDEZVOUS_TIMEOUT_VAR}={text!r}: expected seconds, a number above 0")
    return value


_JOINED = "lgvit/joined/{}"  # each rank's key in the store, once it reached it
_ALL_JOINED = "lgvit/all_joined"  # rank 0's, once every rank did


def rendezvous(rank: int, world: int, addr: str, port: int, timeout: float) -> dist.Store:
    """The store the ``world`` processes meet at (``addr:port``, hosted by rank 0), once all
    have joined. A process still waiting after a few seconds says once what it waits for;
    after ``timeout`` seconds it stops with one line: rank 0 names the ranks that never came,
    another rank the host it could not reach (torch's own rendezvous waits in silence, then
    times out with a traceback 30 minutes later)."""
    where = f"{addr}:{port}"
    said = (f"lgvit: rank {rank}: waiting for the other processes at {where} (world size "
            f"{world}); stops after {timeout:g} s ({RENDEZVOUS_TIMEOUT_VAR})")  # fmt: skip
    notice = threading.Timer(min(5.0, timeout / 4), print, (said,), {"file": sys.stderr})
    notice.daemon = True
    notice.start()
    try:
        store = _join(rank, world, addr, port, timeout)
    finally:
        notice.cancel()
    store.set_timeout(default_pg_timeout)  # the store serves the process group from here on
    return store


def _join(rank: int, world: int, addr: str, port: int, timeout: float) -> dist.Store:
    where, deadline = f"{addr}:{port}", time.monotonic() + timeout
    wait = datetime.timedelta(seconds=timeout)
    if rank != 0 and not _reachable(addr, port, deadline):  # torch's client would time out
        raise LgvitError(  # with a C++ stack trace on stderr: waited for here instead
            f"rank {rank} of {world}: no rendezvous at {where} after {timeout:g} s: rank 0 "
            "hosts it and did not start (or MASTER_ADDR / MASTER_PORT differ between the "
            f"processes); start all {world} processes, {RENDEZVOUS_TIMEOUT_VAR} sets the wait"
        )
    try:
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=wait,
                              wait_for_workers=False)  # fmt: skip
    except RuntimeError as e:  # torch's DistNetworkError: a port taken, a host gone
        what = "cannot host" if rank == 0 else f"of {world} cannot join"
        hint = " (another run on MASTER_PORT? set another)" if rank == 0 else ""
        raise LgvitError(f"rank {rank} {what} the rendezvous at {where}: "
                         f"{first_line(e)}{hint}") from None  # fmt: skip
    store.set(_JOINED.format(rank), "1")
    if rank != 0:
        try:  # rank 0 says when all came, or stops (naming who did not): a little longer
            store.wait([_ALL_JOINED], datetime.timedelta(seconds=timeout + 10))
        except RuntimeError as e:
            raise LgvitError(f"rank {rank} of {world}: rank 0 at {where} stopped before every "
                             f"process joined ({first_line(e)})") from None  # fmt: skip
        return store
    keys = [_JOINED.format(r) for r in range(world)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([keys[r]])]
            named = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise LgvitError(
                f"rendezvous at {where}: after {timeout:g} s, {world - len(missing)} of {world} "
                f"processes joined; rank(s) {named} did not: start all {world} (srun --ntasks "
                f"{world}, or torchrun), or raise {RENDEZVOUS_TIMEOUT_VAR}"
            )
        time.sleep(0.05)
    store.set(_ALL_JOINED, "1")
    return store


def _reachable(addr: str, port: int, deadline: float) -> bool:
    """Something listens at ``addr:port`` before ``deadline`` (``time.monotonic``)."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return True
        except OSError:  # refused, unreachable, a name not resolved yet: try again
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def _master() -> tuple[str, int]:
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise LgvitError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: start the processes with "
            "torchrun (or srun), or set MASTER_ADDR and MASTER_PORT to rank 0's host and a port"
        )
    port = _int_var("MASTER_PORT", os.environ["MASTER_PORT"], "a TCP port")
    if not 0 < port < 65536:
        raise LgvitError(f"MASTER_PORT={port}: not a TCP port (1 to 65535)")
    return os.environ["MASTER_ADDR"], port


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world_size > 1:
        dist.all_reduce(t)
    return t


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
