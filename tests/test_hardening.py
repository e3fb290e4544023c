"""Training that survives real use: one owner per run directory, preemption mid-epoch, write
errors while saving, resumes that would change the run, odd sizes and values, the timm command
line, fine-tuning starts, predict/eval edge cases (each case once failed or misbehaved)."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import NanBatches
from PIL import Image
from test_train import ENV, FAST, _folder, lgvit, metrics, one_line_error

from lgvit.checkpoints.files import load_checkpoint_pair
from lgvit.core.errors import LgvitError

SYN = [*FAST, "--data", "synthetic"]  # 512 images, batch 32: 16 steps per epoch


def _run(tmp_path, name, *args, **kw):
    p = lgvit("train", *SYN, "--out", str(tmp_path / name), *args, **kw)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp_path / name, p


def test_resume_that_changes_the_run_is_refused_and_changes_nothing(tmp_path):
    run, _ = _run(tmp_path, "r", "--epochs", "1")
    before = {f: (run / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    for flag, value in (("--img-size", "8"), ("--model", "lsa_tiny_cifar"), ("--data", "digits")):
        p = lgvit("train", *SYN, "--epochs", "2", "--out", str(run), "--resume", "auto",
                  flag, value)  # fmt: skip
        one_line_error(p, "the run trained with", "--initial-checkpoint")
    assert {f: (run / f).read_bytes() for f in before} == before
    assert not (run / ".lock").exists()


def test_a_run_directory_has_one_owner(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    lock = run / ".lock"
    host = socket.gethostname()
    lock.write_text(json.dumps({"pid": os.getpid(), "host": host, "started": 0}))  # alive
    one_line_error(lgvit("train", *SYN, "--epochs", "1", "--out", str(run)), "in use by another")
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
    one_line_error(lgvit("train", *SYN, "--epochs", "1", "--out", str(run)), "delete")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": host, "started": 0}))
    (run / ".last.state.pt.tmp-4242").write_bytes(b"x" * 100)  # an interrupted save's leftover
    _, p = _run(tmp_path, "r", "--epochs", "1")
    assert f"took over the lock of pid {dead.pid}" in p.stdout
    assert "removed 1 temp file(s) of interrupted saves" in p.stdout
    assert not lock.exists() and not list(run.glob(".*.tmp-*"))


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, no kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_failing_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    run, _ = _run(tmp_path, "r", "--epochs", "1")
    # The next save hits a file-size limit (a real write error, as a full disk gives).
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *SYN, "--epochs", "2", "--out", str(run),
         "--resume", "auto"],
        capture_output=True, text=True, env=ENV, timeout=300,
        preexec_fn=_limit_file_size(1 << 20),
    )  # fmt: skip
    one_line_error(p, f"saving the checkpoint to {run} failed", "File too large", "is kept")
    weights, state = load_checkpoint_pair(run / "last")
    assert state["epoch"] == 0 and weights
    assert not list(run.glob(".*.tmp-*")) and not (run / ".lock").exists()


def test_sigterm_mid_epoch_then_resume_matches_an_uninterrupted_run(tmp_path):
    args = ["--epochs", "2"]
    full, _ = _run(tmp_path, "full", *args)
    cut = tmp_path / "cut"
    p = lgvit("train", *SYN, *args, "--out", str(cut),
              env={**ENV, "LGVIT_SIGTERM_AT_STEP": "20"})  # fmt: skip
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "stopped by SIGTERM at epoch 2 step 4/16" in err[0], p.stderr
    assert f"lgvit train --out {cut} --resume auto" in err[0]
    _, state = load_checkpoint_pair(cut / "last")
    assert state["extra"]["mid_epoch"]["batch"] == 4 and state["global_step"] == 20
    r = lgvit("train", "--out", str(cut), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at epoch 2 step 4/16" in r.stdout
    a, b = metrics(full), metrics(cut)
    for key in ("train_loss", "test_acc1", "test_acc5", "test_loss"):
        assert [m[key] for m in a] == [m[key] for m in b], key


def test_ctrl_c_saves_mid_epoch_too(tmp_path):
    cut = tmp_path / "cut"
    p = lgvit("train", *SYN, "--epochs", "2", "--out", str(cut),
              env={**ENV, "LGVIT_SIGINT_AT_STEP": "7"})  # fmt: skip
    assert p.returncode == 128 + signal.SIGINT, p.stderr[-2000:]
    assert "stopped by SIGINT at epoch 1 step 7/16" in p.stderr
    _, state = load_checkpoint_pair(cut / "last")
    assert state["extra"]["mid_epoch"]["batch"] == 7 and state["epoch"] == 0


def test_periodic_checkpoints_eval_every_and_save_every(tmp_path):
    run, p = _run(tmp_path, "r", "--epochs", "3", "--set", "save_every_steps=6",
                  "--set", "eval_every=2", "--set", "save_every=2")  # fmt: skip
    log = (run / "train.log").read_text()
    for step in (6, 12):
        assert f"saved a mid-epoch checkpoint at epoch 1 step {step}" in log
    rows = metrics(run)
    assert ["test_acc1" in r for r in rows] == [False, True, True]  # epochs 2 and 3 (the last)
    _, state = load_checkpoint_pair(run / "last")
    assert state["epoch"] == 2 and "mid_epoch" not in state["extra"]


def test_bad_values_sizes_and_names_are_one_line(tmp_path):
    out = ["--out", str(tmp_path / "x"), "--epochs", "1"]
    one_line_error(lgvit("train", *SYN, *out, "--set", "lr=.inf"), "lr=inf", "finite")
    one_line_error(lgvit("train", *SYN, *out, "--lr", "nan"), "lr=nan", "finite")
    # Sizes a model cannot take fail before any data is read (the data dir does not exist).
    nodata = ["--data", "imagefolder", "--data-dir", str(tmp_path / "none"), *out]
    for model, size, needle in (
        ("lsa_tiny_cifar_swin_local", "30", "not divisible by the window"),
        ("lsa_tiny_cifar_c", "2", "total stride 8"),
        ("lsa_micro_cifar", "1", "total stride"),
    ):
        p = lgvit("train", "--model", model, "--img-size", size, *nodata)
        one_line_error(p, f"--img-size {size}", needle)
    one_line_error(lgvit("train", "--model", "lsa_mikro_cifar", *nodata), "did you mean lsa_micro")
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_warmup_longer_than_the_run_is_one_warning_line(tmp_path):
    run, p = _run(tmp_path, "r", "--epochs", "1", "--set", "warmup_epochs=5",
                  env={**ENV, "PYTHONWARNINGS": "default"})  # fmt: skip
    lines = [ln for ln in p.stderr.splitlines() if "warmup" in ln]
    assert len(lines) == 1 and lines[0].startswith("lgvit train: warning: warmup_epochs 5 >=")
    assert "UserWarning" not in p.stderr and "warnings.warn" not in p.stderr


def test_timm_flags_and_file_modes(tmp_path):
    run = tmp_path / "r"
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", "--model", "lsa_micro_cifar", "--img-size",
         "16", "--batch-size", "32", "--data", "synthetic", "--epochs", "1", "--out", str(run),
         "--lr", "1e-3", "--weight-decay", "0.01", "--warmup-epochs", "0", "--drop-path",
         "0.05", "--smoothing", "0.0", "--aa", "none", "--mixup", "0", "--cutmix", "0",
         "--reprob", "0", "--model-ema", "-j", "0", "--log-interval", "7", "--amp",
         "--device", "cpu", "--opt", "sgd", "--sched", "step"],
        capture_output=True, text=True, env=ENV, timeout=300,
        preexec_fn=lambda: os.umask(0o022),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    want = dict(lr=1e-3, weight_decay=0.01, warmup_epochs=0, drop_path=0.05, label_smoothing=0,
                rand_augment=None, mixup=0, cutmix=0, reprob=0, ema=True, workers=0,
                log_every=7, amp="auto", device="cpu", opt="sgd", sched="step")  # fmt: skip
    assert {k: cfg[k] for k in want} == want
    for f in ("last.safetensors", "last.state.pt", "best.safetensors", "last_ema.safetensors",
              "config.yaml", "metrics.jsonl"):  # fmt: skip
        assert (run / f).stat().st_mode & 0o777 == 0o644, f
    lamb, _ = _run(tmp_path, "lamb", "--epochs", "1", "--opt", "lamb")
    assert metrics(lamb)[0]["train_loss"] > 0
    helptext = lgvit("train", "--help").stdout
    assert "save_every_steps" in helptext and "offset_lr_factor" in helptext


def test_initial_checkpoint_finetunes_on_other_classes_and_size(tmp_path):
    src, _ = _run(tmp_path, "src", "--epochs", "1")  # 10 classes at 16px
    _folder(tmp_path / "d", {"train": ["a", "b", "c"], "val": ["a", "b", "c"]}, n=8)
    p = lgvit("train", "--model", "lsa_micro_cifar", "--img-size", "32", "--batch-size", "8",
              "--data", "imagefolder", "--data-dir", str(tmp_path / "d"), "--epochs", "1",
              "--out", str(tmp_path / "ft"), "--initial-checkpoint", str(src / "last"),
              "--set", f"cache_dir={tmp_path / 'cache'}")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"started from the weights of {src / 'last'} (its head for another class" in p.stdout


def test_predict_and_eval_edge_cases(tmp_path):
    _folder(tmp_path / "d", {"train": [f"c{i}" for i in range(10)],
                             "val": [f"c{i}" for i in range(10)]}, n=2)  # fmt: skip
    run = tmp_path / "r"
    p = lgvit("train", *FAST, "--data", "imagefolder", "--data-dir", str(tmp_path / "d"),
              "--epochs", "1", "--batch-size", "4", "--out", str(run),
              "--set", f"cache_dir={tmp_path / 'cache'}")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = str(run / "last")
    one_line_error(lgvit("predict", "--checkpoint", ckpt, "--topk", "-1", "x.png"), "--topk -1")
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(2):
        Image.new("RGB", (20, 20), (60 * i, 20, 90)).save(imgs / f"{i}.png")
    ok = lgvit("predict", "--checkpoint", ckpt, str(imgs), "--json")
    assert ok.returncode == 0, ok.stderr
    assert [r["image"] for r in json.loads(ok.stdout)] == [str(imgs / "0.png"), str(imgs / "1.png")]
    (imgs / "broken.png").write_bytes(b"not a png")
    some = lgvit("predict", "--checkpoint", ckpt, str(imgs), "--json")
    assert some.returncode == 1 and len(json.loads(some.stdout)) == 2
    assert some.stderr.count("\n") == 1 and "broken.png" in some.stderr
    # Same class count, other class names: evaluating would report a meaningless accuracy.
    ev = lgvit("eval", "--checkpoint", ckpt, "--data", "digits")
    one_line_error(ev, "trained on classes [c0, c1, c2, ...]", "--any-classes")
    assert lgvit("eval", "--checkpoint", ckpt, "--data", "digits", "--any-classes").returncode == 0


@pytest.mark.parametrize("key", ["eval_every", "save_every_steps"])
def test_new_keys_validate(key, tmp_path):
    one_line_error(lgvit("train", *SYN, "--out", str(tmp_path), "--set", f"{key}=-1"), key)


# ----------------------------------------------------------------- no host sync per step


def _epoch(one_epoch, monkeypatch, bad: set[int], on_device: bool, max_nonfinite: int = 5):
    from lgvit.run import nonfinite
    from lgvit.run.config import TrainConfig

    monkeypatch.setattr(nonfinite, "skips_on_device", lambda *a: on_device)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    # A constant rate: a step skipped on the device still advances the schedule.
    cfg = TrainConfig(epochs=1, log_every=2, max_nonfinite=max_nonfinite, clip_grad=None,
                      sched="none")  # fmt: skip
    schedule = dict(total_steps=4, warmup_steps=0, cfg=cfg, base_lr=0.1)
    seen = []
    hook = lambda *a: seen.append(model.weight.detach().clone())  # noqa: E731
    opt.register_step_post_hook(hook)
    out = one_epoch(model, NanBatches(4, bad), opt, cfg, schedule=schedule)
    return out, seen, opt


def test_a_nonfinite_loss_skips_the_fused_step_on_the_device(one_epoch, monkeypatch):
    """The GPU path (forced here on the CPU): no host check per step; the fused AdamW step
    reads `found_inf` and leaves the weights and its state as they were."""
    import warnings

    with warnings.catch_warnings(record=True):
        (loss_host, _, _), w_host, opt_host = _epoch(one_epoch, monkeypatch, {1}, on_device=False)
    (loss_dev, _, _), w_dev, opt_dev = _epoch(one_epoch, monkeypatch, {1}, on_device=True)
    assert len(w_host) == 3 and len(w_dev) == 4  # the host skips the call; the kernel skips
    torch.testing.assert_close(w_dev[1], w_dev[0], rtol=0, atol=0)  # the NaN step: no change
    # ... and the run goes on as the host-checked one does, to the same weights and loss.
    torch.testing.assert_close(w_dev[-1], w_host[-1])
    assert loss_dev == pytest.approx(loss_host)
    steps = [s["step"] for s in opt_dev.state.values()]
    assert all(float(s) == 3 for s in steps)  # the skipped step is not counted by AdamW


def test_too_many_nonfinite_losses_stop_on_the_device_path_too(one_epoch, monkeypatch):
    from lgvit.run.engine import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match="2 non-finite losses by epoch 1 step 2"):
        _epoch(one_epoch, monkeypatch, {0, 1}, on_device=True, max_nonfinite=1)


def test_flip_test_time_augmentation_averages_the_mirrored_logits():
    from lgvit.core.runtime import Dist
    from lgvit.tasks.classification.evaluate import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 5, 3))
    x = torch.randn(10, 3, 4, 5)
    y = torch.arange(10) % 3
    batches = [(x[:6], y[:6]), (x[6:], y[6:])]
    with torch.no_grad():
        want = 0.5 * (model(x) + model(x.flip(-1)))  # mirrored left-right
    got = evaluate(model, batches, 3, Dist(), None, tta="flip")
    plain = evaluate(model, batches, 3, Dist(), None)
    acc = 100.0 * (want.argmax(1) == y).double().mean().item()
    assert got["acc1"] == pytest.approx(acc)
    assert got["loss"] == pytest.approx(torch.nn.functional.cross_entropy(want, y).item())
    assert got["loss"] != pytest.approx(plain["loss"])
    with pytest.raises(LgvitError, match="tta='crop'"):
        evaluate(model, batches, 3, Dist(), None, tta="crop")


def test_flip_translate_tta_averages_six_views():
    from lgvit.core.runtime import Dist
    from lgvit.tasks.classification.evaluate import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 5, 3))
    x = torch.randn(10, 3, 4, 5)
    y = torch.arange(10) % 3

    def shifted(img, dy, dx):  # out[i, j] = img[i + dy, j + dx], reflected at the border
        def idx(n, d):
            i = torch.arange(n) + d
            return torch.where(i < 0, -i, torch.where(i >= n, 2 * (n - 1) - i, i))

        return img[..., idx(img.shape[-2], dy), :][..., idx(img.shape[-1], dx)]

    with torch.no_grad():
        pair = [
            0.5 * (model(v) + model(v.flip(-1))) for v in (x, shifted(x, -1, -1), shifted(x, 1, 1))
        ]
        want = 0.5 * pair[0] + 0.25 * (pair[1] + pair[2])
    got = evaluate(model, [(x[:6], y[:6]), (x[6:], y[6:])], 3, Dist(), None, tta="flip-translate")
    assert got["loss"] == pytest.approx(torch.nn.functional.cross_entropy(want, y).item())
    assert got["acc1"] == pytest.approx(100.0 * (want.argmax(1) == y).double().mean().item())
