"""A run directory written by lgvit before the training module was split (commit 73d5263, the
last one with the single `train.py`) resumes mid-epoch with today's code to the metrics of an
uninterrupted run of today's code, and its checkpoints load for eval.

The old code is taken from the repository's own history (``git archive``), so the fixture is
exactly what that commit writes, and no weights are committed."""

from __future__ import annotations

import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_hardening import SYN, _run
from test_train import ENV, lgvit, metrics

import lgvit as lg
from lgvit.checkpoint import load_checkpoint_pair

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


def test_a_run_written_before_the_split_resumes_and_loads(tmp_path):
    old_src = _old_source(tmp_path)
    cut = tmp_path / "cut"
    env = {**ENV, "PYTHONPATH": str(old_src), "LGVIT_SIGTERM_AT_STEP": "20"}
    which = subprocess.run(
        [sys.executable, "-c", "import lgvit.train as t; print(t.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert which.stdout.strip().startswith(str(old_src)), which.stdout  # the old code runs
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *SYN, "--epochs", "2", "--out", str(cut)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    _, state = load_checkpoint_pair(cut / "last")
    assert state["extra"]["mid_epoch"]["batch"] == 4 and state["global_step"] == 20

    r = lgvit("train", "--out", str(cut), "--resume", "auto")  # today's code
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at epoch 2 step 4/16" in r.stdout
    full, _ = _run(tmp_path, "full", "--epochs", "2")
    a, b = metrics(full), metrics(cut)
    for key in ("train_loss", "test_acc1", "test_acc5", "test_loss"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    e = lgvit("eval", "--checkpoint", str(cut / "last"), "--data", "synthetic", "--json")
    assert e.returncode == 0, e.stderr[-2000:]
    model = lg.create_model("lsa_micro_cifar", checkpoint_path=str(cut / "last"))
    assert model.pretrained_cfg["input_size"] == (3, 16, 16)
