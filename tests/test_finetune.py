"""Fine-tuning from released weights by name: ``--initial-checkpoint lit_ti.in1k_authors``
starts exactly where the same file given by path does (head reset to the data's classes,
position tables resized to the run's size)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train import ENV

import lgvit
from lgvit.models.download import ENV_DIR
from lgvit.models.weights import find_weights

RUN = ["--model", "lit_ti", "--data", "synthetic", "--img-size", "32", "--iters", "1",
       "--batch-size", "8", "--set", "log_every=1000", "--set", "drop_path=0",
       "--amp", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The weights cache holding lit_ti's file, as if it had been downloaded by hand."""
    folder = tmp_path_factory.mktemp("weights")
    w = find_weights("lit_ti.in1k_authors")
    torch.manual_seed(1)
    torch.save({"model": lgvit.create_model("lit_ti").state_dict()}, folder / w.filename)
    return folder, folder / w.filename


def _train(out, start, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *RUN, "--initial-checkpoint", start,
         "--out", str(out)], capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


def test_a_released_name_starts_as_its_file_does(cache, tmp_path):
    folder, file = cache
    env = {**ENV, ENV_DIR: str(folder)}
    by_name = _train(tmp_path / "name", "lit_ti.in1k_authors", env)
    assert by_name.returncode == 0, by_name.stderr[-2000:]
    by_file = _train(tmp_path / "file", str(file), env)
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    log = (tmp_path / "name" / "train.log").read_text()
    assert f"started from the weights of {file} (its head for another class count dropped)" in log
    a = load_file(tmp_path / "name" / "last.safetensors")
    b = load_file(tmp_path / "file" / "last.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert a["head.weight"].shape[0] == 10  # the data's classes, not ImageNet's 1000


def test_a_released_name_of_another_model_is_one_line(cache, tmp_path):
    folder, _ = cache
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", "--model", "lsa_micro_cifar", "--data",
         "synthetic", "--iters", "1", "--initial-checkpoint", "lit_ti.in1k_authors", "--out",
         str(tmp_path / "x")], capture_output=True, text=True,
        env={**ENV, ENV_DIR: str(folder)}, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "lgvit train: error: lit_ti.in1k_authors are the weights of lit_ti, but --model "
        "lsa_micro_cifar was given"
    )


def test_the_shipped_fine_tuning_config_starts_from_the_released_weights(cache, tmp_path):
    """``--config cifar10_lit_ti_finetune`` (on small synthetic data here): the released
    weights by name, the head reset, layer-wise decay in the optimizer's groups."""
    folder, file = cache
    out = tmp_path / "ft"
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", "--config", "cifar10_lit_ti_finetune",
         "--data", "synthetic", "--img-size", "32", "--iters", "1", "--batch-size", "8",
         "--amp", "none", "--out", str(out)],
        capture_output=True, text=True, env={**ENV, ENV_DIR: str(folder)}, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"started from the weights of {file} (its head for another class" in p.stdout
    state = torch.load(out / "last.state.pt", weights_only=True)["train_state"]
    scales = {round(g["lr_scale"], 9) for g in state["optimizer"]["param_groups"]}
    assert min(scales) < 0.01 and max(scales) == 1.0  # 0.65 ** (layers above), down the model
