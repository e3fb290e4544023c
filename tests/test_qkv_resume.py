"""A training run saved before q/k/v were stored as one ``qkv`` parameter (its weights, EMA and
optimizer state hold ``q`` and ``kv`` separately) resumes exactly as the same run saved today.

The older layout is made here from today's checkpoint by plain row slicing, written without the
library's conversion code (the one in lgvit stacks; this splits), so both directions are checked
against each other: the resumed runs must end bit-identical. tests/test_legacy_rundir.py resumes
a run the older code itself wrote (within rounding, its arithmetic differs)."""

from __future__ import annotations

import shutil
import signal

import torch
from test_hardening import SYN
from test_train import ENV, lgvit, metrics

import lgvit as lg
from lgvit.checkpoints.files import load_checkpoint_pair, load_metadata, save_checkpoint
from lgvit.models.layers.attention import fuse_older_qkv
from lgvit.run.optim import param_groups
from lgvit.tools.average import average_weights

RUN = [*SYN, "--epochs", "2", "--model-ema"]


def _fused_rows(model: torch.nn.Module) -> dict[str, int]:
    """Each ``qkv`` parameter's name -> its q rows (the rest are kv's)."""
    return {f"{n}.qkv.{part}": m.num_heads * m.head_dim
            for n, m in model.named_modules() if getattr(m, "fused", False)
            for part in ("weight", "bias")}  # fmt: skip


def _split(state: dict, rows: dict[str, int]) -> dict:
    out = {}
    for k, v in state.items():
        if k in rows:
            head, _, part = k.rpartition(".qkv.")
            out[f"{head}.q.{part}"], out[f"{head}.kv.{part}"] = v[: rows[k]], v[rows[k] :]
        else:
            out[k] = v
    return out


def _older_optimizer(opt: dict, model: torch.nn.Module, rows: dict[str, int]) -> dict:
    """The optimizer state as the older layout numbered it: each qkv as q then kv, in place."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in param_groups(model, 0.05)]
    assert [len(g) for g in groups] == [len(g["params"]) for g in opt["param_groups"]]
    state, new_groups, index = {}, [], 0
    for group, saved in zip(groups, opt["param_groups"], strict=True):
        ids = []
        for name, i in zip(group, saved["params"], strict=True):
            entry = opt["state"][i]
            parts = [entry]
            if name in rows:
                r = rows[name]
                cut = [{k: v[:r] if v.ndim else v.clone() for k, v in entry.items()},
                       {k: v[r:] if v.ndim else v.clone() for k, v in entry.items()}]  # fmt: skip
                parts = cut
            for part in parts:
                state[index] = part
                ids.append(index)
                index += 1
        new_groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": new_groups}


def _rewrite_as_older(stem, model):
    weights, state = load_checkpoint_pair(stem)
    rows = _fused_rows(model)
    assert rows, "the model has fused qkv parameters"
    state["optimizer"] = _older_optimizer(state["optimizer"], model, rows)
    state["ema"] = _split(state["ema"], rows)
    meta = {k: v for k, v in load_metadata(f"{stem}.safetensors").items() if k != "pair_id"}
    save_checkpoint(stem, _split(weights, rows), state, meta)
    older, _ = load_checkpoint_pair(stem)
    assert any(k.endswith(".q.weight") for k in older) and not any(".qkv." in k for k in older)


def test_a_run_saved_before_the_fusion_resumes_exactly(tmp_path):
    today, older = tmp_path / "today", tmp_path / "older"
    p = lgvit("train", *RUN, "--out", str(today), env={**ENV, "LGVIT_SIGTERM_AT_STEP": "20"})
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-2000:]
    shutil.copytree(today, older)
    model = lg.create_model("lsa_micro_cifar")
    _rewrite_as_older(older / "last", model)
    for run in (today, older):
        r = lgvit("train", "--out", str(run), "--resume", "auto")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "at epoch 2 step 4/16" in r.stdout, r.stdout[-2000:]
    untimed = [[{k: v for k, v in m.items() if "time" not in k and "per_s" not in k}
                for m in metrics(run)] for run in (today, older)]  # fmt: skip
    assert untimed[0] == untimed[1]
    (a, sa), (b, sb) = load_checkpoint_pair(today / "last"), load_checkpoint_pair(older / "last")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(sa["ema"][k], sb["ema"][k]) for k in sa["ema"])
    for i, entry in sa["optimizer"]["state"].items():
        assert all(torch.equal(v, sb["optimizer"]["state"][i][k]) for k, v in entry.items())


def test_an_older_ema_and_a_weight_average_take_the_fused_layout():
    model = lg.create_model("lsa_micro_cifar")
    rows = _fused_rows(model)
    today = model.state_dict()
    older = _split(today, rows)
    assert fuse_older_qkv(model, older).keys() == today.keys()
    assert all(torch.equal(fuse_older_qkv(model, older)[k], v) for k, v in today.items())
    # kept epochs of a run resumed across the change: both layouts, averaged as one
    mean = average_weights([older, today], ["older", "today"])
    assert mean.keys() == today.keys()
    assert all(torch.allclose(mean[k].double(), v.double()) for k, v in today.items())
