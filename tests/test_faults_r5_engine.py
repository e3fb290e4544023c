"""Faults and bad input, round five: the engine and the streaming loaders' reporting. A resume
after the data changed size (no 0-step epoch, one line saying what changed), samples the
streamed sources leave out (counted per epoch in stdout, ``train.log`` and ``metrics.jsonl``),
an accumulation window longer than the epoch, ``lgvit eval --amp`` bare, a seed that fixes a
fine-tuning run whatever the weights cache holds, and timm reading an lgvit folder of one of
its own architectures."""

from __future__ import annotations

import json

import torch

import lgvit
from lgvit.cli import main
from lgvit.core.runtime import precision_name, resolve_amp


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------ 14: eval --amp bare


def test_eval_takes_a_bare_amp_as_train_does(tmp_path, capsys):
    torch.manual_seed(0)
    model = lgvit.create_model("lsa_micro_cifar", num_classes=10, img_size=16)
    torch.save(model.state_dict(), tmp_path / "m.pth")
    base = ["eval", "--checkpoint", str(tmp_path / "m.pth"), "--model", "lsa_micro_cifar",
            "--img-size", "16", "--data", "synthetic", "--batch-size", "256"]  # fmt: skip
    auto = precision_name(resolve_amp("auto", torch.device("cpu")))
    for args in ([*base, "--json", "--amp"], [*base, "--amp", "--json"]):
        code, out, err = _cli(capsys, *args)
        assert code == 0, err
        assert json.loads(out)["precision"] == auto  # bare: auto, as train's --amp
    code, out, err = _cli(capsys, *base, "--json")
    assert code == 0 and json.loads(out)["precision"] == precision_name(None)  # default: fp32
