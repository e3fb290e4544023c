"""Checkpoint files: round trips, atomic writes, pair consistency, refusing unsafe pickles."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lgvit.checkpoints.files import (
    atomic_save,
    atomic_write_bytes,
    build_train_state,
    capture_rng_state,
    checkpoint_paths,
    clean_state_dict,
    load_checkpoint_pair,
    load_metadata,
    load_train_state,
    load_weights,
    restore_rng_state,
    save_checkpoint,
    state_dict_to_cpu,
)
from lgvit.core.errors import LgvitError


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _trained_model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _assert_one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


# --------------------------------------------------------------------------- round trips


def test_round_trip_weights_and_train_state(tmp_path: Path) -> None:
    model, opt, sched = _trained_model_and_optimizer()
    ema = {k: v * 0.5 for k, v in model.state_dict().items()}
    state = build_train_state(
        optimizer=opt,
        scheduler=sched,
        ema=ema,
        epoch=3,
        global_step=42,
        best_metric=np.float64(0.75),  # numpy scalars are converted so weights_only can load
        config={"lr": 5e-4, "opt_betas": (0.9, 0.999)},
        extra={"git": "abc123", "hist": [1, 2]},
    )
    save_checkpoint(tmp_path / "last", model.state_dict(), state, metadata={"model": "tiny"})

    weights, loaded = load_checkpoint_pair(tmp_path / "last")
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v)
    assert (loaded["epoch"], loaded["global_step"]) == (3, 42)
    assert loaded["best_metric"] == 0.75 and type(loaded["best_metric"]) is float
    assert loaded["config"] == {"lr": 5e-4, "opt_betas": (0.9, 0.999)}
    assert loaded["extra"] == {"git": "abc123", "hist": [1, 2]}
    assert all(torch.equal(loaded["ema"][k], ema[k]) for k in ema)
    assert load_metadata(tmp_path / "last")["model"] == "tiny"

    # The optimizer state goes back into a fresh optimizer and matches exactly.
    model2 = _tiny_model()
    model2.load_state_dict(weights)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3, weight_decay=0.05)
    opt2.load_state_dict(loaded["optimizer"])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    sched2.load_state_dict(loaded["scheduler"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-4
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        s, s2 = opt.state[p], opt2.state[p2]
        assert torch.equal(s["exp_avg"], s2["exp_avg"])
        assert torch.equal(s["exp_avg_sq"], s2["exp_avg_sq"])
        assert float(s["step"]) == float(s2["step"]) == 1.0

    # Each piece also loads on its own, by stem or by file name.
    assert load_weights(tmp_path / "last").keys() == weights.keys()
    assert load_weights(tmp_path / "last.safetensors").keys() == weights.keys()
    assert load_train_state(tmp_path / "last")["global_step"] == 42
    assert load_train_state(tmp_path / "last.state.pt")["global_step"] == 42
    assert _temp_files(tmp_path) == []


def test_rng_state_restores_the_next_draws(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)  # and in python's
    save_checkpoint(tmp_path / "ck", {"w": torch.zeros(1)}, {"rng": capture_rng_state()})

    expected = (torch.rand(5), np.random.rand(5), np.random.randn(3), random.random())
    expected_gauss = random.gauss(0, 1)
    torch.rand(100), np.random.rand(100), random.random()  # move every generator on

    restore_rng_state(load_train_state(tmp_path / "ck")["rng"])
    got = (torch.rand(5), np.random.rand(5), np.random.randn(3), random.random())
    assert torch.equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[2], expected[2])
    assert got[3] == expected[3]
    assert random.gauss(0, 1) == expected_gauss


def test_restore_rng_state_rejects_garbage() -> None:
    with pytest.raises(LgvitError) as err:
        restore_rng_state({"numpy": {"keys": torch.zeros(3)}})
    _assert_one_line(err, "rng state")


def test_shared_and_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    sd = {"a": base, "tied": base, "t": base.t(), "row": base[1]}
    save_checkpoint(tmp_path / "ck", sd)
    out = load_weights(tmp_path / "ck")
    for k, v in sd.items():
        assert torch.equal(out[k], v), k


def test_state_dict_to_cpu_detaches() -> None:
    p = nn.Parameter(torch.ones(2))
    out = state_dict_to_cpu({"p": p})
    assert not out["p"].requires_grad and out["p"].device.type == "cpu"


# --------------------------------------------------------------------------- load_weights inputs


def test_prefixes_from_ddp_and_compile_are_stripped(tmp_path: Path) -> None:
    w = torch.ones(2)
    assert clean_state_dict({"module.a": w, "module.b.c": w}) == {"a": w, "b.c": w}
    assert clean_state_dict({"_orig_mod.a": w}) == {"a": w}
    assert clean_state_dict({"_orig_mod.module.a": w, "module._orig_mod.b": w}) == {"a": w, "b": w}
    assert clean_state_dict({"blocks.0._orig_mod.x": w}) == {"blocks.0.x": w}
    # A real submodule named "module" (not every key has it) is left alone.
    assert clean_state_dict({"module.a": w, "head.b": w}) == {"module.a": w, "head.b": w}

    save_checkpoint(tmp_path / "ddp", {"module._orig_mod.fc.weight": w})
    assert list(load_weights(tmp_path / "ddp")) == ["fc.weight"]
    torch.save({"model": {"module.fc.weight": w}}, tmp_path / "deit.pth")
    assert list(load_weights(tmp_path / "deit.pth")) == ["fc.weight"]


@pytest.mark.parametrize("wrap", [None, "model", "state_dict"])
def test_load_weights_from_pt_files(tmp_path: Path, wrap: str | None) -> None:
    sd = _tiny_model().state_dict()
    torch.save(sd if wrap is None else {wrap: sd, "epoch": 7}, tmp_path / "w.pt")
    out = load_weights(tmp_path / "w.pt")
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)
    assert load_weights(tmp_path / "w").keys() == sd.keys()  # the suffix may be left out


def test_load_weights_input_errors(tmp_path: Path) -> None:
    with pytest.raises(LgvitError) as err:
        load_weights(tmp_path / "nope")
    _assert_one_line(err, str(tmp_path / "nope"), "no such file")

    save_checkpoint(tmp_path / "last", {"w": torch.ones(1)}, {"epoch": 1})
    with pytest.raises(LgvitError) as err:
        load_weights(tmp_path)
    _assert_one_line(err, "is a directory", "last.safetensors")

    with pytest.raises(LgvitError) as err:
        load_weights(tmp_path / "last.state.pt")
    _assert_one_line(err, "training-state file", "last.safetensors")

    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(LgvitError) as err:
        load_weights(tmp_path / "list.pt")
    _assert_one_line(err, "list.pt", "does not contain a state_dict")

    torch.save({"model": {"w": torch.ones(1)}, "note": "hi"}, tmp_path / "ok.pt")
    assert list(load_weights(tmp_path / "ok.pt")) == ["w"]
    torch.save({"w": torch.ones(1), "note": "hi"}, tmp_path / "mixed.pt")
    with pytest.raises(LgvitError) as err:
        load_weights(tmp_path / "mixed.pt")
    _assert_one_line(err, "mixed.pt", "'note'")


# --------------------------------------------------------------------------- unsafe pickles


class _Evil:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["pickle", "torch"])
@pytest.mark.parametrize("loader", [load_weights, load_train_state])
def test_malicious_pickle_is_refused(tmp_path: Path, writer: str, loader) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {"model": _Evil(marker)}
    if writer == "pickle":
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    else:
        torch.save(payload, path)
    with pytest.raises(LgvitError) as err:
        loader(path)
    _assert_one_line(err, str(path), "refusing to load", "system", "weights_only=True")
    assert not marker.exists()


# --------------------------------------------------------------------------- corrupt files


def test_truncated_and_corrupt_files_name_the_path(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", _tiny_model().state_dict(), {"epoch": 1, "w": torch.ones(99)})
    weights_path, state_path = checkpoint_paths(tmp_path / "ck")

    for path, loader in [(weights_path, load_weights), (state_path, load_train_state)]:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(LgvitError) as err:
            loader(path)
        _assert_one_line(err, str(path), "corrupt")
        path.write_bytes(b"")
        with pytest.raises(LgvitError) as err:
            loader(path)
        _assert_one_line(err, str(path), "empty")
        # Text starting with "c" reads as pickle's GLOBAL opcode; it must not count as code.
        path.write_bytes(b"config: this is not a checkpoint\nlr: 0.1\n")
        with pytest.raises(LgvitError) as err:
            loader(path)
        _assert_one_line(err, str(path))
        assert "refusing" not in str(err.value)

    torch.save({"epoch": 1}, tmp_path / "plain.state.pt")
    with pytest.raises(LgvitError) as err:
        load_train_state(tmp_path / "plain.state.pt")
    _assert_one_line(err, "plain.state.pt", "not an lgvit training-state file")


def test_foreign_safetensors_loads_as_weights_but_not_as_a_pair(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "hf.safetensors"))
    assert torch.equal(load_weights(tmp_path / "hf.safetensors")["w"], torch.ones(2))
    torch.save({"lgvit_state_format": 1, "train_state": {}}, tmp_path / "hf.state.pt")
    with pytest.raises(LgvitError) as err:
        load_checkpoint_pair(tmp_path / "hf")
    _assert_one_line(err, "hf.safetensors", "lgvit_pair_id")


def test_missing_state_file_is_named(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", {"w": torch.ones(1)})
    with pytest.raises(LgvitError) as err:
        load_checkpoint_pair(tmp_path / "ck")
    _assert_one_line(err, "ck.state.pt", "no such file")


def test_unloadable_train_state_fails_at_save_time(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"train_state\['extra'\]\['when'\]"):
        save_checkpoint(tmp_path / "ck", {"w": torch.ones(1)}, {"extra": {"when": object()}})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- atomicity


def test_mismatched_pair_is_detected(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", {"w": torch.zeros(1)}, {"epoch": 1})
    old_state = (tmp_path / "ck.state.pt").read_bytes()
    save_checkpoint(tmp_path / "ck", {"w": torch.ones(1)}, {"epoch": 2})
    (tmp_path / "ck.state.pt").write_bytes(old_state)  # new weights next to an old state
    with pytest.raises(LgvitError) as err:
        load_checkpoint_pair(tmp_path / "ck")
    _assert_one_line(err, "ck.state.pt", "does not belong to ck.safetensors")


def _failing_replace(monkeypatch: pytest.MonkeyPatch, fail_on_call: int) -> None:
    """Make the ``fail_on_call``-th os.replace raise, as a crash at that point would."""
    real = os.replace
    calls = {"n": 0}

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise OSError("simulated crash")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_crash_before_any_replace_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path / "ck", {"w": torch.zeros(3)}, {"epoch": 1})
    _failing_replace(monkeypatch, fail_on_call=1)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path / "ck", {"w": torch.ones(3)}, {"epoch": 2})
    monkeypatch.undo()
    weights, state = load_checkpoint_pair(tmp_path / "ck")
    assert torch.equal(weights["w"], torch.zeros(3)) and state["epoch"] == 1
    assert _temp_files(tmp_path) == []


def test_crash_between_replaces_rolls_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path / "ck", {"w": torch.zeros(3)}, {"epoch": 1})
    _failing_replace(monkeypatch, fail_on_call=2)  # weights replaced, state not
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path / "ck", {"w": torch.ones(3)}, {"epoch": 2})
    monkeypatch.undo()
    # On disk: new weights, old state, and the new state's complete temp file.
    assert load_train_state(tmp_path / "ck")["epoch"] == 1
    with pytest.warns(UserWarning, match="interrupted save"):
        weights, state = load_checkpoint_pair(tmp_path / "ck")
    assert torch.equal(weights["w"], torch.ones(3)) and state["epoch"] == 2

    # The next successful save clears the leftover temp file.
    save_checkpoint(tmp_path / "ck", {"w": torch.full((3,), 2.0)}, {"epoch": 3})
    assert _temp_files(tmp_path) == []
    assert load_checkpoint_pair(tmp_path / "ck")[1]["epoch"] == 3


def test_atomic_writers_keep_old_content_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    atomic_write_bytes(tmp_path / "f.txt", b"old")
    atomic_save({"x": torch.ones(1)}, tmp_path / "f.pt")
    _failing_replace(monkeypatch, fail_on_call=1)
    with pytest.raises(OSError):
        atomic_write_bytes(tmp_path / "f.txt", b"new")
    monkeypatch.undo()
    _failing_replace(monkeypatch, fail_on_call=1)
    with pytest.raises(OSError):
        atomic_save({"x": torch.zeros(1)}, tmp_path / "f.pt")
    monkeypatch.undo()
    assert (tmp_path / "f.txt").read_bytes() == b"old"
    assert torch.equal(torch.load(tmp_path / "f.pt", weights_only=True)["x"], torch.ones(1))
    assert _temp_files(tmp_path) == []
    atomic_write_bytes(tmp_path / "sub" / "g.txt", b"new")  # creates the directory
    assert (tmp_path / "sub" / "g.txt").read_bytes() == b"new"


def test_saving_weights_only_removes_a_stale_state(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", {"w": torch.zeros(1)}, {"epoch": 1})
    save_checkpoint(tmp_path / "ck", {"w": torch.ones(1)})
    assert not (tmp_path / "ck.state.pt").exists()
    assert torch.equal(load_weights(tmp_path / "ck")["w"], torch.ones(1))


_SAVE_LOOP = textwrap.dedent(
    """
    import sys, torch
    from lgvit.checkpoints.files import save_checkpoint
    stem = sys.argv[1]
    for step in range(1, 100000):
        w = torch.full((256, 256), float(step))
        save_checkpoint(stem, {"w": w}, {"global_step": step, "ema": {"w": w.clone()}})
        print(step, flush=True)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_during_save_loop_leaves_a_loadable_pair(tmp_path: Path) -> None:
    stem = tmp_path / "last"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVE_LOOP, str(stem)], stdout=subprocess.PIPE, text=True
    )
    try:
        steps = 0
        deadline = time.monotonic() + 30
        while steps < 5 and time.monotonic() < deadline:  # a few complete saves, then more
            line = proc.stdout.readline()
            if not line:
                break
            steps = int(line)
        assert steps >= 5, "the save loop did not run"
        time.sleep(random.uniform(0.0, 0.05))  # land somewhere inside a later save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    weights, state = load_checkpoint_pair(stem)
    assert state["global_step"] >= steps
    assert torch.all(weights["w"] == state["global_step"])
    assert torch.equal(state["ema"]["w"], weights["w"])


class _ScriptConfig(dict):
    """Like a training script's config object (yacs' CfgNode is a dict subclass)."""


def test_training_script_checkpoint_gives_its_weights_without_running_code(tmp_path: Path):
    # What the authors' training scripts save: the weights next to argparse/config objects
    # that weights_only refuses. The weights load; the other objects are never built.
    import argparse

    marker = tmp_path / "pwned"
    sd = _tiny_model().state_dict()
    cfg = _ScriptConfig(lr=0.1)
    torch.save(
        {"model": sd, "args": argparse.Namespace(lr=0.1), "config": cfg, "epoch": 299,
         "hook": _Evil(marker)},
        tmp_path / "released.pth",
    )  # fmt: skip
    with pytest.warns(UserWarning, match="weights only"):
        got = load_weights(tmp_path / "released.pth")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert not marker.exists()
