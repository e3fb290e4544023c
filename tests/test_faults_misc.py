"""Faults and bad input, round two (issue 28), the "unclear or surprising" list: a signal after
a run's last step, a finished run resumed, a full disk while saving, export's --img-size and
--opset and what a failed export leaves, a ``.pth`` that would run code, an empty batch of an
LSA model, and model arguments and inputs that built or ran something wrong."""

from __future__ import annotations

import argparse
import errno
import io
import os
import signal
import types
import warnings

import pytest
import torch
from test_train import FAST

from lgvit.checkpoints.files import load_weights, save_checkpoint
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.models import create_model
from lgvit.run.engine import Run

# ------------------------------------------------------------------- a signal, a finished run


def test_sigterm_after_the_last_step_finishes_the_run_and_a_resume_says_so(
    tmp_path, capsys, monkeypatch
):
    from lgvit.tasks.classification.train import ClassificationTask

    evaluate = ClassificationTask.evaluate

    def terminated_while_evaluating(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, during the final test
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(ClassificationTask, "evaluate", terminated_while_evaluating)
    run = tmp_path / "run"
    args = ["train", *FAST, "--data", "synthetic", "--iters", "2", "--out", str(run)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warmup longer than the run
        rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 0, err  # was 143: "stopped ... continue with --resume auto" for a done run
    assert "SIGTERM came after the last training step; the run is finished" in out
    assert "--resume" not in err
    monkeypatch.setattr(ClassificationTask, "evaluate", evaluate)
    assert main(["train", "--out", str(run), "--resume", "auto"]) == 0
    out, err = capsys.readouterr()
    assert f"{run}: the run is finished (epoch 1 of 1); nothing to do" in out, out


# ------------------------------------------------------------------------ a full disk, saving


class _FullDisk(io.BytesIO):
    """A file on a disk that is full after its first 64 bytes."""

    def write(self, data) -> int:
        if self.tell() + len(data) > 64:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def _save_on_a_full_disk(stem, monkeypatch) -> Exception:
    import lgvit.checkpoints.files as ck

    monkeypatch.setattr(ck, "writing_to", lambda fn: lambda tmp: fn(_FullDisk()))
    with pytest.raises(RuntimeError, match="enforce fail") as e:  # how torch.save reports it
        save_checkpoint(stem, {"w": torch.zeros(3)}, {"epoch": 0})
    monkeypatch.undo()
    return e.value


def _run_save_error(out, failed) -> str:
    """The error of the run's save (engine.Run.save) when writing failed with ``failed``."""

    def write(*args):
        raise failed

    this = types.SimpleNamespace(out=out, history=[], _write=write)
    with pytest.raises(LgvitError) as e:
        Run.save(this, 0, 1, False)
    msg = str(e.value)
    assert "\n" not in msg and f"saving the checkpoint to {out} failed" in msg, msg
    return msg


def test_a_full_disk_while_saving_says_so_and_whether_a_checkpoint_is_kept(tmp_path, monkeypatch):
    msg = _run_save_error(tmp_path, _save_on_a_full_disk(tmp_path / "last", monkeypatch))
    assert "no space left on device" in msg and "inline_container" not in msg, msg
    assert "no checkpoint had been saved there yet" in msg and "is kept" not in msg, msg
    # With a checkpoint there, it is kept (and says so).
    save_checkpoint(tmp_path / "last", {"w": torch.ones(3)}, {"epoch": 0})
    msg = _run_save_error(tmp_path, _save_on_a_full_disk(tmp_path / "last", monkeypatch))
    assert "no space left on device; the previous checkpoint there is kept" in msg, msg
    assert torch.equal(load_weights(tmp_path / "last")["w"], torch.ones(3))


# --------------------------------------------------------------------------------- export


@pytest.fixture
def ex():
    pytest.importorskip("onnxruntime", reason="the export extra is not installed")
    pytest.importorskip("onnxscript", reason="the export extra is not installed")
    import lgvit.tools.export

    return lgvit.tools.export


def test_export_refuses_img_size_0_and_opsets_out_of_range(ex, tmp_path):
    out = tmp_path / "m.onnx"
    cases = [({"img_size": 0}, "--img-size 0: must be"), ({"opset": 1}, "--opset 1: torch's"),
             ({"opset": 99999}, "--opset 99999: torch's")]  # fmt: skip
    for kwargs, needle in cases:
        with pytest.raises(LgvitError, match=needle) as e:
            ex.export("lsa_micro_cifar", "onnx", str(out), log=lambda m: None, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(LgvitError, match="--opset 18: an ONNX opset, for --format onnx only"):
        ex.export("lsa_micro_cifar", "pt2", str(tmp_path / "m.pt2"), opset=18)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:.*random weights")
def test_a_failed_parity_check_leaves_no_file_and_keeps_an_older_one(ex, tmp_path, monkeypatch):
    out = tmp_path / "m.onnx"
    out.write_bytes(b"an earlier export")
    monkeypatch.setattr(ex, "TOLERANCE", -1.0)
    with pytest.raises(LgvitError, match=r"differ from eager .*; nothing written"):
        ex.export("lsa_micro_cifar", "onnx", str(out), img_size=16, log=lambda m: None)
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temp file either
    assert out.read_bytes() == b"an earlier export"


# --------------------------------------------------------------------- a .pth that runs code


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.remove, (self.path,))  # what loading it with pickle would do


def test_a_pth_that_would_run_code_says_so_and_does_not_run_it(tmp_path):
    canary = tmp_path / "canary"
    canary.write_text("still here")
    path = tmp_path / "theirs.pth"
    weights = {"w": torch.ones(2)}
    torch.save({"model": weights, "hook": _RunsCode(str(canary))}, path)
    with pytest.warns(UserWarning, match="holds code that would run when loaded") as w:
        assert torch.equal(load_weights(path)["w"], weights["w"])
    assert "remove" in str(w[0].message) and "lgvit did not run" in str(w[0].message)
    assert canary.exists()
    # An object that is only data of a class (a training script's Namespace) is no code.
    torch.save({"model": weights, "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.warns(UserWarning, match=r"left out objects that are not plain data \(args\)"):
        load_weights(path)


# ------------------------------------------------------------- models: batches and arguments


def test_an_lsa_model_takes_a_batch_of_no_images():
    model = create_model("lsa_micro_cifar", img_size=16, num_classes=10)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(torch.zeros(0, 3, 16, 16))  # training mode: nothing it holds moves
    assert out.shape == (0, 10)
    assert all(torch.equal(v, stats[k]) for k, v in model.state_dict().items())
    assert model.training
    maps = model.eval().forward_intermediates(torch.zeros(0, 3, 16, 16), intermediates_only=True)
    assert [m.shape[0] for m in maps] == [0] * len(maps) and all(m.ndim == 4 for m in maps)


def test_inputs_and_model_arguments_that_would_not_work_are_refused():
    model = create_model("lsa_micro_cifar", img_size=16, num_classes=10).eval()
    with pytest.raises(ValueError, match="expected a floating-point image batch, got uint8"):
        model(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="input is float64 but the model's weights are float32"):
        model(torch.zeros(1, 3, 16, 16, dtype=torch.float64))
    assert model.double()(torch.zeros(1, 3, 16, 16, dtype=torch.float64)).dtype == torch.float64
    for kwargs, needle in (
        (dict(img_size=32.0), "img_size 32.0: must be a positive int"),
        (dict(num_classes=-1), "num_classes -1: must be a whole number >= 0"),
        (dict(features_only=True, out_indices=()), r"out_indices=\(\) asks for no feature map"),
    ):
        with pytest.raises(LgvitError, match=needle) as e:
            create_model("lsa_micro_cifar", **kwargs)
        assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


def test_eval_and_predict_refuse_img_size_0(tmp_path, capsys):
    from PIL import Image

    import lgvit
    from lgvit.cli import main

    model = lgvit.create_model("lsa_micro_cifar", num_classes=10)
    torch.save(model.state_dict(), tmp_path / "m.pth")
    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")
    for args in (["predict", "--model", "lsa_micro_cifar", "--checkpoint", str(tmp_path / "m.pth"),
                  "--img-size", "0", str(tmp_path / "a.png")],
                 ["eval", "--model", "lsa_micro_cifar", "--checkpoint", str(tmp_path / "m.pth"),
                  "--img-size", "0", "--data", "synthetic"]):  # fmt: skip
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "img_size 0" in err[0], err
