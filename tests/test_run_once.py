"""The run reads what it resumes once: the checkpoint's record, which says the run's task and
its classes, is read where the run is resolved and handed to the engine."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from test_train import FAST

import lgvit.checkpoints.files
from lgvit.cli import main

SYN = ["train", *FAST, "--data", "synthetic", "--amp", "none"]


def _train(args: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warm-up as long as a 2-step run
        assert main(args) == 0


def test_resume_reads_the_record_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    run = tmp_path / "run"
    _train([*SYN, "--iters", "2", "--out", str(run)])
    capsys.readouterr()
    reads: list[Path] = []
    load_metadata = lgvit.checkpoints.files.load_metadata

    def counting(path):  # the header reader behind every load_record, wherever imported
        reads.append(Path(path))
        return load_metadata(path)

    monkeypatch.setattr(lgvit.checkpoints.files, "load_metadata", counting)
    _train(["train", "--out", str(run), "--resume", "auto", "--iters", "4"])
    assert "resumed from" in capsys.readouterr().out
    assert reads == [lgvit.checkpoints.files.checkpoint_paths(run / "last")[0]]
