"""Layer-wise learning-rate decay (``layer_decay``) for fine-tuning: each parameter's rate and
weight decay equal timm's ``param_groups_layer_decay`` on the same model, for every family."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_train import ENV, FAST

import lgvit
from lgvit.run.optim import layer_ids, param_groups

timm_groups = pytest.importorskip("timm.optim._param_groups").param_groups_layer_decay

# One model of each family and layout: plain ViTs (blocks), pyramids (stages of blocks).
FAMILIES = ["lsa_micro_cifar", "lsa_tiny_224", "localvit_tiny", "localvit_pvt_tiny",
            "localvit_swin_tiny", "localvit_t2t_vit_7", "localvit_tnt_tiny", "lit_ti",
            "deit_tiny", "pvt_tiny", "swin_tiny", "t2t_vit_7", "tnt_tiny"]  # fmt: skip


def _rates(groups) -> dict[int, tuple[float, float]]:
    return {id(p): (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_parameters_rate_is_timms(name):
    with torch.device("meta"):
        model = lgvit.create_model(name)
    ours = _rates(param_groups(model, 0.05, 1.0, layer_decay=0.75))
    ref = _rates(timm_groups(model, 0.05, model.no_weight_decay(), layer_decay=0.75))
    assert ours.keys() == ref.keys()
    for n, p in model.named_parameters():
        assert ours[id(p)][0] == pytest.approx(ref[id(p)][0], rel=1e-12), n
        assert ours[id(p)][1] == ref[id(p)][1], n
    ids = layer_ids(model)
    assert ids[next(iter(ids))] == 0  # the stem (patch embedding) first
    assert len(set(ids.values())) > 3  # a real ladder of layers, not one group


def test_lit_offsets_keep_their_factor_under_layer_decay():
    with torch.device("meta"):
        model = lgvit.create_model("lit_ti")
    plain = _rates(param_groups(model, 0.05, 1.0, layer_decay=0.75))
    slow = _rates(param_groups(model, 0.05, 0.01, layer_decay=0.75))
    offsets = [p for n, p in model.named_parameters() if n.endswith("offset_conv.weight")]
    assert offsets
    for p in offsets:
        assert slow[id(p)][0] == pytest.approx(0.01 * plain[id(p)][0])


def test_without_layer_decay_the_groups_are_unchanged():
    """A run saved before keeps its optimizer state: the same two (or three) groups."""
    model = lgvit.create_model("lsa_micro_cifar")
    groups = param_groups(model, 0.05, 0.01)
    assert [(g["weight_decay"], g["lr_scale"]) for g in groups] == [(0.05, 1.0), (0.0, 1.0)]


def test_the_run_steps_with_the_decayed_rates(tmp_path):
    """Through the CLI: the saved optimizer's groups carry the decayed rates."""
    run = tmp_path / "ld"
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", *FAST, "--data", "synthetic", "--iters", "2",
         "--layer-decay", "0.5", "--set", "sched=none", "--set", "warmup_epochs=0",
         "--out", str(run)], capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    state = torch.load(run / "last.state.pt", weights_only=True)["train_state"]
    groups = state["optimizer"]["param_groups"]
    model = lgvit.create_model("lsa_micro_cifar", num_classes=10, img_size=16)
    last = max(layer_ids(model).values())
    scales = sorted({round(g["lr_scale"], 12) for g in groups})
    assert scales == sorted({round(0.5 ** (last - i), 12) for i in range(last + 1)})
    peak = max(g["lr"] for g in groups)
    for g in groups:
        assert g["lr"] == pytest.approx(peak * g["lr_scale"])
