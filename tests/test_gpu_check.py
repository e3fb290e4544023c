"""benchmarks/gpu_check.py: the GPU check runs (``--smoke``: every part at tiny sizes on the
CPU) so it never rots before a GPU is at hand; its runner records a failing or slow part and
goes on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STATUSES = {"ok", "failed", "skipped", "timeout"}
# An item failing with one of these is the check's own code gone stale (an API it calls
# changed), not a finding about lgvit.
ROT = ("TypeError", "AttributeError", "NameError", "KeyError", "ImportError", "ValueError")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_runs_every_part_and_reports_each(tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    assert sorted(parts) == [k for k, _, _ in _load().PARTS]
    for key, part in parts.items():
        assert part["status"] in STATUSES, (key, part)
        assert part["status"] != "timeout", (key, part)
        if part["status"] == "skipped":
            assert part["reason"], key
            continue
        assert part["items"], key
        for item in part["items"]:
            assert not str(item.get("error", "")).startswith(ROT), (key, item)
    md = (out / "report.md").read_text()
    assert all(f"## {k}." in md for k in parts)
    # The figures each part exists for are there.
    assert "bf16_logits_rel_err" in parts["a"]["items"][0]
    assert parts["d"]["eager"][0]["infer_img_s"] > 0
    assert parts["f"]["items"][0]["fp32_rel_err"] < 1e-3


def test_a_failing_item_is_one_line_and_the_next_item_runs(tmp_path):
    gc = _load()
    part = gc.Part(tmp_path / "r.json", type("A", (), {"smoke": True, "device": "cpu"})(), 60)

    def bad():
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    part.item("first", bad)
    part.item("second", lambda: {"value": 1})
    saved = json.loads((tmp_path / "r.json").read_text())["items"]
    assert saved[0]["ok"] is False
    assert saved[0]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert saved[1]["ok"] is True and saved[1]["value"] == 1


def test_a_part_past_its_limit_is_recorded_and_the_report_still_written(tmp_path, monkeypatch):
    gc = _load()
    monkeypatch.setattr(gc, "SMOKE_PART_S", 1)  # far less than starting torch takes
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    assert gc.main(["--smoke", "--out", str(tmp_path), "--parts", "af"]) == 0
    parts = json.loads((tmp_path / "report.json").read_text())["parts"]
    assert [p["status"] for p in parts.values()] == ["timeout", "timeout"]
    assert parts["a"]["reason"] == "stopped at its 1 s limit"
    assert (
        "| a. CUDA against CPU per model family | timeout |" in (tmp_path / "report.md").read_text()
    )


def test_without_cuda_the_full_check_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load().main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "gpu_check: CUDA is not available here; use --smoke on a CPU\n"
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("argv", [["--smoke"], ["--smoke", "--out", "x", "--parts", "az"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        _load().main(argv)
    assert e.value.code == 2
