"""``lgvit average`` (timm's avg_checkpoints.py) and the run's kept epochs it reads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image
from safetensors.torch import load_file
from test_train import ENV, FAST

import lgvit
from lgvit.checkpoints.files import load_metadata, save_checkpoint
from lgvit.checkpoints.run_layout import RunLayout
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.run.kept import keep_epoch, kept_checkpoints
from lgvit.tools.average import average_weights


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A trained checkpoint's record and three checkpoints of its model, weights perturbed."""
    root = tmp_path_factory.mktemp("avg")
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *FAST, "--data", "synthetic", "--epochs", "1",
         "--out", str(root / "run")], capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    base = load_file(root / "run" / "last.safetensors")
    meta = load_metadata(root / "run" / "last")
    g = torch.Generator().manual_seed(0)
    files = []
    for i in range(3):
        sd = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
              for k, v in base.items()}  # fmt: skip
        save_checkpoint(root / f"c{i}", sd, None, metadata=meta)
        files.append(root / f"c{i}.safetensors")
    return root, files


def test_the_average_equals_an_independent_mean(three):
    root, files = three
    out = root / "avg.safetensors"
    assert main(["average", *map(str, files), "--out", str(out)]) == 0
    got = load_file(out)
    states = [load_file(f) for f in files]
    for k, v in got.items():
        want = np.mean([s[k].double().numpy() for s in states], axis=0)
        np.testing.assert_allclose(v.double().numpy(), want, rtol=1e-6, atol=1e-7)
        assert v.dtype == states[0][k].dtype
    meta = load_metadata(out)
    assert meta["model"] == "lsa_micro_cifar" and "lgvit_pair_id" not in meta


def test_the_average_loads_in_eval_predict_export_and_create_model(three, capsys):
    root, files = three
    out = root / "avg2.safetensors"
    assert main(["average", *map(str, files), "--out", str(out)]) == 0
    assert main(["eval", "--checkpoint", str(out), "--data", "synthetic", "--json"]) == 0
    res = _json_tail(capsys)
    assert res["count"] > 0
    Image.new("RGB", (40, 30), (90, 20, 200)).save(root / "x.png")
    assert main(["predict", "--checkpoint", str(out), str(root / "x.png")]) == 0
    assert main(["export", str(out), "--format", "hf", "--out", str(root / "hf")]) == 0
    m = lgvit.create_model("lsa_micro_cifar", checkpoint_path=str(out))
    sd = load_file(out)
    torch.testing.assert_close(m.state_dict()["head.weight"], sd["head.weight"])


def _json_tail(capsys) -> dict:
    text = capsys.readouterr().out
    return json.loads(text[text.index("{") :])


def test_integer_buffers_from_the_last_floats_averaged():
    """BatchNorm: running mean/var averaged, num_batches_tracked from the last source."""
    nets = []
    for i in range(3):
        torch.manual_seed(i)
        net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        net.train()(torch.randn(8, 4) * (i + 1))
        for _ in range(i):
            net(torch.randn(8, 4))
        nets.append(net.state_dict())
    avg = average_weights(nets, ["a", "b", "c"])
    assert avg["1.num_batches_tracked"].item() == 3 == nets[2]["1.num_batches_tracked"].item()
    assert avg["1.num_batches_tracked"].dtype == torch.int64
    want = sum(n["1.running_var"].double() for n in nets) / 3
    torch.testing.assert_close(avg["1.running_var"], want.float())


def test_mismatched_checkpoints_are_one_line():
    a = {"w": torch.zeros(2, 3)}
    with pytest.raises(LgvitError, match=r"b: w has shape \(3, 2\), a \(2, 3\)"):
        average_weights([a, {"w": torch.zeros(3, 2)}], ["a", "b"])
    with pytest.raises(LgvitError, match=r"b: its weights differ from a's in \['v'\]"):
        average_weights([a, {"w": torch.zeros(2, 3), "v": torch.zeros(1)}], ["a", "b"])


def test_kept_epochs_the_best_n_atomically(tmp_path):
    w = {"w": torch.zeros(2)}
    scores = [50.0, 70.0, 60.0, 80.0, 55.0]
    for epoch, s in enumerate(scores):
        kept = keep_epoch(tmp_path, 2, epoch, s, {"w": torch.full((2,), s)}, w, {"model": "m"})
    assert kept == [3, 1]
    rows = kept_checkpoints(tmp_path)
    assert [(r["epoch"], r["metric"]) for r in rows] == [(3, 80.0), (1, 70.0)]
    assert load_file(rows[0]["weights"])["w"].tolist() == [80.0, 80.0]
    assert rows[0]["ema"].name == "epoch-0004_ema.safetensors"
    names = sorted(p.name for p in RunLayout(tmp_path).kept_dir.iterdir())
    assert names == [
        "epoch-0002.safetensors",
        "epoch-0002_ema.safetensors",
        "epoch-0004.safetensors",
        "epoch-0004_ema.safetensors",
        RunLayout.KEPT_INDEX,
    ]


def test_average_best_n_of_a_run_prefers_ema(tmp_path, capsys):
    for epoch, s in enumerate([1.0, 3.0, 2.0]):
        keep_epoch(tmp_path, 3, epoch, s, {"w": torch.full((2,), s)},
                   {"w": torch.full((2,), 10 * s)}, {"model": "m"})  # fmt: skip
    out = tmp_path / "avg.safetensors"
    assert main(["average", str(tmp_path), "--best", "2", "--out", str(out)]) == 0
    assert load_file(out)["w"].tolist() == [25.0, 25.0]  # EMA of epochs 2 and 3 (30, 20)
    assert main(["average", str(tmp_path), "--best", "2", "--no-ema", "--out", str(out)]) == 0
    assert load_file(out)["w"].tolist() == [2.5, 2.5]
    capsys.readouterr()
    assert main(["average", str(tmp_path), "--best", "4", "--out", str(out)]) == 2
    assert re.fullmatch(r"lgvit average: error: --best 4: .* kept 3 epoch\(s\) \(2, 3, 1\)\n",
                        capsys.readouterr().err)  # fmt: skip


def test_a_run_without_kept_epochs_is_one_line(tmp_path, capsys):
    assert main(["average", str(tmp_path), "--out", str(tmp_path / "a.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no kept checkpoints" in err and "--set keep_best=N" in err
    assert not (tmp_path / "a.safetensors").exists()
