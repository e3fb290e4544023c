"""The device-sensitive tests, on ``LGVIT_TEST_DEVICE`` (tests/conftest.py): the CPU in the plain
suite, CUDA with ``LGVIT_TEST_DEVICE=cuda`` on a GPU machine (benchmarks/gpu_check.py runs this
file so). Each model family forward and backward against the CPU, the training loop in every
precision, the non-finite skip, exact resume, the batched augmentation, DDP and the dense
tasks, at tiny sizes."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TEST_DEVICE, device_env, quick_init
from seg_fixtures import write_seg_set
from test_segmentation import SEG_TRAIN
from test_train import ENV, FAST, metrics

import lgvit
from lgvit.checkpoints.files import load_weights
from lgvit.cli import main
from lgvit.data.loader import AugmentConfig, BatchLoader
from lgvit.tasks.classification.train import ClassificationTask
from lgvit.tools.measure import (
    GRAD_TOL,
    LOGITS_TOL,
    ieee_fp32,
    relative_error,
    without_randomness,
    worst_grad_error,
)

pytestmark = pytest.mark.device

# One small model of each family and of each pyramid peer: (name, create_model overrides).
FAMILIES = {
    "lsa": ("lsa_micro_cifar", {"img_size": 16}),
    "lit": ("lit_ti", {"img_size": 64, "depths": (1, 1, 1, 1)}),  # its DTM: a deformable conv
    "localvit": ("localvit_tiny", {"img_size": 32, "depth": 2}),
    "pvt": ("pvt_tiny", {"img_size": 64, "depths": (1, 1, 1, 1)}),
    "swin": ("swin_tiny", {"img_size": 64, "depths": (1, 1, 1, 1), "window_size": 2}),
    "deit": ("deit_tiny", {"img_size": 32, "depth": 2}),
    "t2t": ("t2t_vit_7", {"img_size": 64, "depth": 2}),  # its performers' dropout: set to 0
    "tnt": ("tnt_tiny", {"img_size": 64, "depth": 2}),
}
FP16_CPU = "fp16 autocast with a GradScaler is CUDA-only (lgvit refuses --amp fp16 on a CPU)"


def family_case(family: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The family's small model in training mode (batch statistics, LIT's sampling offsets
    learning) without dropout or drop path (two devices draw different masks), its weights
    moved off zero-initialised points (LIT's offsets: bilinear kinks), and a batch of 4."""
    name, kw = FAMILIES[family]
    torch.manual_seed(0)
    with quick_init():
        model = without_randomness(lgvit.create_model(name, num_classes=10, **kw).train())
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn_like(w), alpha=0.02)
    size = kw["img_size"]
    return model, torch.randn(4, 3, size, size), torch.randint(0, 10, (4,))


def one_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype=None):  # noqa: ANN001
    """Logits and the parameters' gradients of one cross-entropy step (autocast to ``dtype``)."""
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(x.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with ctx:
        logits = model(x)
    F.cross_entropy(logits.float(), y).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.float(), grads


# ------------------------------------------------------------------------------ model families


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_backward_match_the_cpu(family, device):
    """fp32 logits and gradients on the device as on the CPU, in IEEE fp32 (TF32 off), by the
    rule gpu_check's part a uses (``measure.worst_grad_error``: a gradient zero in exact
    arithmetic is noise on both sides and cannot fail); bf16 (and fp16 on CUDA) finite and
    close to them."""
    ref, x, y = family_case(family)
    want, want_grads = one_step(ref, x, y)
    model = copy.deepcopy(ref).to(device)
    xd, yd = x.to(device), y.to(device)
    with ieee_fp32():
        got, grads = one_step(model, xd, yd)
    assert got.device.type == device and grads.keys() == want_grads.keys()
    assert relative_error(got, want) < LOGITS_TOL, family
    err, worst = worst_grad_error(grads, want_grads)
    assert err < GRAD_TOL, (family, worst, err)
    low = [torch.bfloat16] + ([torch.float16] if device == "cuda" else [])
    for dtype in low:
        got, grads = one_step(model, xd, yd, dtype)
        assert all(g.isfinite().all() for g in [got, *grads.values()]), (family, dtype)
        assert relative_error(got, want) < 0.05, (family, dtype)
        flat = torch.cat([g.flatten().cpu() for g in grads.values()])
        want_flat = torch.cat([want_grads[n].flatten() for n in grads])
        assert F.cosine_similarity(flat, want_flat, dim=0) > 0.95, (family, dtype)


# ------------------------------------------------------------------------------ training loop


def _train(device: str, out: Path, *extra: str) -> int:
    return main(["train", *FAST, "--data", "synthetic", "--device", device, "--out", str(out),
                 *extra])  # fmt: skip


@pytest.mark.parametrize("amp", ["none", "bf16", "fp16"])
def test_training_steps_in_each_precision(amp, device, tmp_path, capsys):
    """A few steps through ``lgvit train`` (fp16: under a GradScaler), then the evaluation."""
    if amp == "fp16" and device == "cpu":
        pytest.skip(FP16_CPU)
    assert _train(device, tmp_path / "run", "--amp", amp, "--iters", "3") == 0
    out = capsys.readouterr().out
    dtype = {"none": "none", "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    assert f"on {device}," in out and f"amp {dtype}" in out
    (row,) = metrics(tmp_path / "run")
    assert math.isfinite(row["train_loss"]) and math.isfinite(row["test_loss"])
    assert all(w.isfinite().all() for w in load_weights(tmp_path / "run" / "last").values())


def test_a_nonfinite_loss_skips_its_step(device, tmp_path, monkeypatch, capsys):
    """The loss of the epoch's second and last batch made NaN: within ``max_nonfinite`` its step
    is skipped (on CUDA in the fused AdamW kernel, without a host sync), so the weights are
    those of a run one step shorter (constant lr); beyond it the run stops with one line."""
    loss = ClassificationTask.loss
    calls = []

    def nan_second(self, *args):  # noqa: ANN001, ANN202
        value, n = loss(self, *args)
        calls.append(1)
        return (value * math.nan if len(calls) == 2 else value), n

    # 512 images at batch 256: two steps an epoch.
    flat = ["--amp", "none", "--batch-size", "256", "--set", "sched=none",
            "--set", "warmup_epochs=0"]  # fmt: skip
    assert _train(device, tmp_path / "one", *flat, "--iters", "1") == 0
    monkeypatch.setattr(ClassificationTask, "loss", nan_second)
    ok = [*flat, "--iters", "2", "--set", "max_nonfinite=1"]
    capsys.readouterr()
    assert _train(device, tmp_path / "skip", *ok) == 0
    assert len(calls) == 2
    # The host's skip is a warning line; the device's (fused AdamW on CUDA) counts silently.
    skipped = "lgvit train: warning: loss is nan at epoch 1 step 2: skipped"
    assert (skipped in capsys.readouterr().err) == (device == "cpu")
    a, b = load_weights(tmp_path / "skip" / "last"), load_weights(tmp_path / "one" / "last")
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)
    assert math.isfinite(metrics(tmp_path / "skip")[0]["train_loss"])
    calls.clear()
    assert _train(device, tmp_path / "stop", *flat, "--iters", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopping" in err[0] and "no checkpoint had been saved" in err[0]


def test_resume_continues_exactly(device, tmp_path):
    """Stopped after epoch 1 of 2 and resumed: the same metrics and bit-identical weights as an
    uninterrupted run (RNG streams, the optimizer, the scaler and the loader's state)."""
    # 4 steps an epoch; on CUDA, kernels that give the same bits every time (the run's switch).
    args = ["--batch-size", "128", "--epochs", "2", "--set", "deterministic=true"]
    assert _train(device, tmp_path / "full", *args) == 0
    cut = tmp_path / "cut"
    assert _train(device, cut, *args, "--set", "time_limit_min=1e-9") == 0
    assert len(metrics(cut)) == 1
    assert main(["train", "--out", str(cut), "--resume", "auto",
                 "--set", "time_limit_min=null"]) == 0  # fmt: skip
    keys = ("epoch", "train_loss", "test_acc1", "test_acc5", "test_loss", "lr")
    a = [{k: r[k] for k in keys} for r in metrics(tmp_path / "full")]
    assert a == [{k: r[k] for k in keys} for r in metrics(cut)]
    full, resumed = load_weights(tmp_path / "full" / "last"), load_weights(cut / "last")
    assert all(torch.equal(full[k], resumed[k]) for k in full)


# ------------------------------------------------------------------------------ augmentation


def test_batched_augmentation_on_the_device(device):
    """The DeiT recipe (crop, flip, RandAugment, erasing, mixup/cutmix) run on the device:
    shapes, dtypes, the device, soft targets; reproducible from the seed and from a mid-epoch
    state; per channel the same distribution as on the CPU (the draws may differ there)."""
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 255, 24).expand(24, 24)  # some structure for the geometric ops
    noise = torch.randint(0, 64, (1024, 3, 24, 24), generator=g)
    images = (ramp * torch.rand(1024, 3, 1, 1, generator=g) + noise).clamp(0, 255).to(torch.uint8)
    labels = torch.randint(0, 10, (1024,), generator=g)
    aug = AugmentConfig(img_size=16)

    def loader(dev: str) -> BatchLoader:
        ld = BatchLoader(images, labels, 64, num_classes=10, train=True, aug=aug, seed=1,
                         device=dev)  # fmt: skip
        ld.set_epoch(1)
        return ld

    ld = loader(device)
    a, b, ref = list(ld), list(loader(device)), list(loader("cpu"))
    assert len(a) == 16
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.device.type == device and ya.device.type == device
        assert xa.shape == (64, 3, 16, 16) and xa.dtype == torch.float32 and ya.shape == (64, 10)
        assert xa.isfinite().all()
        torch.testing.assert_close(ya.sum(1), torch.ones(64, device=ya.device))
    # A pass continued from the state after batch 2 draws what the whole pass drew.
    ld = loader(device)
    it = iter(ld)
    next(it), next(it)
    state = ld.aug_state()
    ld.set_epoch(1, 2, state)
    for (xa, ya), (xc, yc) in zip(a[2:], list(ld), strict=True):
        assert torch.equal(xa, xc) and torch.equal(ya, yc)
    x = torch.cat([x for x, _ in a]).cpu().transpose(0, 1).flatten(1)
    xr = torch.cat([x for x, _ in ref]).transpose(0, 1).flatten(1)
    # Between the CPU's seeds these vary by 0.026 (mean) and 3% (std), one standard deviation.
    torch.testing.assert_close(x.mean(1), xr.mean(1), rtol=0, atol=0.15)
    torch.testing.assert_close(x.std(1), xr.std(1), rtol=0.2, atol=0)


# ------------------------------------------------------------------------------ processes


@pytest.mark.ddp
def test_two_ranks(device, tmp_path):
    """DDP with two processes (gloo on the CPU, NCCL on CUDA: one GPU each)."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"DDP on CUDA needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    run = tmp_path / "ddp"
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "lgvit", "train", *FAST, "--batch-size", "16", "--data", "synthetic",
         "--device", device, "--iters", "2", "--out", str(run)],
        capture_output=True, text=True, timeout=300,
        env=device_env(ENV) if device == "cuda" else ENV,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"2 process(es) on {device}" in p.stdout and "global batch 32" in p.stdout
    (row,) = metrics(run)
    assert math.isfinite(row["train_loss"])


# ------------------------------------------------------------------------------ dense tasks


@pytest.mark.dense
def test_segmentation_training_steps(device, tmp_path):
    """Semantic FPN through ``lgvit train --task segmentation``: two steps (an epoch at batch
    8) and the mIoU evaluation."""
    root = write_seg_set(tmp_path / "data", n_train=16, n_val=2, size=(32, 40))
    run = tmp_path / "run"
    assert main([*SEG_TRAIN, "--data-dir", str(root), "--device", device, "--amp", "auto",
                 "--iters", "2", "--out", str(run)]) == 0  # fmt: skip
    (row,) = metrics(run)
    assert math.isfinite(row["train_loss"]) and 0 <= row["test_mIoU"] <= 100


@pytest.mark.dense
@pytest.mark.parametrize("kind", ["retinanet", "maskrcnn"])
def test_detection_training_step(kind, device):
    """A detector's losses on the device: RetinaNet's as on the CPU (fp32; Mask R-CNN samples
    proposals, which draw differently on CUDA: finite), then a step and detections. (The COCO
    loader needs pycocotools, which a GPU machine may lack: this is the model's own step.)"""
    from lgvit.dense.detection import create_detector

    torch.manual_seed(0)
    with quick_init():
        ref = create_detector(kind, "lsa_micro_cifar", num_classes=3, min_size=32, max_size=48,
                              drop_path_rate=0.0)  # fmt: skip
    if kind == "maskrcnn":  # fewer sampled proposals and kept detections: a test's sizes
        ref.roi_heads.fg_bg_sampler.batch_size_per_image = 64
        ref.roi_heads.detections_per_img = 10
    images = [torch.rand(3, 32, 40), torch.rand(3, 40, 32)]
    mask = torch.zeros(1, 32, 40, dtype=torch.uint8)
    mask[0, 4:24, 8:32] = 1
    targets = [
        {"boxes": torch.tensor([[8.0, 4, 32, 24]]), "labels": torch.tensor([1]), "masks": mask},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long),
         "masks": torch.zeros(0, 40, 32, dtype=torch.uint8)},  # an image without objects
    ]  # fmt: skip
    model = copy.deepcopy(ref).to(device).train()
    on_device = [{k: v.to(device) for k, v in t.items()} for t in targets]
    with ieee_fp32():
        got = model([im.to(device) for im in images], on_device)
    assert all(v.isfinite() for v in got.values()), got
    if kind == "retinanet":
        want = ref.train()(images, targets)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k].cpu(), want[k], rtol=1e-3, atol=1e-4, msg=k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(got.values()).backward()
    opt.step()
    assert all(p.isfinite().all() for p in model.parameters())
    with torch.no_grad():
        out = model.eval()([im.to(device) for im in images])
    assert len(out) == 2 and out[0]["boxes"].shape[-1] == 4
    assert out[0]["boxes"].device.type == device


# ------------------------------------------------------------------------------ the switch


def test_the_plain_suite_hides_cuda():
    """Without the switch neither a test nor a command it starts sees a GPU, so `make test` on
    a GPU machine runs as on a CPU one (the commands inherit the variable)."""
    if TEST_DEVICE != "cpu":
        pytest.skip("LGVIT_TEST_DEVICE=cuda: the device tests see the GPUs")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()


SWITCH_PROBE = """
import os, pytest, torch
from conftest import device_env

def test_a_cpu_test():
    assert not torch.cuda.is_available() and os.environ["CUDA_VISIBLE_DEVICES"] == ""

@pytest.mark.device
def test_a_device_test():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # what the CPU tests' commands inherit
    assert device_env()["CUDA_VISIBLE_DEVICES"] == "7"  # what a device test's commands see
"""


def test_the_switch_and_a_wrong_value(tmp_path):
    """LGVIT_TEST_DEVICE=cuda: the device tests' commands see the GPUs the run was given, the
    CPU tests none; a value other than cpu or cuda is one line before any test runs."""
    if TEST_DEVICE != "cpu":
        pytest.skip("the switch's own test runs in the plain suite")
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path)
    (tmp_path / "test_probe.py").write_text(SWITCH_PROBE)
    env = {k: v for k, v in ENV.items() if not k.startswith("LGVIT_TEST")}

    def pytest_run(value: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
             str(tmp_path)],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
            env={**env, "LGVIT_TEST_DEVICE": value, "CUDA_VISIBLE_DEVICES": "7"},
        )  # fmt: skip

    ok = pytest_run("cuda")
    assert ok.returncode == 0 and "2 passed" in ok.stdout, ok.stdout[-3000:]
    bad = pytest_run("gpu")
    assert bad.returncode == 4, bad.stdout[-3000:]
    assert "LGVIT_TEST_DEVICE='gpu': must be one of cpu, cuda" in bad.stdout + bad.stderr
