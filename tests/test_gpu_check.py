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
    gc = _load()
    assert sorted(parts) == [k for k, _, _ in gc.PARTS]
    for key, part in {**parts, "w": report["warm"]}.items():
        assert part["status"] in STATUSES, (key, part)
        assert part["status"] != "timeout", (key, part)
        if part["status"] == "skipped":
            assert part["reason"], key
            continue
        assert part["items"], key
        for item in part["items"]:
            assert not str(item.get("error", "")).startswith(ROT), (key, item)
    # a, b, c and the warm-up side by side; d and e alone, after them
    first = [parts[k]["started_s"] for k in "abc"] + [report["warm"]["started_s"]]
    assert max(first) - min(first) < 5, first
    ends = [parts[k]["started_s"] + parts[k]["seconds"] for k in "abc"]
    assert parts["d"]["started_s"] >= max(ends) and parts["e"]["started_s"] >= parts["d"][
        "started_s"] + parts["d"]["seconds"]  # fmt: skip
    md = (out / "report.md").read_text()
    assert all(f"## {k}." in md for k in parts)
    # The goals come first, one row each, then the parts.
    table = md[md.index("| goal | measured | holds |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(report["goals"]) == 2 + 5 + 3 + len(gc.PAIRS) + 2
    assert "| 224-px JPEGs decoded on the GPU" in table[6]  # issue 56's five come first
    assert md.index("| goal |") < md.index("| part |") < md.index("## a.")
    # The figures each part exists for are there.
    a = {i["item"]: i for i in parts["a"]["items"]}
    assert (
        a["fp32 lit_ti"]["fp32_grad_worst_err"] < 1e-3 and "bf16_logits_rel_err" in a["fp32 lit_ti"]
    )
    assert a["bf16 step deit_tiny"]["trains"] is True
    d = {i["item"]: i for i in parts["d"]["items"]}
    ours, theirs = d["eager deit_tiny"]["rows"]
    assert (
        ours["infer_best_img_s"] > 0 and ours["train_sweep"] and theirs["model"].startswith("timm")
    )
    assert d["eager deit_tiny"]["drop_path"] == {"lgvit": 0.1, "timm": 0.1}
    assert d["compiled lsa_micro_cifar"]["rows"][0]["compile_rel_err"] < 5e-2
    jpeg = d["decode 224-px JPEGs"]  # the loader's device path (here the CPU) and PIL's, timed
    assert jpeg["ok"] and jpeg["device_img_s"] > 0 and jpeg["pil_img_s"] > 0, jpeg


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
    assert gc.main(["--smoke", "--out", str(tmp_path), "--parts", "ad"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    parts = report["parts"]
    assert [p["status"] for p in parts.values()] == ["timeout", "timeout"]
    assert report["warm"]["status"] == "timeout"  # the warm-up for d, beside a
    assert parts["a"]["reason"] == "stopped at its 1 s limit"
    md = (tmp_path / "report.md").read_text()
    assert f"| a. {gc.TITLES['a']} | timeout |" in md
    assert "| every part finishes within its budget | a 1" in md and md.count("| no |") >= 1


def test_without_cuda_the_full_check_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load().main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "gpu_check: CUDA is not available here; use --smoke on a CPU\n"
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize(
    "argv",
    [["--smoke"], ["--smoke", "--out", "x", "--parts", "az"], ["--out", "x", "--parts", "f"]],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        _load().main(argv)
    assert e.value.code == 2


def _smoke_part(tmp_path, **args) -> object:
    gc = _load()
    ns = type("A", (), {"smoke": True, "device": "cpu", "authors_lsa": None, "warm_done": None,
                        **args})()  # fmt: skip
    return gc, gc.Part(tmp_path / "r.json", ns, 300)


def test_part_a_fails_a_wrong_gradient_by_the_rule(tmp_path, monkeypatch):
    """Part a compares by measure.worst_grad_error: the device's gradient of one tensor 10% off
    fails the family, naming the tensor; left alone, the family passes."""
    gc, part = _smoke_part(tmp_path)
    assert part.item("fp32 lsa_tiny_cifar", lambda: gc._agreement(part, "lsa_tiny_cifar"))["ok"]
    real, calls = gc._logits_and_grads, []

    def wrong(model, x, y, amp):  # noqa: ANN001, ANN202 -- the second call is the device's
        out, grads = real(model, x, y, amp)
        calls.append(1)
        if len(calls) == 2:
            grads["head.weight"] = grads["head.weight"] * 1.1
        return out, grads

    monkeypatch.setattr(gc, "_logits_and_grads", wrong)
    row = part.item("fp32 lsa_tiny_cifar", lambda: gc._agreement(part, "lsa_tiny_cifar"))
    assert row["ok"] is False and row["worst_grad"] == "head.weight"
    assert row["fp32_grad_worst_err"] == pytest.approx(0.1, rel=1e-3)


def test_largest_batch_halves_past_out_of_memory():
    gc = _load()
    tried = []

    def step_at(batch):  # noqa: ANN001, ANN202
        tried.append(batch)
        if batch > 200:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

    oom = lambda e: "out of memory" in str(e)  # noqa: E731
    assert gc.largest_batch(step_at, 1024, 8, oom) == 128 and tried == [1024, 512, 256, 128]
    assert gc.largest_batch(step_at, 1024, 1024, oom) is None  # once: the target only
    with pytest.raises(ValueError, match="bad"):
        gc.largest_batch(lambda b: (_ for _ in ()).throw(ValueError("bad")), 64, 8, oom)


def _report(**parts) -> dict:
    entry = {"budget_s": 10, "status": "ok", "seconds": 5}
    return {"smoke": False, "parts": {k: {**entry, "items": v} for k, v in parts.items()}}


def test_goals_hold_fail_or_are_not_measured():
    gc = _load()
    pair = {"infer_ratio": 1.1, "train_ratio": 1.02}
    report = _report(
        a=[{"item": "bf16 step lsa_small_cifar", "ok": False, "error": "out of memory at batch "
            "1024"}, {"item": "bf16 step lsa_small_cifar, again", "ok": False, "trains_at": 256,
            "error": "out of memory at batch 1024"}, {"item": "bf16 step deit_tiny", "ok": True}],
        b=[{"item": "the device tests: pytest", "ok": True, "passed": 20, "skipped": 1},
           {"item": "the DDP and dense-task device tests: pytest", "ok": True, "passed": 3}],
        d=[{"item": "eager deit_tiny", **pair}, {"item": "compiled deit_tiny", **pair},
           {"item": "eager deit_small", **pair},
           {"item": "compiled deit_small", "infer_ratio": 0.97, "train_ratio": 1.1},
           {"item": "lsa_tiny_cifar beside the LSA authors' model, batch 512",
            "infer_ratio": 3.2, "train_ratio": 1.9}],
    )  # fmt: skip
    report["parts"]["a"]["models"] = 2
    report["parts"]["d"].update(status="timeout", seconds=11)
    got = {g["goal"].split(":")[0].split(" (")[0]: g for g in gc.goals(report)}
    training = got["every registered model trains at batch 256"]
    assert training["holds"] == "no"
    assert training["measured"] == ("1/2 models (lsa_small_cifar: out of memory at batch 1024, "
                                    "trains at 256)")  # fmt: skip
    assert got["part a passes for every family"]["holds"] == "not measured"
    assert got["the device tests pass"] == {
        "goal": "the device tests pass",
        "measured": "23 passed, 1 skipped",
        "holds": "yes",
    }
    assert got["deit_tiny"]["holds"] == "yes"
    assert got["deit_small"]["holds"] == "no" and "compiled 0.97x / 1.10x" in got["deit_small"][
        "measured"]  # fmt: skip
    assert got["swin_tiny"]["holds"] == "not measured"
    assert got["lsa_tiny_cifar / the LSA authors' model at batch 512"]["holds"] == "no"
    budgets = got["every part finishes within its budget"]
    assert budgets["holds"] == "no" and "d 11/10 s" in budgets["measured"]


def test_issue_56_goals_come_first_each_judged_from_its_part():
    gc = _load()
    rows = {"lit_s": {"train_mfu": 0.31, "train_busy": 0.95},
            "lsa_small_224": {"train_mfu": 0.2, "train_busy": 0.85}}  # fmt: skip
    d = [{"item": f"compiled {n}", "rows": [{"model": n, "batch": 128, **r}]}
         for n, r in rows.items()]  # fmt: skip
    d.append({"item": "compiled deit_small", "rows": [
        {"model": "deit_small", "train_mfu": 0.4},
        {"model": "timm deit_small_patch16_224", "train_mfu": 0.25}]})  # fmt: skip
    epochs = [{"epoch": 0, "img_per_s": 9000.0, "train_size": 16, "epoch_time_s": 30.0},
              {"epoch": 1, "img_per_s": 3000.0, "train_size": 32, "epoch_time_s": 60.0},
              {"epoch": 2, "img_per_s": 3900.0, "train_size": 32, "epoch_time_s": 40.0},
              {"epoch": 3, "img_per_s": 3850.0, "train_size": 32, "epoch_time_s": 30.0,
               "test_acc1": 90.2}]  # fmt: skip
    e = [{"item": "synthetic step rate", "img_s": 4000.0},
         {"item": "lgvit train --config x", "epochs": epochs}]  # fmt: skip
    got = gc.goals(_report(d=d, e=e))[:5]
    assert [g["holds"] for g in got] == ["no", "no", "yes", "no", "not measured"]
    assert got[0]["measured"] == ("lit_s 0.310 at batch 128, lsa_small_224 0.200 at batch 128; "
                                  "timm deit_small 0.250")  # fmt: skip
    assert "lsa_small_224 0.850" in got[1]["measured"]
    assert got[2]["measured"] == "3900 / 4000 img/s = 0.975"  # the first 32 px epoch left out
    assert got[3]["measured"] == "90.20% after 160 s (epoch 4)"  # 10 s past the 150
    assert got[4]["measured"] == "-"  # d had no decode item
    rows["lit_s"]["train_img_s"] = 2000.0
    d[0]["rows"] = [{"model": "lit_s", "batch": 128, **rows["lit_s"]}]
    d.append({"item": "decode 224-px JPEGs", "device_img_s": 2300.0, "pil_img_s": 900.0,
              "workers": 16, "decode_device": "cuda"})  # fmt: skip
    got = gc.goals(_report(d=d, e=e))[4]
    assert got["measured"] == ("2300 img/s decoded on cuda (16 workers; PIL in the workers 900)"
                               " / lit_s 2000 = 1.15x") and got["holds"] == "no"  # fmt: skip
    d[-1]["device_img_s"] = 2400.0
    assert gc.goals(_report(d=d, e=e))[4]["holds"] == "yes"
    epochs[-1]["epoch_time_s"], rows["lsa_small_224"]["train_mfu"] = 20.0, 0.25
    rows["lsa_small_224"]["train_busy"] = 0.9
    d[1]["rows"] = [{"model": "lsa_small_224", "batch": 128, **rows["lsa_small_224"]}]
    assert [g["holds"] for g in gc.goals(_report(d=d, e=e))[:4]] == ["yes"] * 4
    epochs[2]["img_per_s"] = epochs[3]["img_per_s"] = 3700.0  # 0.925 of the step's rate
    assert gc.goals(_report(d=d, e=e))[2]["holds"] == "no"
    nothing = gc.goals(_report(a=[]))[:5]
    assert [g["holds"] for g in nothing] == ["not measured"] * 5


AUTHORS_MODEL = """
import torch.nn as nn

class ShiftingTransformer(nn.Module):  # their class name and keyword arguments; tiny inside
    def __init__(self, *, image_size, num_classes, output_dir, **kw):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, num_classes))

    def forward(self, x):
        return self.head(x)
"""


def test_the_lsa_authors_model_is_read_from_their_checkout(tmp_path, monkeypatch):
    """``--authors-lsa DIR``: their ``cifar/cifar_model.py`` imported from DIR at run time (not
    copied into lgvit), measured beside lsa_tiny_cifar with the same steps: the ratios."""
    repo = tmp_path / "Locally-SAG-Transformer"
    (repo / "cifar").mkdir(parents=True)
    (repo / "cifar" / "__init__.py").write_text("")
    (repo / "cifar" / "cifar_model.py").write_text(AUTHORS_MODEL)
    monkeypatch.setattr(sys, "path", list(sys.path))  # bench_lsa puts DIR first: undone after
    try:
        gc, part = _smoke_part(tmp_path, authors_lsa=str(repo))
        row = part.item("authors", lambda: gc.authors_item("cpu", True, part.args.authors_lsa))
        assert row["ok"], row.get("error")
        ours, theirs = row["rows"]
        assert ours["model"] == "lsa_tiny_cifar"
        assert theirs["model"] == "LSA authors' ShiftingTransformer"
        assert row["infer_ratio"] > 0 and row["train_ratio"] > 0
        assert sys.modules["cifar.cifar_model"].__file__ == str(repo / "cifar" / "cifar_model.py")
    finally:  # their package name, gone again
        sys.modules.pop("cifar.cifar_model", None)
        sys.modules.pop("cifar", None)
    gc, part = _smoke_part(tmp_path, authors_lsa=str(tmp_path / "nothing"))
    row = part.item("authors", lambda: gc.authors_item("cpu", True, part.args.authors_lsa))
    assert row["ok"] is False and "no cifar/cifar_model.py there" in row["error"]


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")
@pytest.mark.parametrize("name", ["deit_tiny", "deit_small", "swin_tiny"])
def test_timm_runs_with_lgvits_drop_path(name):
    """d's comparison builds timm's model with lgvit's stochastic depth (DeiT 0.1, Swin-T 0.2,
    the papers' recipes; timm's defaults are 0 and 0.1): a training step does the same work."""
    import lgvit

    gc = _load()
    sys.path.insert(0, str(SCRIPT.parent))
    from bench_peers import drop_path_rates

    peer, rate = gc.timm_peer(name, None)
    ours = drop_path_rates(lgvit.create_model(name))
    theirs = drop_path_rates(peer.build())
    assert rate == max(ours) == max(theirs) == (0.2 if name == "swin_tiny" else 0.1)
    assert sorted(r for r in ours if r) == pytest.approx(sorted(r for r in theirs if r))
