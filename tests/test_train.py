"""Training, evaluation and the command line, end to end on tiny runs (CPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lgvit.run.config import TrainConfig
from lgvit.run.optim import lr_at, param_groups
from lgvit.tasks.classification.train import train_size_at

# A tiny, fast run: the micro model at 16px on 512 synthetic images.
FAST = [
    "--model", "lsa_micro_cifar", "--img-size", "16", "--batch-size", "32",
    "--set", "log_every=1000", "--set", "warmup_epochs=1",
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def lgvit(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lgvit", *args],
        capture_output=True, text=True, env=env or ENV, timeout=timeout,
    )  # fmt: skip


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    assert "Traceback" not in p.stderr
    for n in needles:
        assert n in err[0], err[0]


# ------------------------------------------------------------------------------- recipe pieces


def test_schedule_warmup_end_and_last_step():
    cfg = TrainConfig(warmup_lr=1e-6, min_lr=1e-5)
    kw = dict(total_steps=1000, warmup_steps=50, cfg=cfg, base_lr=5e-4)
    assert lr_at(0, **kw) == pytest.approx(1e-6)
    assert lr_at(25, **kw) == pytest.approx(1e-6 + (5e-4 - 1e-6) / 2)
    assert lr_at(50, **kw) == pytest.approx(5e-4)  # warm-up ends at the peak
    mid = 50 + (1000 - 50) // 2
    assert lr_at(mid, **kw) == pytest.approx(1e-5 + (5e-4 - 1e-5) / 2, rel=1e-3)
    assert lr_at(1000, **kw) == pytest.approx(1e-5)  # cosine ends at min_lr
    assert lr_at(999, **kw) > 1e-5
    lrs = [lr_at(s, **kw) for s in range(50, 1001)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone decay


def test_linear_schedule_falls_at_a_constant_rate_to_min_lr():
    cfg = TrainConfig(warmup_lr=1e-6, min_lr=1e-5, sched="linear")
    kw = dict(total_steps=1050, warmup_steps=50, cfg=cfg, base_lr=5e-4)
    assert lr_at(25, **kw) == pytest.approx(1e-6 + (5e-4 - 1e-6) / 2)  # the same warm-up
    assert lr_at(50, **kw) == pytest.approx(5e-4)
    assert lr_at(300, **kw) == pytest.approx(1e-5 + (5e-4 - 1e-5) * 0.75)
    assert lr_at(800, **kw) == pytest.approx(1e-5 + (5e-4 - 1e-5) * 0.25)
    assert lr_at(1050, **kw) == pytest.approx(1e-5) == lr_at(2000, **kw)
    steps = [lr_at(s, **kw) - lr_at(s + 1, **kw) for s in range(50, 1050)]
    assert max(steps) == pytest.approx(min(steps))  # every step lowers it by the same amount


def test_progressive_resizing_schedule():
    cfg = TrainConfig(epochs=10, train_size_start=16, train_size_ramp=(0.2, 0.6))
    # flat to epoch 2 (20%), steps of 8 up to 32 at epoch 6 (60%), then 32 to the end
    want = [16, 16, 16, 16, 24, 24, 32, 32, 32, 32]
    assert [train_size_at(e, cfg, 32) for e in range(10)] == want
    off = TrainConfig(epochs=10)
    assert {train_size_at(e, off, 32) for e in range(10)} == {32}
    odd = TrainConfig(epochs=4, train_size_start=10, train_size_ramp=(0.0, 1.0), train_size_step=4)
    assert [train_size_at(e, odd, 32) for e in range(4)] == [10, 14, 18, 26]


def test_progressive_resizing_feeds_the_model_downscaled_batches(one_epoch):
    import torch
    import torch.nn.functional as F

    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 2)

        def forward(self, x):
            seen.append(x.detach().clone())
            return self.head(x.mean((2, 3)))

    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 0, 1])
    cfg = TrainConfig(epochs=4, train_size_start=16, train_size_ramp=(0.5, 1.0), clip_grad=None)
    model = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = dict(total_steps=4, warmup_steps=0, cfg=cfg, base_lr=0.1)
    for epoch in (0, 3):  # 16px, then 16 + 8 (t = 0.5 of the ramp)
        one_epoch(model, [(x, y)], opt, cfg, epoch=epoch, schedule=sched, img_size=32)
    assert [t.shape[-1] for t in seen] == [16, 24]
    ref = F.interpolate(x, size=(16, 16), mode="bilinear", antialias=True, align_corners=False)
    torch.testing.assert_close(seen[0], ref)


def test_progressive_resizing_run_and_its_errors(tmp_path):
    run = tmp_path / "p"
    p = lgvit("train", *FAST, "--data", "synthetic", "--epochs", "2", "--out", str(run),
              "--set", "train_size_start=8", "--set", "train_size_ramp=[0.0,0.5]")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert [m["train_size"] for m in metrics(run)] == [8, 16]
    assert "epoch 1/2 at 8px" in (run / "train.log").read_text()
    base = [*FAST, "--data", "synthetic", "--epochs", "1", "--out", str(tmp_path / "e")]
    one_line_error(lgvit("train", *base, "--set", "train_size_start=24"), "train_size_start 24")
    bad = lgvit("train", *base, "--set", "train_size_ramp=[0.6,0.2]")
    one_line_error(bad, "train_size_ramp")


def test_no_weight_decay_on_pos_embed_norms_biases():
    import lgvit

    m = lgvit.create_model("lsa_micro_cifar")
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert "pos_embed" in nd and "stages.1.pos_embed" in nd and "norm.weight" in nd
    assert "head.bias" in nd and "head.weight" not in nd
    assert all(p.ndim >= 2 for p in decay["params"])
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


# ------------------------------------------------------------------------------- runs


def test_train_eval_predict_plot(tmp_path):
    run = tmp_path / "run"
    p = lgvit("train", *FAST, "--data", "synthetic", "--epochs", "2", "--out", str(run),
              "--set", "ema=true", "--set", "ema_decay=0.9")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "global batch 32" in p.stdout
    # Not a terminal: plain lines, no progress-bar control characters.
    assert "\r" not in p.stdout + p.stderr and "\x1b" not in p.stdout + p.stderr
    rows = metrics(run)
    assert [r["epoch"] for r in rows] == [0, 1]
    for key in ("train_loss", "test_acc1", "test_acc5", "lr", "img_per_s", "epoch_time_s"):
        assert all(key in r and math.isfinite(r[key]) for r in rows)
    for f in ("config.yaml", "last.safetensors", "last.state.pt", "best.safetensors", "train.log"):
        assert (run / f).is_file(), f
    # Training again into the same directory without --resume would lose nothing: refused.
    again = lgvit("train", *FAST, "--data", "synthetic", "--epochs", "2", "--out", str(run))
    one_line_error(again, "already holds a run", "--resume auto")

    # --amp auto: the precision the run evaluated in (eval's default is fp32)
    ev = lgvit("eval", "--checkpoint", str(run / "last"), "--data", "synthetic", "--json",
               "--amp", "auto")  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    res = json.loads(ev.stdout)
    assert res["count"] == 128 and len(res["per_class_acc"]) == 10
    assert res["acc1"] == pytest.approx(rows[-1]["test_acc1"], abs=1e-3)
    # The EMA weights are a checkpoint of their own (lgvit evaluates the EMA model each epoch).
    ema = lgvit("eval", "--checkpoint", str(run / "last_ema"), "--data", "synthetic", "--json",
                "--device", "cpu", "--amp", "auto")  # fmt: skip
    assert ema.returncode == 0, ema.stderr
    assert json.loads(ema.stdout)["acc1"] == pytest.approx(rows[-1]["test_ema_acc1"], abs=1e-3)
    one_line_error(
        lgvit("eval", "--checkpoint", str(run / "last"), "--data", "synthetic", "--device", "tpu"),
        "--device",
    )

    # Evaluating at another input size resizes the position embeddings.
    ev32 = lgvit("eval", "--checkpoint", str(run / "last"), "--data", "synthetic",
                 "--img-size", "32", "--json")  # fmt: skip
    assert ev32.returncode == 0, ev32.stderr
    assert json.loads(ev32.stdout)["count"] == 128

    img = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), np.uint8)).save(img)
    pr = lgvit("predict", "--checkpoint", str(run / "last"), str(img), "--json")
    assert pr.returncode == 0, pr.stderr
    top = json.loads(pr.stdout)[0]["top"]
    assert len(top) == 5 and abs(sum(p for _, p in top)) <= 1.0 + 1e-6
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"")
    skipped = lgvit("predict", "--checkpoint", str(run / "last"), str(bad))
    assert skipped.returncode == 1, skipped.stderr  # skipped, as every unreadable image is
    assert skipped.stderr.strip().splitlines() == [
        f"lgvit predict: skipped: {bad}: not a readable image (empty, truncated or not an image)"
    ]

    pl = lgvit("plot", str(run))
    assert pl.returncode == 0, pl.stderr
    assert pl.stdout.strip() == str(run / "curves.png") and Image.open(run / "curves.png").size


# ``lgvit`` whose process is SIGKILLed once the first epoch is saved: the engine's epoch-end
# hook (after the save) is patched in the child, so no test hook runs in production.
KILL_AFTER_FIRST_EPOCH = """
import os, signal, sys
from lgvit.cli import main
from lgvit.run.preempt import RunControl

def kill_after_first(self, epoch, *rest):
    if epoch == 0:
        os.kill(os.getpid(), signal.SIGKILL)

RunControl.after_epoch = kill_after_first
sys.argv[0] = "lgvit"
raise SystemExit(main(sys.argv[1:]))
"""


def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    args = [*FAST, "--data", "synthetic", "--epochs", "3"]
    full = tmp_path / "full"
    assert lgvit("train", *args, "--out", str(full)).returncode == 0
    cut = tmp_path / "cut"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_FIRST_EPOCH, "train", *args, "--out", str(cut)],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL after epoch 1's checkpoint
    assert len(metrics(cut)) == 1
    # Only --out and --resume: everything else (model, data, epochs, ...) comes from the run.
    resumed = lgvit("train", "--out", str(cut), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    keys = ("epoch", "train_loss", "test_acc1", "test_acc5", "test_loss", "lr")
    a = [{k: r[k] for k in keys} for r in metrics(full)]
    b = [{k: r[k] for k in keys} for r in metrics(cut)]
    assert a == b


def test_two_process_distributed_run(tmp_path):
    run = tmp_path / "ddp"
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node", "2", "-m", "lgvit", "train", *FAST, "--batch-size", "16",
         "--data", "synthetic", "--epochs", "1", "--out", str(run)],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 process(es)" in p.stdout and "global batch 32" in p.stdout
    assert p.stdout.count("final test top-1") == 1  # only rank 0 reports and writes
    rows = metrics(run)
    assert len(rows) == 1 and math.isfinite(rows[0]["train_loss"])


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    run = tmp_path / "nan"
    p = lgvit("train", *FAST, "--data", "synthetic", "--epochs", "3", "--out", str(run),
              "--amp", "none", "--set", "lr=1e30", "--set", "clip_grad=null",
              "--set", "warmup_epochs=0", "--set", "warmup_lr=1e30")  # fmt: skip
    # The loss is non-finite from the first step: no checkpoint exists, and the line says so.
    one_line_error(p, "loss is", "no checkpoint had been saved yet")
    # Whatever epochs finished are loadable; no partial files are left behind.
    assert not list(run.glob("*.tmp*"))


# ------------------------------------------------------------------------------- bad input


def _folder(root: Path, classes: dict[str, list[str]], n: int = 4) -> None:
    rng = np.random.default_rng(0)
    for split, names in classes.items():
        for c in names:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                arr = rng.integers(0, 255, (12, 12, 3), np.uint8)
                Image.fromarray(arr).save(d / f"{i}.png")


def test_bad_inputs_are_one_line_errors(tmp_path):
    cache = ["--set", f"cache_dir={tmp_path / 'cache'}"]
    base = [*FAST, "--epochs", "1", "--out", str(tmp_path / "r"), *cache]
    missing = lgvit("train", *base, "--data", "imagefolder", "--data-dir", str(tmp_path / "no"))
    one_line_error(missing, "no")
    (tmp_path / "empty").mkdir()
    empty = lgvit("train", *base, "--data", "imagefolder", "--data-dir", str(tmp_path / "empty"))
    one_line_error(empty, "empty")
    _folder(tmp_path / "mm", {"train": ["cat", "dog"], "val": ["cat", "emu"]})
    mismatch = lgvit("train", *base, "--data", "imagefolder", "--data-dir", str(tmp_path / "mm"))
    one_line_error(mismatch, "dog")
    unknown = lgvit("train", *base, "--data", "synthetic", "--set", "learning_rate=1")
    one_line_error(unknown, "learning_rate")
    size = lgvit("train", "--model", "lsa_tiny_224", "--img-size", "4", "--data", "synthetic",
                 "--epochs", "1", "--out", str(tmp_path / "s"))  # fmt: skip
    one_line_error(size, "too small")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: [1, 2\n")
    one_line_error(lgvit("train", "--config", str(cfg)), "c.yaml")


def test_unreadable_images_skipped_then_threshold(tmp_path):
    _folder(tmp_path / "d", {"train": ["a", "b"], "val": ["a", "b"]}, n=20)
    (tmp_path / "d" / "train" / "a" / "zero.png").write_bytes(b"")
    cache = ["--set", f"cache_dir={tmp_path / 'cache'}"]
    ok = lgvit("train", *FAST, "--epochs", "1", "--data", "imagefolder", "--data-dir",
               str(tmp_path / "d"), "--out", str(tmp_path / "r"), *cache)  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "skipped 1 unreadable" in ok.stdout and "zero.png" in ok.stdout
    for i in range(5):
        (tmp_path / "d" / "train" / "b" / f"junk{i}.jpg").write_text("not an image")
    bad = lgvit("train", *FAST, "--epochs", "1", "--data", "imagefolder", "--data-dir",
                str(tmp_path / "d"), "--out", str(tmp_path / "r2"), *cache)  # fmt: skip
    one_line_error(bad, "unreadable")


def test_eval_head_mismatch_is_clear(tmp_path):
    run = tmp_path / "r"
    p = lgvit("train", *FAST, "--data", "synthetic", "--epochs", "1", "--out", str(run),
              "--set", "num_classes=5")  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    ev = lgvit("eval", "--checkpoint", str(run / "last"), "--data", "digits")
    one_line_error(ev, "5-class head", "10 classes")
    one_line_error(lgvit("eval", "--checkpoint", str(tmp_path / "nope"), "--data", "digits"),
                   "nope")  # fmt: skip


def test_architecture_keys_travel_with_the_checkpoint(tmp_path):
    # A ViT trained on small images with small patches: eval must rebuild the same patching.
    run = tmp_path / "vit"
    p = lgvit("train", "--model", "deit_tiny", "--img-size", "16", "--batch-size", "64",
              "--data", "synthetic", "--epochs", "1", "--out", str(run), "--set", "patch_size=4",
              "--set", "log_every=1000")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    # --amp auto: the precision the run evaluated in (eval's default is fp32)
    ev = lgvit("eval", "--checkpoint", str(run / "last"), "--data", "synthetic", "--json",
               "--amp", "auto")  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["acc1"] == pytest.approx(metrics(run)[-1]["test_acc1"], abs=1e-3)
    bad = lgvit("train", "--model", "lsa_micro_cifar", "--data", "synthetic", "--epochs", "1",
                "--out", str(tmp_path / "bad"), "--set", "window_size=4")  # fmt: skip
    one_line_error(bad, "window_size")
