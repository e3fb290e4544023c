"""`lgvit export`: ONNX (run in onnxruntime) and torch.export programs of every family, checked
against eager; the hub layout from a checkpoint; the refusals and missing-extra lines."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from PIL import Image

import lgvit
import lgvit.export as ex
from lgvit.checkpoint import save_checkpoint
from lgvit.cli import main
from lgvit.errors import LgvitError

pytest.importorskip("onnxruntime", reason="the export extra is not installed")
pytest.importorskip("onnxscript", reason="the export extra is not installed")

FAMILIES = [("lsa_micro_cifar", 32), ("localvit_tiny", 32), ("lit_ti", 64)]


@pytest.mark.filterwarnings("ignore:.*random weights")
@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
@pytest.mark.parametrize("name, size", FAMILIES)
def test_every_family_exports_with_a_dynamic_batch(name, size, fmt, tmp_path):
    out = tmp_path / f"m.{fmt}"
    report = ex.export(name, fmt, str(out), img_size=size, dynamic_batch=True, log=lambda m: None)
    checks = report["checks"]
    assert [c["batch"] for c in checks] == [1, 4]
    assert all(c["max_abs_diff"] < 1e-5 and c["exported_ms"] > 0 for c in checks)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # one file, no side data
    meta = ex.file_metadata(out)
    assert meta["lgvit_model"] == name and json.loads(meta["input_size"]) == [3, size, size]


@pytest.mark.filterwarnings("ignore:.*random weights")
def test_refusals_are_one_line(tmp_path):
    with pytest.raises(LgvitError, match="lsa_micro_cifar cannot be exported with a dynamic"):
        ex.export("lsa_micro_cifar", "pt2", str(tmp_path / "a.pt2"), dynamic_size=True)
    with pytest.raises(LgvitError, match="localvit_tiny cannot be exported with a dynamic"):
        ex.export("localvit_tiny", "pt2", str(tmp_path / "b.pt2"), img_size=32, dynamic_size=True)
    assert not list(tmp_path.iterdir())  # nothing half-usable left behind
    with pytest.raises(LgvitError, match="neither a registered model nor a checkpoint"):
        ex.export("lsa_mikro", "onnx")


@pytest.mark.filterwarnings("ignore:.*random weights")
def test_a_difference_above_tolerance_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "TOLERANCE", 0.0)
    with pytest.raises(LgvitError, match=r"differ from eager by .* \(> 0\)"):
        ex.export("lsa_micro_cifar", "onnx", str(tmp_path / "m.onnx"), log=lambda m: None)


def test_missing_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(LgvitError, match=r"needs onnxscript.*pip install 'lgvit\[export\]'"):
        ex.export("lsa_micro_cifar", "onnx")


def test_checkpoint_to_hub_layout_and_real_images(tmp_path, capsys):
    m = lgvit.create_model("lsa_micro_cifar", num_classes=2, img_size=16)
    meta = {"model": "lsa_micro_cifar", "img_size": "16", "classes": json.dumps(["a", "b"])}
    save_checkpoint(tmp_path / "best", m.state_dict(), {"step": 0}, metadata=meta)
    for i in range(2):
        Image.new("RGB", (40, 30), (40 * i, 90, 200)).save(tmp_path / f"{i}.png")
    argv = ["export", str(tmp_path / "best"), "--format", "hf", "--out", str(tmp_path / "hf")]
    images = [str(tmp_path / "0.png"), str(tmp_path / "1.png")]
    assert main([*argv, "--dynamic-batch", "--images", *images, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["batch"] for c in report["checks"]] == [1, 2]
    assert report["checks"][0]["max_abs_diff"] == 0.0
    back = lgvit.create_model(f"local-dir:{tmp_path / 'hf'}")
    assert back.pretrained_cfg["label_names"] == ["a", "b"]
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), m.eval()(x), rtol=0, atol=0)
