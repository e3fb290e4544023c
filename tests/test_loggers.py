"""The run's curves in TensorBoard and W&B (read back from their files), and the kept best
epochs (``keep_best``) that ``lgvit average`` reads, through ``lgvit train``."""

from __future__ import annotations

import glob
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import ENV, FAST, metrics

from lgvit.cli import main
from lgvit.run.kept import kept_checkpoints

# 512 synthetic images / batch 32: 16 steps an epoch
RUN = [*FAST, "--data", "synthetic", "--set", "log_every=4"]


def _train(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *RUN, "--out", str(out), *args],
        capture_output=True, text=True, env=env or ENV, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _tb_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_curves_continue_on_resume(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    run = tmp_path / "tb"
    _train(run, "--epochs", "2", "--set", "log_to=[tensorboard]")
    _train(run, "--epochs", "3", "--resume", "auto")
    rows = metrics(run)
    got = _tb_scalars(run / "tensorboard")
    # one point per epoch at its last step (16 steps an epoch), equal to metrics.jsonl
    assert [s for s, _ in got["test/acc1"]] == [16, 32, 48]
    assert [v for _, v in got["test/acc1"]] == pytest.approx([r["test_acc1"] for r in rows])
    assert [v for _, v in got["train/loss"]] == pytest.approx([r["train_loss"] for r in rows])
    # every log_every steps: the step's loss and lr, on both sides of the resume
    assert [s for s, _ in got["train/lr"]] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48]


def _wandb_records(run_file: str) -> list:
    """The records of an offline W&B run file (a LevelDB-style log of protobuf records)."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    data, pos, block, buf, out = Path(run_file).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def test_wandb_offline_logs_the_epochs_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "wb"
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    _train(run, "--epochs", "2", "--set", "log_to=[wandb]", "--set", "wandb_project=t", env=env)
    _train(run, "--epochs", "3", "--resume", "auto", env=env)
    run_id = (run / "wandb_id").read_text()
    files = sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    acc1 = {}
    for f in files:
        for r in _wandb_records(f):
            if r.WhichOneof("record_type") == "run":
                assert r.run.run_id == run_id and r.run.project == "t"
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in r.history.item}  # fmt: skip
                if "test/acc1" in items:
                    acc1[items["_step"]] = items["test/acc1"]
    assert acc1 == pytest.approx({16: metrics(run)[0]["test_acc1"], 32: metrics(run)[1][
        "test_acc1"], 48: metrics(run)[2]["test_acc1"]})  # fmt: skip


@pytest.mark.parametrize("package", ["wandb", "torch.utils.tensorboard"])
def test_a_missing_logger_package_is_one_line_before_anything_is_written(
    package, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    name = "wandb" if package == "wandb" else "tensorboard"
    out = tmp_path / "x"
    argv = ["train", *RUN, "--epochs", "1", "--set", f"log_to=[{name}]", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"lgvit train: error: log_to {name} needs the {name} package: pip install "
                   f"'lgvit[{name}]'\n")  # fmt: skip
    assert not out.exists()


def test_keep_best_keeps_the_best_epochs_for_averaging(tmp_path, capsys):
    run = tmp_path / "kb"
    _train(run, "--epochs", "4", "--set", "keep_best=2", "--model-ema", "--set", "lr=2e-3")
    rows = metrics(run)
    best = sorted(rows, key=lambda r: -r["test_ema_acc1"])[:2]  # with an EMA, ranked by it
    kept = kept_checkpoints(run)
    assert [r["epoch"] for r in kept] == [r["epoch"] for r in best]
    assert [r["metric"] for r in kept] == [r["test_ema_acc1"] for r in best]
    assert all(r["weights"].is_file() and r["ema"].is_file() for r in kept)
    assert len(list((run / "kept").glob("*.safetensors"))) == 4  # nothing else left
    avg = tmp_path / "avg.safetensors"
    assert main(["average", str(run), "--best", "2", "--out", str(avg)]) == 0
    assert main(["eval", "--checkpoint", str(avg), "--data", "synthetic"]) == 0
    assert "top-1" in capsys.readouterr().out
