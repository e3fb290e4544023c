"""A run directory written by lgvit before the training module was split (commit 73d5263, the
last one with the single `train.py`) holds the same training state as one today's code writes at
the same step, resumes mid-epoch with today's code, and its checkpoints load for eval.

The old code is taken from the repository's own history (``git archive``), so the fixture is
exactly what that commit writes, and no weights are committed.

Exact equality holds for everything but float values (RNG streams, the augmentation stream, the
position in the epoch, the optimizer's structure and hyper-parameters, the config): that is what
a reader could misread. The old run's q + kv weights and optimizer states are compared as a
resume fits them to today's one ``qkv`` parameter. Float values differ in rounding, because the
model's arithmetic may change between versions (fusing the query and key/value projections into
one matmul changed the epoch-1 loss in the 4th decimal), so the resumed metrics are compared to
a run of today's code within that noise; that today's resume continues exactly is
tests/test_hardening.py's."""

from __future__ import annotations

import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from test_hardening import SYN
from test_train import ENV, lgvit, metrics

import lgvit as lg
from lgvit.checkpoints.files import load_checkpoint_pair
from lgvit.models.layers.attention import fuse_older_qkv
from lgvit.run.config import TrainConfig, config_to_dict
from lgvit.run.optim import fit_older_optimizer_state, param_groups

REPO = Path(__file__).resolve().parents[1]
BEFORE_SPLIT = "73d5263"


def _old_source(dest: Path) -> Path:
    git = ["git", "-C", str(REPO)]
    ok = subprocess.run([*git, "cat-file", "-e", f"{BEFORE_SPLIT}^{{commit}}"], capture_output=True)
    if ok.returncode != 0:
        pytest.skip(f"commit {BEFORE_SPLIT} is not in this clone's history (a shallow clone?)")
    archive = dest / "old.tar"
    subprocess.run([*git, "archive", "-o", str(archive), BEFORE_SPLIT, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "src"


def _cut_at_step_20(out: Path, cwd: Path, pythonpath: str | None = None) -> dict:
    env = {**ENV, "LGVIT_SIGTERM_AT_STEP": "20"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *SYN, "--epochs", "2", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    weights, state = load_checkpoint_pair(out / "last")
    assert state["extra"]["mid_epoch"]["batch"] == 4 and state["global_step"] == 20
    return {"weights": weights, "state": state}


def _same_state(old, new, path: str = "") -> None:
    """Equal in everything a reader interprets; float tensors equal in shape and dtype."""
    if isinstance(old, dict):
        assert isinstance(new, dict) and set(old) == set(new), (path, set(old) ^ set(new))
        for k in old:
            _same_state(old[k], new[k], f"{path}.{k}")
    elif isinstance(old, (list, tuple)):
        assert type(old) is type(new) and len(old) == len(new), path
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _same_state(a, b, f"{path}[{i}]")
    elif isinstance(old, torch.Tensor):
        assert (old.shape, old.dtype) == (new.shape, new.dtype), path
        if not old.dtype.is_floating_point:  # RNG states are uint8 tensors
            assert torch.equal(old, new), path
    elif isinstance(old, float):
        assert isinstance(new, float), path  # a loss sum: rounding
    else:
        assert old == new, (path, old, new)


def test_a_run_written_before_the_split_resumes_and_loads(tmp_path):
    old_src = _old_source(tmp_path)
    which = subprocess.run(
        [sys.executable, "-c", "import lgvit.train as t; print(t.__file__)"],
        capture_output=True, text=True, env={**ENV, "PYTHONPATH": str(old_src)}, cwd=tmp_path,
        check=True,
    )  # fmt: skip
    assert which.stdout.strip().startswith(str(old_src)), which.stdout  # the old code runs
    old = _cut_at_step_20(tmp_path / "old", tmp_path, str(old_src))
    new = _cut_at_step_20(tmp_path / "new", tmp_path)

    # Written before q/k/v were one ``qkv`` parameter: what a resume fits to the model (the
    # weights by the models' load hook, the optimizer's state in the engine) is today's layout.
    model = lg.create_model("lsa_micro_cifar")
    assert any(k.endswith(".attn.q.weight") for k in old["weights"])
    _same_state(fuse_older_qkv(model, old["weights"]), new["weights"], "weights")
    o, n = old["state"], new["state"]
    opt = torch.optim.AdamW(param_groups(model, n["config"]["weight_decay"]))
    assert o["optimizer"] != fit_older_optimizer_state(o["optimizer"], opt, model)
    o["optimizer"] = fit_older_optimizer_state(o["optimizer"], opt, model)
    added = set(n["config"]) - set(o["config"])  # keys added since: at their defaults
    defaults = config_to_dict(TrainConfig())
    assert {k: n["config"][k] for k in added} == {k: defaults[k] for k in added}
    for s, run in ((o, "old"), (n, "new")):
        s["config"] = {k: v for k, v in s["config"].items() if k not in added}
        assert s["config"].pop("out") == str(tmp_path / run)
        for h in s["extra"]["history"]:  # timings and metrics of the finished epoch
            for k in ("train_loss", "test_loss", "test_acc1", "test_acc5", "img_per_s",
                      "epoch_time_s"):  # fmt: skip
                h[k] = float(h[k])
    # Recorded since (a resume compares them with today's data): the split's size, the steps.
    assert (n["extra"].pop("train_images"), n["extra"].pop("steps_per_epoch")) == (512, 16)
    _same_state(o, n, "state")

    for run in ("old", "new"):  # both continued by today's code
        r = lgvit("train", "--out", str(tmp_path / run), "--resume", "auto")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout and "at epoch 2 step 4/16" in r.stdout
    a, b = metrics(tmp_path / "old"), metrics(tmp_path / "new")
    assert [m["epoch"] for m in a] == [m["epoch"] for m in b] == [0, 1]
    for ma, mb in zip(a, b, strict=True):
        assert abs(ma["train_loss"] - mb["train_loss"]) < 2e-3, (ma, mb)
        assert abs(ma["test_loss"] - mb["test_loss"]) < 2e-3, (ma, mb)
        assert abs(ma["test_acc1"] - mb["test_acc1"]) <= 100 * 3 / 128, (ma, mb)  # 3 images

    e = lgvit("eval", "--checkpoint", str(tmp_path / "old" / "last"), "--data", "synthetic",
              "--json")  # fmt: skip
    assert e.returncode == 0, e.stderr[-2000:]
    model = lg.create_model("lsa_micro_cifar", checkpoint_path=str(tmp_path / "old" / "last"))
    assert model.pretrained_cfg["input_size"] == (3, 16, 16)
