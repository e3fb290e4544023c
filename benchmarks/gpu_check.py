"""The GPU check: one command, at most 8 minutes on one H100, a JSON and a markdown report.

    PYTHONPATH=src python benchmarks/gpu_check.py --out OUT --cifar gpu_data/cifar10-jpeg.tar.gz
    PYTHONPATH=src python benchmarks/gpu_check.py --out /tmp/smoke --smoke     # CPU, tiny sizes

Parts (each in its own process, with its own time budget: a part that hangs, crashes the CUDA
context or runs out of time is recorded as such and the next part runs; the reports are
rewritten after every part, so a check killed from outside still leaves the parts done):

  a. CUDA against CPU per model family: fp32 logits and gradients, bf16 finite and close;
  b. the CUDA test subset: ``LGVIT_TEST_DEVICE=cuda pytest -m device`` over the test files that
     hold such tests (tests/test_device.py and any other);
  c. training through the engine in bf16 / fp16 / fp32 with fused AdamW, SGD, LAMB, EMA and the
     non-finite skip; ``torch.cuda.set_sync_debug_mode`` over the augmentation and 20 steps;
  d. ``lgvit bench`` on CUDA, bf16, eager and compiled, beside the papers' GPU throughputs and
     timm's own model in the same process; LIT's DTM with each deformable kernel;
  e. lsa_tiny_cifar trained on CIFAR-10 (the JPEG tarball, ``--cifar``) for ~2.5 minutes;
  f. compile time, compiled/eager speed and equality of LSA and LIT.

Only the machine's own torch (and torchvision, timm, pytest where installed) is needed; a part
whose package is missing is skipped with one line. ``--smoke`` runs every part at tiny sizes on
the CPU (synthetic data, no CIFAR, the compiler's ``eager`` backend) so the check never rots.
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
import statistics
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_peers, beside this file

# (key, title, seconds on one H100): the budgets sum to under 8 minutes with the start-up.
PARTS = (
    ("a", "CUDA against CPU per model family", 35),
    ("b", "the CUDA test subset (LGVIT_TEST_DEVICE=cuda)", 45),
    ("c", "training: precisions, optimizers, EMA, non-finite skip, host syncs", 45),
    ("d", "lgvit bench on CUDA (bf16, eager and compiled) beside papers and timm", 85),
    ("e", "lsa_tiny_cifar on CIFAR-10 for ~2.5 minutes", 215),
    ("f", "compile time, compiled/eager speed and equality of LSA and LIT", 45),
)
TOTAL_S = 470  # the whole check, its own start-up included: under 8 minutes
SMOKE_PART_S = 120  # a part's limit with --smoke (a slow shared CPU; the test asks far less)

# a: one model per family (smoke: the same families at their smoke_input_size).
FAMILY_MODELS = (
    "lsa_tiny_cifar", "localvit_tiny", "lit_ti", "pvt_tiny", "swin_tiny", "deit_tiny",
    "t2t_vit_7", "tnt_tiny",
)  # fmt: skip
# d: the issue's list, the goals' models first (the compiled pass stops when time runs out).
BENCH_MODELS = (
    "lsa_tiny_cifar", "lsa_small_224", "lit_s", "lsa_small_cifar", "lsa_tiny_224", "lit_ti",
    "localvit_tiny", "deit_tiny", "swin_tiny",
)  # fmt: skip
SMOKE_MODEL = "lsa_micro_cifar"  # the smallest model: smoke runs of b-f
CIFAR_MINUTES = 2.5  # e: the training budget

# a: the agreement asked of CUDA with the CPU (relative Frobenius error over the tensor).
FP32_LOGITS_TOL, FP32_GRAD_TOL, BF16_LOGITS_TOL = 1e-3, 1e-2, 5e-2


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


def rel_err(a: Any, b: Any) -> float:
    """||a - b|| / (||b|| + 1e-8) in float64 (on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / (b.norm() + 1e-8))


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], device: str, reps: int) -> float:
    from lgvit.tools.measure import timed

    return statistics.median(timed(fn, device) for _ in range(reps))


# ---------------------------------------------------------------------------- a. CUDA vs CPU


def part_a(p: Part) -> None:
    import torch

    from lgvit.models import create_model, get_model_config

    names = FAMILY_MODELS[:3] if p.smoke else FAMILY_MODELS  # smoke: LSA, LocalViT, LIT
    for name in names:
        if p.left() < 3:
            p.note(f"out of time before {name}")
            break

        def check(name: str = name) -> dict[str, Any]:
            size = get_model_config(name).smoke_input_size if p.smoke else None
            kwargs = {"img_size": size[-1]} if size else {}
            torch.manual_seed(0)
            cpu = create_model(name, **kwargs).eval()  # eval: no stochastic depth
            with torch.no_grad():  # off zero-initialised points (LIT's offsets: bilinear kinks)
                for w in cpu.parameters():
                    w.add_(torch.randn_like(w), alpha=0.02)
            dev = copy.deepcopy(cpu).to(p.device)
            shape = size or get_model_config(name).input_size
            x = torch.randn(2 if p.smoke else 4, *shape)
            y = torch.arange(x.shape[0]) % 10
            ref, ref_g = _logits_and_grads(cpu, x, y, None)
            got, got_g = _logits_and_grads(dev, x.to(p.device), y.to(p.device), None)
            logits = rel_err(got, ref)
            grad, worst = max((rel_err(got_g[k], ref_g[k]), k) for k in ref_g)
            dtype = torch.bfloat16
            bf, bf_g = _logits_and_grads(dev, x.to(p.device), y.to(p.device), dtype)
            finite = bool(torch.isfinite(bf).all()) and all(
                bool(torch.isfinite(g).all()) for g in bf_g.values()
            )
            bf_err = rel_err(bf.float(), ref)
            ok = logits < FP32_LOGITS_TOL and grad < FP32_GRAD_TOL
            ok = ok and finite and bf_err < BF16_LOGITS_TOL
            return {
                "ok": ok, "input": shape[-1], "fp32_logits_rel_err": logits,
                "fp32_grad_worst_rel_err": grad, "worst_grad": worst, "bf16_finite": finite,
                "bf16_logits_rel_err": bf_err,
            }  # fmt: skip

        p.item(name, check)
    if p.device.startswith("cuda"):
        with contextlib.suppress(Exception):  # the flags a newer torch may rename
            p.data["tf32"] = {
                "matmul": torch.backends.cuda.matmul.allow_tf32,
                "cudnn": torch.backends.cudnn.allow_tf32,
            }
    p.note(
        f"pass: fp32 logits < {FP32_LOGITS_TOL}, worst gradient < {FP32_GRAD_TOL}, bf16 logits "
        f"< {BF16_LOGITS_TOL} relative to the CPU's fp32; eval mode, no stochastic depth"
    )


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


# ------------------------------------------------------------------------- b. CUDA test subset


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
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device",
           *(str(f.relative_to(ROOT)) for f in files)]  # fmt: skip
    if p.smoke:  # the check's smoke test runs inside the suite: collect only
        cmd.append("--collect-only")
    else:
        env["LGVIT_TEST_DEVICE"] = "cuda"

    def run() -> dict[str, Any]:
        rc, out = run_group(cmd, env, max(5.0, p.left() - 3))
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
        collected = re.findall(r"^\S+\.py: (\d+)$", out, re.M)  # -q --collect-only
        if collected:
            counts["collected"] = sum(int(n) for n in collected)
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
        return {"ok": rc == 0, "rc": rc, **counts, "failed_tests": failed[:30],
                "tail": out[-1500:] if rc != 0 else ""}  # fmt: skip

    prefix = "" if p.smoke else "LGVIT_TEST_DEVICE=cuda "
    p.item(prefix + "pytest -m device " + " ".join(cmd[8:]), run)


def run_group(
    cmd: list[str], env: dict[str, str], timeout: float, own_group: bool = False
) -> tuple[int | str, str]:
    """``cmd``'s exit status (``"timeout"`` past ``timeout`` seconds) and its output.
    ``own_group``: it runs in a process group of its own, killed whole at the limit (a part,
    with what it started: pytest, lgvit train and its workers, which stay in its group)."""
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
    """``lgvit train`` in this process (its warnings recordable: cli.main would print them),
    returning the last epoch's metrics; a refusal or failure raises."""
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
        "--batch-size", "16" if p.smoke else "128", "--iters", "2" if p.smoke else "20",
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

    p.item("20 steps + augmentation: host syncs by line (mode 'warn')", steps)
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
        iters = "4" if p.smoke else "20"
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
    import torch

    from lgvit.tools.bench import DEFAULT_BATCH, BenchOptions, run_bench

    names = [SMOKE_MODEL] if p.smoke else list(BENCH_MODELS)
    kw = dict(device=p.device, amp="bf16", train=True, batch_size=2 if p.smoke else DEFAULT_BATCH,
              img_size=16 if p.smoke else None, rounds=1 if p.smoke else 5)  # fmt: skip
    if p.smoke:
        kw["memory"] = False  # a fresh process per probe: seconds each on a CPU
    eager = p.item("eager", lambda: _bench(run_bench(names, BenchOptions(**kw), log=print)))
    p.data["eager"] = eager.pop("rows", [])
    p.save()
    p.item("timm's own models, same process", lambda: _timm_peers(p, kw))
    p.item("LIT DTM: each deformable kernel", lambda: _dtm_kernels(p))
    if p.smoke:
        p.note("compiled: not in --smoke (inductor takes minutes on a CPU); part f compiles")
        return
    p.data["compiled"] = []
    for name in names:
        if p.left() < 45:  # a model's inductor compile (infer and train) takes ~20-40 s
            p.note(f"compiled: out of time before {name}")
            break
        row = p.item(
            f"compiled {name}",
            lambda name=name: _bench(run_bench([name], BenchOptions(**kw, compile=True))),
        )
        p.data["compiled"] += row.pop("rows", [])
        p.save()
        torch.cuda.empty_cache()


def _bench(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("model", "input", "batch", "infer_img_s", "paper_img_s", "paper_hardware",
            "infer_mfu", "train_img_s", "train_mfu", "infer_mem_mb", "train_mem_mb",
            "infer_compile_s", "train_compile_s", "error")  # fmt: skip
    rows = [{k: r.get(k) for k in keep if k in r} for r in result["rows"]]
    return {"ok": all(r.get("error") is None for r in rows), "machine": result["machine"],
            "matmul_peak_tflops": result["matmul_peak_tflops"], "rows": rows}  # fmt: skip


def _timm_peers(p: Part, kw: dict[str, Any]) -> dict[str, Any]:
    """timm's model beside lgvit's, same step code, batch and precision, same process."""
    if importlib.util.find_spec("timm") is None:
        return {"ok": True, "skipped": "timm is not installed"}
    import torch
    from bench_peers import PEERS, build_pair

    from lgvit.models import get_model_config
    from lgvit.tools.measure import make_step

    names = ["deit_tiny"] if p.smoke else [n for n in BENCH_MODELS if n in PEERS]
    rows = []
    for name in names:
        if p.left() < 10:
            break
        shape = get_model_config(name).input_size
        row: dict[str, Any] = {"model": name, "timm": PEERS[name]}
        for who, model in build_pair(name).items():
            model = model.to(p.device)
            for kind in ("infer", "train"):
                step = make_step(model, shape, kw["batch_size"], kind == "train", torch.bfloat16,
                                 device=p.device)  # fmt: skip
                step()
                sec = median_seconds(step, p.device, kw["rounds"])
                row[f"{who}_{kind}_img_s"] = round(kw["batch_size"] / sec, 1)
        row["infer_ratio"] = round(row["lgvit_infer_img_s"] / row["timm_infer_img_s"], 3)
        row["train_ratio"] = round(row["lgvit_train_img_s"] / row["timm_train_img_s"], 3)
        rows.append(row)
    return {"ok": True, "rows": rows, "note": "ratio: lgvit img/s over timm's"}


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
    # A failed plan still trains: the time limit stops a plan that runs long.
    epochs = 1 if p.smoke else p.item("planned epochs", lambda: _plan_epochs(p)).get("epochs", 15)
    data = (["--data", "synthetic", "--iters", "3", "--batch-size", "16", "--model",
             SMOKE_MODEL] if p.smoke else
            ["--data", "imagefolder", "--data-dir", str(Path(p.args.cifar).resolve()),
             "--epochs", str(epochs), "--batch-size", str(CIFAR_BATCH),
             "--model", "lsa_tiny_cifar"])  # fmt: skip
    # The CPU budget config's short-run recipe (crop + flip, progressive resizing, linear decay),
    # at a GPU batch; stopped by the trainer's own time limit should the plan run long.
    cmd = [sys.executable, "-m", "lgvit", "train", "--config", "cifar10_lsa_micro_cpu", *data,
           "--device", p.device, "--amp", "bf16", "--out", str(out), "--set", "eval_every=1",
           "--set", f"lr={CIFAR_LR}", "--set", f"time_limit_min={CIFAR_MINUTES}"]  # fmt: skip

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


CIFAR_BATCH = 512
CIFAR_LR = 2e-3  # for lr_base_batch 512: AdamW at 2e-3 per step at batch 512
CIFAR_TRAIN = 50_000


def _plan_epochs(p: Part) -> dict[str, Any]:
    """Epochs that fit the budget, from a measured bf16 training step at full size (progressive
    resizing makes the early epochs cheaper: the time limit still stops a long plan)."""
    import torch

    from lgvit.models import create_model
    from lgvit.tools.measure import make_step

    model = create_model("lsa_tiny_cifar").to(p.device)
    step = make_step(model, (3, 32, 32), CIFAR_BATCH, True, torch.bfloat16,
                     device=p.device)  # fmt: skip
    for _ in range(3):
        step()
    sec = median_seconds(step, p.device, 5)
    epoch_s = CIFAR_TRAIN / CIFAR_BATCH * sec * 1.15 + 2.0  # augmentation, evaluation
    epochs = max(1, int((CIFAR_MINUTES * 60 - 10) / epoch_s))  # the last epoch may run over
    del model, step
    torch.cuda.empty_cache()
    return {"step_s": round(sec, 4), "epochs": epochs}


# ------------------------------------------------------------------------------ f. compile


def part_f(p: Part) -> None:
    import torch

    from lgvit.models import create_model, get_model_config
    from lgvit.tools.measure import make_step

    backend = "eager" if p.smoke else "inductor"
    names = [SMOKE_MODEL] if p.smoke else ["lsa_tiny_cifar", "lit_ti"]
    for name in names:

        def one(name: str = name) -> dict[str, Any]:
            size = get_model_config(name).smoke_input_size if p.smoke else None
            shape = size or get_model_config(name).input_size
            torch.manual_seed(0)
            model = create_model(name, **({"img_size": size[-1]} if size else {}))
            model = model.to(p.device).eval()
            batch = 2 if p.smoke else 64
            compiled = torch.compile(model, backend=backend)
            x = torch.randn(batch, *shape, device=p.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                got = compiled(x)
            sync(p.device)
            compile_s = time.perf_counter() - t0
            with torch.no_grad():
                want = model(x)
            err = rel_err(got, want)
            row = {"backend": backend, "compile_s": round(compile_s, 2), "fp32_rel_err": err}
            reps = 1 if p.smoke else 10
            for who, m in (("eager", model), ("compiled", compiled)):
                step = make_step(m, shape, batch, False, torch.bfloat16, device=p.device)
                step()
                row[f"{who}_bf16_infer_img_s"] = round(batch / median_seconds(step, p.device, reps))
            row["speedup"] = round(row["compiled_bf16_infer_img_s"] / row["eager_bf16_infer_img_s"],
                                   3)  # fmt: skip
            row["ok"] = err < FP32_LOGITS_TOL
            return row

        p.item(name, one)


PART_FUNCS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f}


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


def check(args: argparse.Namespace) -> int:
    """The parent: every part in its own process, the reports written after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report: dict[str, Any] = {"command": " ".join(sys.argv), "smoke": bool(args.smoke),
                              "device": args.device, "machine": _machine(args.device),
                              "parts": {}}  # fmt: skip
    log = out / "log.txt"
    log.write_text("")
    wanted = args.parts or "".join(k for k, _, _ in PARTS)
    for key, title, budget in PARTS:
        if key not in wanted:
            continue
        left = TOTAL_S - (time.monotonic() - start)
        limit = SMOKE_PART_S if args.smoke else min(budget, left)
        report["parts"][key] = entry = {"title": title, "budget_s": budget}
        if not args.smoke and limit < 5:
            entry.update(status="skipped", reason="the whole check's time is spent")
        else:
            entry.update(_spawn(args, key, limit, log))
        print(f"part {key} ({title}): {entry['status']} {entry.get('reason', '')}", flush=True)
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        write_atomic(out / "report.json", json.dumps(report, indent=1, default=str))
        write_atomic(out / "report.md", markdown(report))
    print(f"wrote {out / 'report.json'} and {out / 'report.md'}")
    return 0


def _spawn(args: argparse.Namespace, key: str, limit: float, log: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--_part", key, "--_result", str(result),
               "--_budget", str(limit - 5), "--device", args.device]  # fmt: skip
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--cifar", args.cifar] if args.cifar else []
        env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        rc, text = run_group(cmd, env, limit, own_group=True)
        with open(log, "a") as f:
            f.write(f"===== part {key} (rc {rc})\n{text}\n")
        data = json.loads(result.read_text()) if result.exists() else {"items": [], "notes": []}
    entry = {**data, "seconds": round(time.monotonic() - t0, 1)}
    if data.get("skipped"):
        entry.update(status="skipped", reason=data.pop("skipped"))
    elif rc == "timeout":
        entry.update(status="timeout", reason=f"stopped at its {limit:.0f} s limit")
    elif rc != 0:
        last = [x for x in text.strip().splitlines() if x.strip()][-1:] or [f"exit status {rc}"]
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


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: a status line per part, then each item's figures."""
    lines = [f"# GPU check: {report['machine']}", "", f"`{report['command']}`", "",
             "| part | status | seconds | |", "| --- | --- | --- | --- |"]  # fmt: skip
    for key, e in report["parts"].items():
        lines.append(f"| {key}. {e['title']} | {e['status']} | {e.get('seconds', '')} | "
                     f"{e.get('reason', '')} |")  # fmt: skip
    for key, e in report["parts"].items():
        lines += ["", f"## {key}. {e['title']}", ""]
        for note in e.get("notes", []):
            lines.append(f"- {note}")
        for item in e.get("items", []):
            lines.append(f"- **{item['item']}**: {json.dumps(_brief(item), default=str)}")
        for table in ("eager", "compiled"):
            if e.get(table):
                lines += ["", f"{table}:", "", *_table(e[table])]
    return "\n".join(lines) + "\n"


def _brief(item: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in item.items()
            if k not in ("item", "tail") or v}  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for report.json, report.md and log.txt")
    ap.add_argument("--cifar", help="e: the CIFAR-10 JPEG tarball (cifar10-jpeg.tar.gz)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, no CIFAR")
    ap.add_argument("--device", help="default: cuda (cpu with --smoke)")
    ap.add_argument("--parts", help="a subset of the parts, e.g. 'ad' (default: all)")
    ap.add_argument("--_part", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--_budget", dest="budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.part, args.result = args._part, args._result
    if args.part:
        return run_part(args)
    if not args.out:
        ap.error("--out DIR is required")
    if args.parts and set(args.parts) - set(PART_FUNCS):
        ap.error(f"--parts {args.parts!r}: choose from {''.join(PART_FUNCS)}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: CUDA is not available here; use --smoke on a CPU", file=sys.stderr)
            return 2
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
