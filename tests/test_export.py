"""`lgvit export`: ONNX (run in onnxruntime) and torch.export programs of every family, checked
against eager; the hub layout from a checkpoint; the refusals and missing-extra lines."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from PIL import Image

import lgvit
import lgvit.tools.export as ex
from lgvit.checkpoints.files import save_checkpoint
from lgvit.cli import main
from lgvit.core.errors import LgvitError

pytest.importorskip("onnxruntime", reason="the export extra is not installed")
pytest.importorskip("onnxscript", reason="the export extra is not installed")
onnx = pytest.importorskip("onnx", reason="the export extra is not installed")

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
    if fmt == "onnx":  # BatchNorm (LocalViT's FFN, LIT's merging) is folded into the convs
        ops = {n.op_type for n in onnx.load(str(out)).graph.node}
        assert "BatchNormalization" not in ops
        # An unfolded BatchNorm would leave a Sqrt; LSA's folded LayerNorm statistics take one.
        assert "Sqrt" not in ops or name.startswith("lsa")


def _run_at_sizes(name, fmt, tmp_path, sizes, **kwargs):
    """Export ``name`` with a dynamic batch, height and width; max abs diff to eager per size."""
    model = lgvit.create_model(name, **kwargs).eval()
    run = ex.write(model, fmt, tmp_path / f"m.{fmt}", dynamic_batch=True, dynamic_size=True)
    rows = ex.check(model, run, [torch.randn(b, 3, h, w) for b, h, w in sizes])
    return [r["max_abs_diff"] for r in rows]


@pytest.mark.parametrize(
    "name, kwargs, fmt",
    [
        ("lsa_micro_cifar", {}, "onnx"),
        ("lsa_micro_cifar", {}, "pt2"),
        (
            "lsa_tiny_cifar_c",
            dict(dims=(32, 48, 64), depths=(2, 1, 1), num_heads=(1, 1, 1)),
            "onnx",
        ),
        ("localvit_tiny", dict(img_size=32), "onnx"),
        ("lit_ti", dict(img_size=64), "onnx"),
    ],
)
def test_dynamic_size_runs_at_other_sizes(name, kwargs, fmt, tmp_path):
    # The LSA shift index is computed in the graph and every position embedding / relative
    # bias table resized there: other sizes (non-square, smaller) match eager.
    sizes = (
        [(1, 32, 32), (3, 48, 64), (2, 40, 24)]
        if "lit" not in name
        else [(1, 64, 64), (2, 96, 128)]
    )
    assert max(_run_at_sizes(name, fmt, tmp_path, sizes, **kwargs)) < 1e-5


def test_swin_windows_export_to_onnx_and_refuse_a_dynamic_size(tmp_path):
    small = dict(img_size=64, window_size=2, embed_dim=24, num_heads=(1, 2, 3, 4))
    model = lgvit.create_model("swin_tiny", **small).eval()
    run = ex.write(model, "onnx", tmp_path / "s.onnx", dynamic_batch=True)
    rows = ex.check(model, run, [torch.randn(1, 3, 64, 64), torch.randn(3, 3, 64, 64)])
    assert max(r["max_abs_diff"] for r in rows) < 1e-5
    with pytest.raises(LgvitError, match="swin_tiny cannot be exported with a dynamic") as e:
        ex.write(model, "onnx", tmp_path / "d.onnx", dynamic_size=True)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "d.onnx").exists()


@pytest.mark.filterwarnings("ignore:.*random weights")
def test_refusals_are_one_line(tmp_path):
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
