"""``--channels-last`` (timm's flag) on train, eval and bench: the model's convolutions and the
batches in NHWC, with the results of the default layout."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import FAST, metrics

from lgvit.cli import main
from lgvit.tasks.classification.train import ClassificationTask

RUN = [*FAST, "--data", "synthetic", "--iters", "3", "--amp", "none", "--set", "drop_path=0"]


def _nhwc(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same short run in each layout, recording what the model and batches were in."""
    seen = {}
    loss = ClassificationTask.loss

    def spy(self, model, batch, epoch, d, amp):
        conv = dict(model.named_parameters())["stages.1.downsample.conv.weight"]
        seen.setdefault(self.cfg.channels_last, (conv.detach().clone(), []))[1].append(
            batch[0].shape)  # fmt: skip
        return loss(self, model, batch, epoch, d, amp)

    mp = pytest.MonkeyPatch()
    mp.setattr(ClassificationTask, "loss", spy)
    root = tmp_path_factory.mktemp("cl")
    try:
        for flag in ([], ["--channels-last"]):
            out = root / ("nhwc" if flag else "nchw")
            assert main(["train", *RUN, *flag, "--out", str(out)]) == 0
    finally:
        mp.undo()
    return root, seen


def test_training_in_channels_last_matches_the_default_layout(runs):
    root, seen = runs
    assert _nhwc(seen[True][0]) and not _nhwc(seen[False][0])
    a, b = metrics(root / "nchw")[-1], metrics(root / "nhwc")[-1]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-4)


def test_the_loss_gets_nhwc_batches():
    task = ClassificationTask()

    class Cfg:
        channels_last, train_size_start = True, None

    task.cfg = Cfg()
    got = []

    def model(x):
        got.append(_nhwc(x))
        return x.mean((2, 3))

    from lgvit.core.runtime import Dist

    task.loss(model, (torch.randn(2, 3, 8, 8), torch.tensor([0, 1])), 0, Dist(), None)
    assert got == [True]


def test_eval_in_channels_last_gives_the_same_result(runs, capsys):
    root, _ = runs
    res = []
    for flag in ([], ["--channels-last"]):
        argv = ["eval", "--checkpoint", str(root / "nchw" / "last"), "--data", "synthetic"]
        assert main([*argv, *flag, "--json"]) == 0
        out = capsys.readouterr().out
        res.append(json.loads(out[out.index("{") :]))
    assert res[1]["acc1"] == res[0]["acc1"]
    assert res[1]["loss"] == pytest.approx(res[0]["loss"], rel=1e-5)


def test_bench_measures_channels_last(capsys):
    argv = ["bench", "lsa_micro_cifar", "--img-size", "16", "--batch-size", "4", "--rounds",
            "1", "--no-memory", "--format", "json", "--quiet", "--channels-last"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["options"]["channels_last"] is True
    assert result["rows"][0]["error"] is None
