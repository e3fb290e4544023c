"""Dense tasks you can trust (issue 36): the printed resume command resumes any task's run,
nothing a command writes overwrites another of its outputs, an evaluation that fails keeps the
epoch it evaluates, and flags, checkpoints or values a command cannot honour are one line."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from det_fixtures import write_coco_set
from seg_fixtures import write_seg_set
from test_detection import DET_TRAIN
from test_segmentation import SEG_TRAIN

from lgvit.cli import main


@pytest.fixture(scope="module")
def seg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seg_set(tmp_path_factory.mktemp("seg") / "data", n_train=16, n_val=4)


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 10 training images, the last 2 empty (left out): 8 at batch 4 = 2 steps an epoch.
    return write_coco_set(tmp_path_factory.mktemp("coco"), n_train=10, n_val=4, size=(32, 48))


def one_line(capsys: pytest.CaptureFixture, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------- item 8: resume any task


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_sigterm_then_resume_auto_with_only_out_matches_an_uninterrupted_run(
    task, seg_root, coco_root, tmp_path, capsys, monkeypatch
):
    """The command printed after SIGTERM (``lgvit train --out RUN --resume auto``, nothing
    else) resumes a dense run -- it once failed with ``unknown dataset``, the task being
    classification's by default -- and ends with the uninterrupted run's metrics."""
    from lgvit.checkpoint import load_weights

    if task == "segmentation":  # 16 images at batch 8: 2 steps an epoch
        base = [*SEG_TRAIN, "--data-dir", str(seg_root), "--epochs", "2"]
        keys, steps = ("train_loss", "test_mIoU", "test_mAcc", "test_aAcc"), 2
    else:  # 8 kept images (6 wide, 2 tall) in batches of one orientation: 4 steps an epoch
        base = [*DET_TRAIN, "--data-dir", str(coco_root), "--epochs", "2", "--batch-size", "2",
                "--set", "warmup_iters=2"]  # fmt: skip
        keys, steps = ("train_loss", "test_bbox_AP", "test_bbox_AP50"), 4
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main([*base, "--out", str(full)]) == 0
    monkeypatch.setenv("LGVIT_SIGTERM_AT_STEP", str(steps + 1))  # epoch 2, step 1
    code = main([*base, "--out", str(cut)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM and len(err) == 1, err
    command = err[0].split("Continue with: ", 1)[1].split()
    assert command == ["lgvit", "train", "--out", str(cut), "--resume", "auto"]
    monkeypatch.delenv("LGVIT_SIGTERM_AT_STEP")
    assert main(command[1:]) == 0, capsys.readouterr().err
    assert f"at epoch 2 step 1/{steps}" in (cut / "train.log").read_text()
    a, b = history(full), history(cut)
    assert len(a) == len(b) == 2
    for key in keys:
        assert [m[key] for m in a] == [m[key] for m in b], key
    wa, wb = load_weights(full / "last"), load_weights(cut / "last")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
