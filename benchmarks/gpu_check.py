"""The GPU check: one command, at most 8 minutes on one H100 or H200, a JSON and a markdown report.

    PYTHONPATH=src python benchmarks/gpu_check.py --out OUT --cifar gpu_data/cifar10-jpeg.tar.gz \
        [--authors-lsa PATH/Locally-SAG-Transformer]
    PYTHONPATH=src python benchmarks/gpu_check.py --out /tmp/smoke --smoke     # CPU, tiny sizes

Parts (each in its own process, with its own time budget: a part that hangs, crashes the CUDA
context or runs out of time is recorded as such and the rest goes on; the reports are rewritten
after every part, so a check killed from outside still leaves the parts done). a, b and c only
check correctness and run at the same time, beside a process that compiles d's graphs into the
compiler's on-disk caches; d and e time things and run alone:

  a. every model family on CUDA against the CPU in IEEE fp32 (TF32 off) by the gradient rule of
     ``lgvit.tools.measure`` (the device tests' own), bf16 finite and close; then every
     registered model's bf16 training step at batch 256 (1024 at 32 px);
  b. the device tests, ``LGVIT_TEST_DEVICE=cuda pytest -m device`` in one pytest run (its
     xdist workers, where pytest-xdist is installed), the DDP and dense-task ones after;
  c. training through the engine in bf16 / fp16 / fp32 with fused AdamW, SGD, LAMB, EMA,
     accumulation, channels-last and the non-finite skip, in this process (the command's own
     function); ``torch.cuda.set_sync_debug_mode`` over the augmentation and the steps;
  d. ``lgvit bench`` in bf16: the batch sweep (``--batch-size auto``) eager, then compiled at
     batch 128, of lit_s, lsa_small_224 and deit_tiny, deit_small and swin_tiny beside timm's
     (same process, same steps, same drop path); lsa_tiny_cifar beside the LSA authors' model
     at batch 512 (``--authors-lsa``); the compiled logits against eager's; LIT's DTM kernels;
  e. the config cifar10_lsa_tiny_gpu_fast on CIFAR-10 (the JPEG tarball, ``--cifar``), stopped
     at 150 s of training; its model's step alone on synthetic data beside it.

The report's first table lists each goal (issue 56's first) with its figure and whether it holds.
Only the machine's own torch (and torchvision, timm, pytest, pytest-xdist, einops where
installed) is needed; a part whose package is missing is skipped with one line. ``--smoke``
runs every part at tiny sizes on the CPU (synthetic data, no CIFAR, the compiler's ``eager``
backend) so the check never rots.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_bench, gpu_report, bench_peers

# isort: off
# fmt: off
from gpu_bench import (AUTHORS_BATCH, BF16_LOGITS_TOL, OWN, PAIRS, SMOKE_MODEL,  # noqa: E402
                       authors_item, bench_item, bench_options, eager_compiler, timm_peer)
from gpu_decode import decode_item  # noqa: E402
from gpu_report import (CIFAR_SECONDS, GPU_BATCH, GPU_BATCH_32, SYNTHETIC_STEP,  # noqa: E402
                        goals, markdown)
# fmt: on
# isort: on

CIFAR_CONFIG = "cifar10_lsa_tiny_gpu_fast"  # e: trained as shipped, time limited
# (key, title, seconds on one H100): a group's parts run at the same time, a group as long as
# its longest part; the groups' budgets and the runner's start-up fit 8 minutes.
PARTS = (
    ("a", "IEEE fp32 against the CPU per family; every model's bf16 training step", 95),
    ("b", "the device tests on CUDA (LGVIT_TEST_DEVICE=cuda, one pytest run)", 95),
    ("c", "training: precisions, optimizers, EMA, accumulation, non-finite skip, host syncs", 60),
    ("d", "lgvit bench: batch sweep, eager and compiled, beside timm and the LSA authors'", 150),
    ("e", f"lsa_tiny_cifar on CIFAR-10: {CIFAR_CONFIG}, stopped at {CIFAR_SECONDS} s", 215),
)
GROUPS = ("abc", "d", "e")  # correctness side by side; timing alone
WARM_S = 70  # the compile-cache warm-up beside the first group (it ends before a's retries)
WARM_MEMORY = 0.25  # of the GPU's memory, at most, for the warm-up: a's big batches need it
TOTAL_S = 470  # the whole check, its own start-up included: under 8 minutes
SMOKE_PART_S = 240  # a part's limit with --smoke (a slow shared CPU; the test asks far less)

# a: one model per family; the agreement at a small batch, then every model at the GPU batch.
FAMILY_MODELS = (
    "lsa_tiny_cifar", "localvit_tiny", "lit_ti", "pvt_tiny", "swin_tiny", "deit_tiny",
    "t2t_vit_7", "tnt_tiny",
)  # fmt: skip
AGREE_BATCH = 4


# ----------------------------------------------------------------------------- part records


class Part:
    """What a part found, written (atomically) to its result file after every item, so a part
    stopped at its time limit still reports the items it finished."""

    def __init__(self, path: Path, args: argparse.Namespace, budget_s: float) -> None:
        self.path, self.args = path, args
        self.deadline = time.monotonic() + budget_s
        self.data: dict[str, Any] = {"items": [], "notes": []}

    @property
    def smoke(self) -> bool:
        return bool(self.args.smoke)

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def scratch(self, name: str) -> Path:
        """A folder for the part's runs, beside its result file: the runner removes it."""
        path = self.path.parent / name
        path.mkdir(exist_ok=True)
        return path

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def item(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one item; its failure is one line in the report, and the part goes on."""
        t0 = time.perf_counter()
        try:
            row = {"item": name, **fn()}
            row.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 -- recorded, the next item runs
            row = {"item": name, "ok": False, "error": one_line(e)}
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.data["items"].append(row)
        self.save()
        print(f"  {name}: {'ok' if row['ok'] else 'FAILED'} {row.get('error', '')}", flush=True)
        return row

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.data, indent=1, default=str))


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:400]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------- a. CUDA against the CPU, bf16


def part_a(p: Part) -> None:
    import torch

    if not p.smoke:
        torch.set_num_threads(4)  # the CPU's references, beside b, c and the warm-up
    families = FAMILY_MODELS[:3] if p.smoke else FAMILY_MODELS  # smoke: LSA, LocalViT, LIT
    p.data["families"] = len(families)
    for name in families:
        if p.left() < 3:
            p.note(f"out of time before {name}")
            return
        p.item(f"fp32 {name}", lambda name=name: _agreement(p, name))
    p.note(
        "fp32: IEEE (TF32 off) against the CPU, training mode without dropout or drop path, "
        "logits' relative error < measure.LOGITS_TOL and every gradient by measure.grad_errors "
        f"< measure.GRAD_TOL; bf16 finite, logits within {BF16_LOGITS_TOL} of the CPU's fp32"
    )
    _gpu_batch_steps(p)


def _agreement(p: Part, name: str) -> dict[str, Any]:
    """The family's model on the device against the CPU: fp32 logits and gradients by the rule
    the device tests use, bf16 finite and close."""
    import torch

    from lgvit.models import create_model, get_model_config
    from lgvit.tools.measure import (
        GRAD_TOL,
        LOGITS_TOL,
        ieee_fp32,
        relative_error,
        without_randomness,
        worst_grad_error,
    )  # fmt: skip

    size = get_model_config(name).smoke_input_size if p.smoke else None
    torch.manual_seed(0)
    cpu = create_model(name, **({"img_size": size[-1]} if size else {})).train()
    without_randomness(cpu)
    with torch.no_grad():  # off zero-initialised points (LIT's offsets: bilinear kinks)
        for w in cpu.parameters():
            w.add_(torch.randn_like(w), alpha=0.02)
    dev = copy.deepcopy(cpu).to(p.device)
    shape = size or get_model_config(name).input_size
    x = torch.randn(2 if p.smoke else AGREE_BATCH, *shape)
    y = torch.arange(x.shape[0]) % 10
    ref, ref_g = _logits_and_grads(cpu, x, y, None)
    with ieee_fp32():
        got, got_g = _logits_and_grads(dev, x.to(p.device), y.to(p.device), None)
    logits = relative_error(got, ref)
    grad, worst = worst_grad_error(got_g, ref_g)
    bf, bf_g = _logits_and_grads(dev, x.to(p.device), y.to(p.device), torch.bfloat16)
    finite = bool(torch.isfinite(bf).all()) and all(
        bool(torch.isfinite(g).all()) for g in bf_g.values()
    )
    bf_err = relative_error(bf.float(), ref)
    ok = logits < LOGITS_TOL and grad < GRAD_TOL and finite and bf_err < BF16_LOGITS_TOL
    return {
        "ok": ok, "input": shape[-1], "fp32_logits_rel_err": logits,
        "fp32_grad_worst_err": grad, "worst_grad": worst, "bf16_finite": finite,
        "bf16_logits_rel_err": bf_err,
    }  # fmt: skip


def _logits_and_grads(model: Any, x: Any, y: Any, amp: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(x.device.type, dtype=amp) if amp else contextlib.nullcontext()
    with ctx:
        out = model(x)
    F.cross_entropy(out.float(), y).backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None}
    return out.detach(), grads


def _gpu_batch_steps(p: Part) -> None:
    """Every registered model's bf16 training step (forward, backward, fused AdamW) at batch
    256 (1024 at 32 px). A model out of memory is tried again once the warm-up has given its
    memory back, then at halved batches: the largest that trains is recorded beside the miss."""
    import lgvit

    names = [SMOKE_MODEL, "deit_tiny"] if p.smoke else lgvit.list_models()
    p.data["models"] = len(names)
    missed = []
    for name in names:
        if p.left() < 3:
            p.note(f"bf16 steps: out of time before {name}")
            return
        row = p.item(f"bf16 step {name}", lambda name=name: _gpu_batch_step(p, name, once=True))
        if row.get("out_of_memory"):
            missed.append(name)
    if missed and p.args.warm_done:
        while not Path(p.args.warm_done).exists() and p.left() > 10:
            time.sleep(0.5)
    for name in missed:
        if p.left() < 5:
            p.note(f"bf16 steps: out of time before trying {name} again")
            return
        p.item(f"bf16 step {name}, again", lambda name=name: _gpu_batch_step(p, name, once=False))


def _gpu_batch_step(p: Part, name: str, once: bool) -> dict[str, Any]:
    import torch

    from lgvit.models import create_model, get_model_config
    from lgvit.tools.bench import is_out_of_memory
    from lgvit.tools.measure import make_step

    size = get_model_config(name).smoke_input_size if p.smoke else None
    shape = size or get_model_config(name).input_size
    target = 2 if p.smoke else GPU_BATCH_32 if shape[-1] == 32 else GPU_BATCH
    kw = {"img_size": size[-1]} if size else {}
    torch.manual_seed(0)
    try:
        with torch.device(p.device):  # initialised where it trains: seconds less a large model
            model = create_model(name, **kw)
    except Exception:  # noqa: BLE001 -- a model whose set-up wants the CPU: built there
        model = create_model(name, **kw).to(p.device)

    live = {"model": model}  # emptied after the tries: its memory goes back before the next

    def step_at(batch: int) -> None:
        step = make_step(live["model"], shape, batch, True, torch.bfloat16, device=p.device)
        try:
            step()
            sync(p.device)
        finally:
            del step
            live["model"].zero_grad(set_to_none=True)
            free(p.device)

    if p.cuda:
        torch.cuda.reset_peak_memory_stats()
    trains_at = largest_batch(step_at, target, target if once else min(8, target),
                              is_out_of_memory)  # fmt: skip
    live.clear()
    del model
    free(p.device)
    row: dict[str, Any] = {"input": shape[-1], "batch": target, "trains": trains_at == target}
    if p.cuda:
        row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    if trains_at != target:
        row.update(ok=False, out_of_memory=True, error=f"out of memory at batch {target}")
        if trains_at:
            row["trains_at"] = trains_at
    return row


def largest_batch(
    step_at: Callable[[int], None], target: int, smallest: int, oom: Callable[[Exception], bool]
) -> int | None:
    """``target`` if ``step_at(target)`` runs, else the largest of its halvings down to
    ``smallest`` that does (None: none does). Errors other than out-of-memory are raised."""
    batch = target
    while batch >= smallest:
        try:
            step_at(batch)
            return batch
        except Exception as e:
            if not oom(e):
                raise
        # Out of the handler: the failed step's frames (and tensors) are released now.
        free("cuda" if _cuda_ready() else "cpu")
        batch //= 2
    return None


def _cuda_ready() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


# ------------------------------------------------------------------------- b. the device tests

# The device tests in two selections: the slow ones (several processes, dense tasks) after.
TEST_SELECTIONS = (
    ("device and not (ddp or dense)", "the device tests"),
    ("device and (ddp or dense)", "the DDP and dense-task device tests"),
)
XDIST_WORKERS = 4  # a CUDA context each; beside a, c and the warm-up on 16 cores


def device_test_files() -> list[Path]:
    """The test files holding tests marked ``device`` (tests/conftest.py's marker)."""
    return sorted(
        f for f in (ROOT / "tests").glob("test_*.py") if "pytest.mark.device" in f.read_text()
    )


def part_b(p: Part) -> None:
    files = device_test_files()
    if not files:
        p.data["skipped"] = "no test in tests/ is marked device (tests/test_device.py absent?)"
        return
    if importlib.util.find_spec("pytest") is None:
        p.data["skipped"] = "pytest is not installed"
        return
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    if not p.smoke:
        env["LGVIT_TEST_DEVICE"] = "cuda"
    workers = XDIST_WORKERS if importlib.util.find_spec("xdist") and not p.smoke else 0
    if not workers and not p.smoke:
        p.note("pytest-xdist is not installed: the tests run one after another")
    # smoke: one collection of both (collecting imports the test modules: seconds a run)
    selections = [("device", "the device tests")] if p.smoke else TEST_SELECTIONS
    p.data["selections"] = len(selections)
    for i, (marker, words) in enumerate(selections):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
               *(str(f.relative_to(ROOT)) for f in files)]  # fmt: skip
        cmd += ["-n", str(workers)] if workers else ["-p", "no:xdist"]
        if p.smoke:  # the check's smoke test runs inside the suite: collect only
            cmd.append("--collect-only")
        reserve = 30 if i == 0 and not p.smoke else 3  # the slow ones' share of the time
        prefix = "" if p.smoke else "LGVIT_TEST_DEVICE=cuda "
        p.item(f"{words}: {prefix}pytest -m '{marker}'" + (f" -n {workers}" if workers else ""),
               lambda cmd=cmd, reserve=reserve: _pytest(p, cmd, env, reserve))  # fmt: skip


def _pytest(p: Part, cmd: list[str], env: dict[str, str], reserve: float) -> dict[str, Any]:
    rc, out = run_group(cmd, env, max(5.0, p.left() - reserve))
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out)}
    collected = re.findall(r"^\S+\.py: (\d+)$", out, re.M)  # -q --collect-only
    if collected:
        counts["collected"] = sum(int(n) for n in collected)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return {"ok": rc == 0, "rc": rc, **counts, "failed_tests": failed[:30],
            "tail": out[-1500:] if rc != 0 else ""}  # fmt: skip


def run_group(
    cmd: list[str], env: dict[str, str], timeout: float, own_group: bool = True
) -> tuple[int | str, str]:
    """``cmd``'s exit status (``"timeout"`` past ``timeout`` seconds) and its output. It runs in
    a process group of its own, killed whole at the limit (pytest with its xdist workers,
    lgvit train with its loader's workers)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=own_group)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL) if own_group else proc.kill()
        out, _ = proc.communicate()
        return "timeout", out


def _pythonpath() -> str:
    return os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


# ----------------------------------------------------------------------------- c. training


def _train(args: list[str], out: Path) -> dict[str, Any]:
    """``lgvit train`` in this process, as ``lgvit.cli.main`` runs it (its parser, then the
    command's function; one CUDA context for every run), returning the last epoch's metrics;
    a refusal or failure raises. Not ``main`` itself: it replaces ``warnings.showwarning`` for
    good, and the sync items record warnings."""
    from lgvit.cli import build_parser

    ns = build_parser().parse_args(["train", *args, "--out", str(out)])
    rc = ns.func(ns)
    if rc:
        raise RuntimeError(f"lgvit train returned {rc}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _train_args(p: Part, amp: str, *extra: str) -> list[str]:
    size = "16" if p.smoke else "32"
    return [
        "--model", SMOKE_MODEL, "--data", "synthetic", "--img-size", size,
        "--batch-size", "16" if p.smoke else "128", "--iters", "2" if p.smoke else "10",
        "--device", p.device, "--amp", amp, "--set", "log_every=1000",
        "--set", "warmup_epochs=0", *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def _sync_warnings(device: str, mode: str) -> Iterator[Counter]:
    """Host syncs reported by ``torch.cuda.set_sync_debug_mode(mode)`` inside the block, by
    the Python line that caused them (CUDA only: empty on the CPU)."""
    import torch

    found: Counter = Counter()
    cuda = device.startswith("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)
        try:
            yield found
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            found[f"{_short(w.filename)}:{w.lineno}"] += 1


def _short(filename: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(filename).resolve().relative_to(ROOT))
    return filename


def part_c(p: Part) -> None:
    import torch

    tmp = p.scratch("c")
    runs = [("bf16 fused AdamW", "bf16", ()), ("fp16 GradScaler fused AdamW", "fp16", ()),
            ("fp32 fused AdamW", "none", ()), ("bf16 SGD", "bf16", ("--set", "opt=sgd")),
            ("bf16 LAMB", "bf16", ("--set", "opt=lamb")),
            ("bf16 EMA", "bf16", ("--model-ema",)),
            ("bf16 accumulating 2 micro-batches", "bf16", ("--set", "grad_accum_steps=2")),
            ("bf16 channels-last", "bf16", ("--channels-last",))]  # fmt: skip
    for i, (name, amp, extra) in enumerate(runs):
        if amp == "fp16" and not p.device.startswith("cuda"):
            p.note(f"{name}: skipped, fp16 needs CUDA")
            continue

        def one(i: int = i, amp: str = amp, extra: tuple = extra) -> dict[str, Any]:
            m = _train(_train_args(p, amp, *extra), tmp / f"run{i}")
            return {"ok": math.isfinite(m["train_loss"]), "train_loss": m["train_loss"],
                    "test_acc1": m.get("test_acc1")}  # fmt: skip

        p.item(name, one)
    p.item("non-finite loss skipped (2 NaN losses, max_nonfinite=5)", lambda: _nonfinite(p, tmp))
    p.item("augmentation: no host sync (mode 'error')", lambda: _aug_syncs(p, "error"))
    p.item("augmentation: host syncs reported (mode 'warn')", lambda: _aug_syncs(p, "warn"))

    def steps() -> dict[str, Any]:
        with _sync_warnings(p.device, "warn") as found:
            m = _train(_train_args(p, "bf16", "--set", "eval_every=1000"), tmp / "sync")
        return {
            "ok": math.isfinite(m["train_loss"]),
            "syncs": dict(found),
            "note": "the whole run under 'warn': steps, the last evaluation and the save",
        }

    p.item("10 steps + augmentation: host syncs by line (mode 'warn')", steps)
    if not p.device.startswith("cuda"):
        p.note("set_sync_debug_mode is CUDA only: on the CPU the sync items only run the code")
    del torch


def _nonfinite(p: Part, tmp: Path) -> dict[str, Any]:
    """The classification loss made NaN at two steps: the run skips them and goes on."""
    from lgvit.tasks.classification.train import ClassificationTask

    real, calls = ClassificationTask.loss, {"n": 0}

    def loss(self: Any, *a: Any, **k: Any) -> Any:
        value, n = real(self, *a, **k)
        calls["n"] += 1
        return (value * float("nan"), n) if calls["n"] in (1, 2) else (value, n)

    ClassificationTask.loss = loss
    try:
        iters = "4" if p.smoke else "10"
        args = _train_args(p, "bf16", "--set", "max_nonfinite=5", "--iters", iters)
        m = _train(args, tmp / "nonfinite")
    finally:
        ClassificationTask.loss = real
    from safetensors.torch import load_file

    weights = load_file(str(tmp / "nonfinite" / "last.safetensors"))
    import torch

    finite = all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())
    ok = math.isfinite(m["train_loss"]) and finite
    return {"ok": ok, "train_loss": m["train_loss"], "weights_finite": finite}


def _aug_syncs(p: Part, mode: str) -> dict[str, Any]:
    """The DeiT recipe (crop, flip, RandAugment, erasing, mixup/cutmix) over 4 batches."""
    import torch

    from lgvit.data.loader import AugmentConfig, BatchLoader

    b = 8 if p.smoke else 128
    images = torch.randint(0, 256, (4 * b, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(4 * b) % 10
    loader = BatchLoader(images, labels, b, num_classes=10, train=True,
                         aug=AugmentConfig(img_size=32, reprob=0.25), device=p.device)  # fmt: skip
    loader.set_epoch(0)
    try:
        with _sync_warnings(p.device, mode) as found:
            for x, _ in loader:  # noqa: B007 -- the last batch's shape is reported
                pass
        sync(p.device)  # outside: an explicit synchronize is not what is looked for
    except RuntimeError as e:  # mode 'error': the first sync raises
        return {"ok": False, "error": one_line(e)}
    return {"ok": not found, "syncs": dict(found), "batch": list(x.shape)}


# ------------------------------------------------------------------------------- d. bench


def part_d(p: Part) -> None:
    if p.smoke:
        eager_compiler()
    names = [*PAIRS, *OWN]
    need = 5 if p.smoke else 25  # seconds an item needs at least: else it is left out
    # eager, the batch sweep: every model first (the compiled runs may not fit); smoke: a pair
    for name in ["deit_tiny"] if p.smoke else names:
        if p.left() < need:
            p.note(f"eager: out of time before {name}")
            break
        p.item(f"eager {name}", lambda name=name: bench_item(p.device, p.smoke, name, False))
    if p.args.authors_lsa:
        if p.left() >= need:
            p.item(f"lsa_tiny_cifar beside the LSA authors' model, batch {AUTHORS_BATCH}",
                   lambda: authors_item(p.device, p.smoke, p.args.authors_lsa))  # fmt: skip
    else:
        p.note("lsa_tiny_cifar beside the LSA authors' model: no --authors-lsa DIR given")
    for name in [SMOKE_MODEL] if p.smoke else names:  # compiled at one batch: the warm-up's
        if p.left() < need:
            p.note(f"compiled: out of time before {name}")
            break
        p.item(f"compiled {name}", lambda name=name: bench_item(p.device, p.smoke, name, True))
    if p.left() >= need:
        p.item("LIT DTM: each deformable kernel", lambda: _dtm_kernels(p))
    else:
        p.note("LIT DTM kernels: out of time")
    if p.left() >= need:  # issue 56's decode goal: beside lit_s's compiled rate above
        p.item("decode 224-px JPEGs", lambda: decode_item(p.device, p.smoke, p.scratch("jpeg")))
    else:
        p.note("decode 224-px JPEGs: out of time")


def _dtm_kernels(p: Part) -> dict[str, Any]:
    """lit_ti's bf16 training step with each deformable kernel the models offer."""
    import torch

    from lgvit.models import create_model, get_model_config
    from lgvit.models.layers import deform
    from lgvit.tools.measure import make_step

    size = get_model_config("lit_ti").smoke_input_size if p.smoke else None
    shape = size or get_model_config("lit_ti").input_size
    batch = 2 if p.smoke else 64
    choose = getattr(deform, "set_deform_impl", None)
    impls = [i for i in getattr(deform, "DEFORM_IMPLS", ()) if i != "auto"] if choose else []
    rows: dict[str, Any] = {}
    for impl in impls or ["default (no kernel choice in this version)"]:
        try:
            torch.manual_seed(0)
            model = create_model("lit_ti", **({"img_size": size[-1]} if size else {}))
            if impls:
                choose(model, impl)
            step = make_step(model.to(p.device), shape, batch, True, torch.bfloat16,
                             device=p.device)  # fmt: skip
            step()
            rows[impl] = round(batch / median_seconds(step, p.device, 1 if p.smoke else 5), 1)
        except Exception as e:  # noqa: BLE001 -- e.g. torchvision's kernel missing
            rows[impl] = one_line(e)
    ok = all(isinstance(v, float) for v in rows.values())
    return {"ok": ok, "lit_ti_train_img_s": rows, "batch": batch}


# -------------------------------------------------------------------------------- e. CIFAR


def part_e(p: Part) -> None:
    if not p.smoke and not p.args.cifar:
        p.data["skipped"] = "no --cifar tarball given (cifar10-jpeg.tar.gz)"
        return
    if not p.smoke and not Path(p.args.cifar).exists():
        p.data["skipped"] = f"--cifar {p.args.cifar}: no such file"
        return
    out = p.scratch("e")
    p.item(SYNTHETIC_STEP, lambda: _step_rate(p))  # the rate the epochs are held to
    data = (["--data", "synthetic", "--iters", "3", "--batch-size", "16", "--model",
             SMOKE_MODEL] if p.smoke else
            ["--data", "imagefolder", "--data-dir", str(Path(p.args.cifar).resolve())])  # fmt: skip
    # The config as shipped, stopped by the trainer's own limit at the goal's seconds.
    cmd = [sys.executable, "-m", "lgvit", "train", "--config", CIFAR_CONFIG, *data, "--device",
           p.device, "--amp", "bf16", "--out", str(out), "--set",
           f"time_limit_min={CIFAR_SECONDS / 60}"]  # fmt: skip

    def run() -> dict[str, Any]:
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        rc, tail = run_group(cmd, env, max(5.0, p.left() - 5))
        tail = tail[-1500:]
        path = out / "metrics.jsonl"
        epochs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        keep = ("epoch", "img_per_s", "train_size", "train_loss", "test_acc1", "epoch_time_s")
        rows = [{k: m.get(k) for k in keep} for m in epochs]
        return {"ok": rc == 0 and bool(rows), "rc": rc, "epochs": rows,
                "final_top1": rows[-1].get("test_acc1") if rows else None,
                "train_s": round(sum(r["epoch_time_s"] or 0 for r in rows), 1),
                "tail": tail if rc != 0 else ""}  # fmt: skip

    p.item("lgvit train " + " ".join(cmd[4:]), run)


def _step_rate(p: Part) -> dict[str, Any]:
    """The config's model alone: a bf16 training step (forward, backward, fused AdamW) at its
    batch and full size on synthetic data, the rate its CIFAR-10 epochs are held to."""
    import torch

    from lgvit.models import create_model
    from lgvit.run.config import load_config
    from lgvit.tools.measure import make_step

    cfg = load_config(CIFAR_CONFIG)
    batch = 16 if p.smoke else cfg.batch_size
    model = create_model(SMOKE_MODEL if p.smoke else cfg.model, drop_path_rate=cfg.drop_path)
    step = make_step(model.to(p.device), (3, 32, 32), batch, True, torch.bfloat16,
                     device=p.device)  # fmt: skip
    for _ in range(1 if p.smoke else 3):
        step()
    sec = median_seconds(step, p.device, 1 if p.smoke else 5)
    del model, step
    torch.cuda.empty_cache()
    return {"step_s": round(sec, 4), "batch": batch, "img_s": round(batch / sec, 1)}


def median_seconds(fn: Callable[[], Any], device: str, reps: int) -> float:
    import statistics

    from lgvit.tools.measure import timed

    return statistics.median(timed(fn, device) for _ in range(reps))


# ---------------------------------------------------------------- w. the compile-cache warm-up


def part_w(p: Part) -> None:
    """d's compiled steps, compiled beside a, b and c into the compiler's on-disk caches (the
    runner gives both processes one cache folder): d then loads most graphs instead of
    compiling them. Within a quarter of the GPU's memory, so that a's large batches fit beside
    it; a model that does not fit is compiled by d itself."""
    import torch

    if p.cuda:
        torch.cuda.set_per_process_memory_fraction(WARM_MEMORY)
    if p.smoke:
        eager_compiler()
    from lgvit.tools.bench import run_bench

    for name in [SMOKE_MODEL] if p.smoke else [*PAIRS, *OWN]:
        if p.left() < 5:
            p.note(f"out of time before {name}")
            return

        def warm(name: str = name) -> dict[str, Any]:
            opts = bench_options(p.device, p.smoke, True, name)
            opts.rounds, opts.busy = 1, False
            extra = [timm_peer(name, opts.img_size)[0]] if name in PAIRS and \
                importlib.util.find_spec("timm") else []  # fmt: skip
            rows = run_bench([name], opts, log=print, extra=extra)["rows"]
            keep = ("model", "infer_compile_s", "train_compile_s", "error")
            return {"rows": [{k: r.get(k) for k in keep} for r in rows]}

        p.item(f"compiled {name}", warm)


PART_FUNCS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "w": part_w}
TITLES = {k: t for k, t, _ in PARTS} | {"w": "the compile-cache warm-up for d"}
BUDGETS = {k: b for k, _, b in PARTS} | {"w": WARM_S}


# ------------------------------------------------------------------------------- the runner


def run_part(args: argparse.Namespace) -> int:
    """The child: one part, its result file rewritten after every item."""
    import torch

    if args.smoke:
        torch.set_num_threads(1)
    part = Part(Path(args.result), args, args.budget)
    part.save()
    PART_FUNCS[args.part](part)
    part.save()
    return 0


class Run:
    """A part's process, started: its limit, result file and output file."""

    def __init__(self, key: str, limit: float, folder: Path) -> None:
        self.key, self.limit, self.folder = key, limit, folder
        self.result, self.output = folder / "result.json", folder / "output.txt"
        self.proc: subprocess.Popen | None = None
        self.t0 = self.t1 = time.monotonic()
        self.rc: int | str | None = None


def check(args: argparse.Namespace) -> int:
    """The parent: the parts group by group (a group's parts side by side), the reports
    written after each group."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report: dict[str, Any] = {"command": " ".join(sys.argv), "smoke": bool(args.smoke),
                              "device": args.device, "machine": _machine(args.device),
                              "parts": {}}  # fmt: skip
    log = out / "log.txt"
    log.write_text("")
    wanted = args.parts or "".join(k for k, _, _ in PARTS)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        env = _child_env(Path(tmp))
        for group in GROUPS:
            keys = [k for k in group if k in wanted]
            if not keys:
                continue
            left = TOTAL_S - (time.monotonic() - start)
            warm = "a" in keys and "d" in wanted  # d's graphs compiled beside a, b and c
            done = Path(tmp) / "warm.done" if warm else None  # part a waits for it to retry
            runs = []
            for key in keys:
                limit = SMOKE_PART_S if args.smoke else min(BUDGETS[key], left)
                report["parts"][key] = {"title": TITLES[key], "budget_s": BUDGETS[key]}
                if not args.smoke and limit < 5:
                    report["parts"][key].update(
                        status="skipped", reason="the whole check's time is spent"
                    )
                    continue
                runs.append(_start(args, key, limit, Path(tmp), env, done))
            if warm and runs:
                limit = SMOKE_PART_S if args.smoke else min(WARM_S, left)
                runs.append(_start(args, "w", limit, Path(tmp), env, None))
            _wait(runs, Path(tmp) / "warm.done")
            for run in runs:
                entry = {"started_s": round(run.t0 - start, 1), **_finish(run, log)}
                if run.key == "w":
                    report["warm"] = {"title": TITLES["w"], "budget_s": WARM_S, **entry}
                else:
                    report["parts"][run.key].update(entry)
                print(f"part {run.key} ({TITLES[run.key]}): {entry['status']} "
                      f"{entry.get('reason', '')}", flush=True)  # fmt: skip
            report["elapsed_s"] = round(time.monotonic() - start, 1)
            report["goals"] = goals(report)
            write_atomic(out / "report.json", json.dumps(report, indent=1, default=str))
            write_atomic(out / "report.md", markdown(report))
    print(f"wrote {out / 'report.json'} and {out / 'report.md'}")
    return 0


def _child_env(tmp: Path) -> dict[str, str]:
    """The parts' environment: lgvit from this checkout; the compiler's caches in one folder
    of this check's own (the warm-up fills what d reads; a later check starts cold again), with
    the same compile threads in both, since the caches' keys may hold them."""
    return {
        **os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "TRITON_CACHE_DIR": str(tmp / "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "8",
    }  # fmt: skip


def _start(
    args: argparse.Namespace, key: str, limit: float, tmp: Path, env: dict, done: Path | None
) -> Run:
    run = Run(key, limit, tmp / f"part_{key}")
    run.folder.mkdir()
    cmd = [sys.executable, __file__, "--_part", key, "--_result", str(run.result),
           "--_budget", str(limit - 5), "--device", args.device]  # fmt: skip
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--cifar", args.cifar] if args.cifar else []
    cmd += ["--authors-lsa", args.authors_lsa] if args.authors_lsa else []
    cmd += ["--_warm_done", str(done)] if key == "a" and done else []
    with open(run.output, "w") as f:  # a file, not a pipe: several parts write at once
        run.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)  # fmt: skip
    return run


def _wait(runs: list[Run], warm_done: Path) -> None:
    """Until every run has ended, each killed (its whole process group) past its limit; the
    warm-up's end is marked in ``warm_done`` as it happens (part a waits for its memory)."""
    pending = list(runs)
    while pending:
        for run in list(pending):
            rc = run.proc.poll()
            if rc is None and time.monotonic() - run.t0 > run.limit:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait()
                rc = "timeout"
            if rc is not None:
                run.rc, run.t1 = rc, time.monotonic()
                pending.remove(run)
                if run.key == "w":
                    warm_done.touch()
        time.sleep(0.2)


def _finish(run: Run, log: Path) -> dict[str, Any]:
    text = run.output.read_text(errors="replace")
    with open(log, "a") as f:
        f.write(f"===== part {run.key} (rc {run.rc})\n{text}\n")
    data = json.loads(run.result.read_text()) if run.result.exists() else {"items": [], "notes": []}
    entry = {**data, "seconds": round(run.t1 - run.t0, 1)}
    if data.get("skipped"):
        entry.update(status="skipped", reason=data.pop("skipped"))
    elif run.rc == "timeout":
        entry.update(status="timeout", reason=f"stopped at its {run.limit:.0f} s limit")
    elif run.rc != 0:
        last = [x for x in text.strip().splitlines() if x.strip()][-1:] or [f"exit status {run.rc}"]
        entry.update(status="failed", reason=last[0][:300])
    elif not all(i.get("ok") for i in data["items"]):
        entry.update(status="failed", reason="; ".join(
            i["item"] for i in data["items"] if not i.get("ok")))  # fmt: skip
    else:
        entry["status"] = "ok"
    return entry


def _machine(device: str) -> str:
    from lgvit.tools.measure import describe_machine

    return describe_machine(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for report.json, report.md and log.txt")
    ap.add_argument("--cifar", help="e: the CIFAR-10 JPEG tarball (cifar10-jpeg.tar.gz)")
    ap.add_argument(
        "--authors-lsa",
        metavar="DIR",
        help="d: a checkout of the LSA authors' "
        "code (github.com/shellysheynin/Locally-SAG-Transformer; needs einops)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, no CIFAR")
    ap.add_argument("--device", help="default: cuda (cpu with --smoke)")
    ap.add_argument("--parts", help="a subset of the parts, e.g. 'ad' (default: all)")
    ap.add_argument("--_part", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--_budget", dest="budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--_warm_done", dest="warm_done", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.part, args.result = args._part, args._result
    if args.part:
        return run_part(args)
    if not args.out:
        ap.error("--out DIR is required")
    keys = "".join(k for k, _, _ in PARTS)
    if args.parts and set(args.parts) - set(keys):
        ap.error(f"--parts {args.parts!r}: choose from {keys}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: CUDA is not available here; use --smoke on a CPU", file=sys.stderr)
            return 2
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
