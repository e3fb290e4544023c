"""`lgvit bench`: the table, its formats, failing rows, the memory probe, the scaling curves,
MACs against the papers, and the timm baselines (where timm imports)."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch
from PIL import Image

import lgvit
from lgvit.cli import main
from lgvit.models import get_model_config, list_models
from lgvit.tools.bench import BenchOptions, cpu_peak_memory_mb, format_result, run_bench
from lgvit.tools.measure import count_macs
from lgvit.tools.scaling import fit_exponent, run_scaling


@pytest.fixture(scope="module")
def result():
    opts = BenchOptions(batch_size=2, img_size=32, rounds=2, train=True, amp="none")
    return run_bench(["lsa_micro_cifar", "deit_tiny"], opts, log=lambda m: None)


def test_two_models_measured(result):
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["lsa_micro_cifar", "deit_tiny"] and result["precision"] == "fp32"
    for name, r in rows.items():
        assert r["error"] is None, r["error"]
        with torch.device("meta"):
            m = lgvit.create_model(name, img_size=32)
        assert r["params_m"] == pytest.approx(sum(p.numel() for p in m.parameters()) / 1e6)
        assert r["macs_g"] == pytest.approx(count_macs(m, (3, 32, 32)) / 1e9)
        for key in ("infer_img_s", "train_img_s", "infer_mem_mb", "train_mem_mb"):
            assert r[key] > 0 and math.isfinite(r[key]), (name, key)
        assert 0 < r["infer_mfu"] < 1 and 0 < r["train_mfu"] < 1
        assert r["train_img_s"] < r["infer_img_s"]
        assert r["train_mem_mb"] > r["infer_mem_mb"]  # gradients and AdamW state
    # The paper's figures travel beside ours, with the hardware they were measured on.
    assert rows["deit_tiny"]["paper_img_s"] == 3398
    assert "RTX 3090" in rows["deit_tiny"]["paper_hardware"]


def test_every_format_parses(result):
    text = format_result(result, "table").splitlines()
    assert text[0].split()[:4] == ["model", "input", "params", "(M)"]
    assert text[2].startswith("lsa_micro_cifar") and text[3].startswith("deit_tiny")
    assert any(line.startswith("[1] LIT paper") for line in text)
    md = format_result(result, "markdown").splitlines()
    n = md[0].count("|")
    assert md[1] == "|" + " --- |" * (n - 1)
    assert [line.count("|") for line in md[2:4]] == [n, n]
    rows = list(csv.DictReader(io.StringIO(format_result(result, "csv"))))
    assert [r["model"] for r in rows] == ["lsa_micro_cifar", "deit_tiny"]
    assert float(rows[1]["infer_img_s"]) == pytest.approx(result["rows"][1]["infer_img_s"])
    back = json.loads(format_result(result, "json"))
    assert back["rows"][0]["model"] == "lsa_micro_cifar" and back["matmul_peak_tflops"] > 0


def test_failing_model_is_a_row_with_its_reason():
    opts = BenchOptions(batch_size=2, img_size=40, rounds=1, memory=False, amp="none")
    res = run_bench(["lsa_micro_cifar", "localvit_tiny"], opts, log=lambda m: None)
    ok, bad = res["rows"]
    assert ok["error"] is None and ok["infer_img_s"] > 0
    assert "not divisible by patch 16" in bad["error"] and bad.get("infer_img_s") is None
    table = format_result(res, "table")
    assert "why it failed" in table and "not divisible by patch 16" in table


def test_memory_probe_sees_a_bigger_batch():
    small = cpu_peak_memory_mb("lsa_micro_cifar", batch=2, train=False, img_size=32)
    big = cpu_peak_memory_mb("lsa_micro_cifar", batch=64, train=False, img_size=32)
    assert 0 < small < big, (small, big)
    with pytest.raises(RuntimeError, match="divisible"):
        cpu_peak_memory_mb("localvit_tiny", batch=1, train=False, img_size=40)


def test_cli(tmp_path, capsys):
    out = tmp_path / "t.csv"
    argv = ["bench", "lsa_micro_cifar", "--batch-size", "2", "--rounds", "1", "--no-memory"]
    assert main([*argv, "--format", "csv", "--out", str(out), "--quiet"]) == 0
    assert next(csv.DictReader(out.open()))["model"] == "lsa_micro_cifar"
    assert main(["bench", "nope*"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "lgvit bench: error: unknown model 'nope*'; `lgvit info` lists them all"
    assert main([*argv, "--format", "yaml"]) == 2
    assert "--format 'yaml'" in capsys.readouterr().err


def test_scaling_writes_csv_and_png(tmp_path):
    paths = run_scaling("localvit", str(tmp_path / "localvit"), quick=True)
    rows = list(csv.DictReader(open(paths[0])))
    points = [r for r in rows if r["x"] != "slope"]
    assert {r["curve"] for r in points} == {"mlp", "locality"} and len(points) == 4
    assert all(float(r["time_ms"]) > 0 and float(r["macs_g"]) > 0 for r in points)
    slopes = {r["curve"]: float(r["macs_g"]) for r in rows if r["x"] == "slope"}
    assert slopes["mlp"] == pytest.approx(2.0, abs=1e-6)  # 8 N C^2 exactly
    with Image.open(paths[1]) as img:
        assert img.format == "PNG" and img.size == (1080, 331)


def test_fit_exponent_recovers_a_power_law():
    xs = [64, 256, 1024, 4096]
    assert fit_exponent(xs, [3 * x**1.5 for x in xs]) == pytest.approx(1.5)


# ----------------------------------------------------------------------------- the papers


def _printed_tolerance(value: float) -> float:
    """Half a unit of the last digit the paper prints, or 1.5%."""
    decimals = len(repr(float(value)).split(".")[1].rstrip("0"))
    return max(0.5 * 10.0**-decimals, 0.015 * value)


def test_macs_agree_with_the_papers_or_say_why():
    checked = 0
    for name in list_models():
        paper = get_model_config(name).paper
        if paper.get("macs_g") is None:
            continue
        with torch.device("meta"):
            m = lgvit.create_model(name)
        got = count_macs(m, get_model_config(name).input_size) / 1e9
        close = abs(got - paper["macs_g"]) <= _printed_tolerance(paper["macs_g"])
        if paper.get("macs_note"):  # a paper figure known to be off says why
            continue
        assert close, f"{name}: {got:.3f}G vs the paper's {paper['macs_g']}G and no note"
        checked += 1
    assert checked >= 25


def test_compile_time_is_a_column(monkeypatch):
    """``--compile``: each model's first call (where torch.compile compiles) is reported, for
    inference and the training step; dynamo's eager backend stands in for Inductor here."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager"))
    opts = BenchOptions(batch_size=2, img_size=32, rounds=1, train=True, amp="none",
                        compile=True, memory=False)  # fmt: skip
    res = run_bench(["lsa_micro_cifar"], opts, log=lambda m: None)
    row = res["rows"][0]
    assert row["infer_compile_s"] > 0 and row["train_compile_s"] > 0, row
    assert "compile s" in format_result(res, "table")


def test_a_model_outside_the_registry_is_measured_beside_lgvits():
    """``extra``: timm's or an author's model in the same run, same steps and rounds; its
    params and MACs counted on the built model, no paper figures."""
    from lgvit.tools.bench import ExtraModel

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 10))

    opts = BenchOptions(batch_size=2, img_size=16, rounds=1, train=True, amp="none")
    res = run_bench(["lsa_micro_cifar"], opts, log=lambda m: None,
                    extra=[ExtraModel("plain", build, (3, 16, 16))])  # fmt: skip
    ours, theirs = res["rows"]
    assert ours["model"] == "lsa_micro_cifar" and theirs["model"] == "plain"
    assert theirs["error"] is None and theirs["params_m"] == pytest.approx(7690 / 1e6)
    assert theirs["macs_g"] == pytest.approx(7680 / 1e9)
    assert theirs["infer_img_s"] > 0 and theirs["train_img_s"] > 0
    assert theirs.get("paper_img_s") is None and "train_mem_mb" not in theirs  # no CPU probe
    assert "plain" in format_result(res, "table")
