"""LIT: parameter counts and MACs against the paper, dense-prediction shapes, the offset learning
rate, and the authors' checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lgvit
from lgvit.models.layers import DeformableTokenMerging
from lgvit.run.optim import param_groups
from lgvit.tools.measure import count_macs, count_params

FIXTURE = Path(__file__).parent / "fixtures" / "lit_keys.json"
LIT = ["lit_ti", "lit_s", "lit_m", "lit_b"]
ABLATIONS = [n for n in lgvit.list_models() if "params_int_m" in lgvit.get_model_config(n).paper]


def meta(name: str, **kw):
    with torch.device("meta"):
        return lgvit.create_model(name, **kw)


@pytest.mark.parametrize("name", LIT)
def test_lit_params_and_macs_match(name):
    paper = lgvit.get_model_config(name).paper
    m = meta(name)
    n = count_params(m) / 1e6
    assert abs(n - paper["params_m"]) / paper["params_m"] < 0.01, f"{name}: {n:.3f}M"
    # The paper prints whole millions: the counts without the classifier head, truncated.
    paper_int = {"lit_ti": 19, "lit_s": 27, "lit_m": 48, "lit_b": 86}[name]
    assert int(count_params(m, include_head=False) / 1e6) == paper_int
    macs = count_macs(m, (3, 224, 224)) / 1e9
    assert abs(macs - paper["macs_g"]) / paper["macs_g"] < 0.01, f"{name}: {macs:.3f}G"


@pytest.mark.parametrize("name", ABLATIONS)
def test_ablation_sizes_match_the_papers_whole_millions(name):
    paper = lgvit.get_model_config(name).paper
    m = meta(name)
    n = count_params(m, include_head=paper["params_int_head"]) / 1e6
    assert round(n) == paper["params_int_m"], f"{name}: {n:.2f}M"
    macs = count_macs(m, (3, 224, 224)) / 1e9
    assert abs(macs - paper["macs_g"]) < 0.06, f"{name}: {macs:.2f}G vs {paper['macs_g']}G"


def test_structure_mlp_stages_and_merging():
    ti = meta("lit_ti")
    assert all(b.attn is None for s in ti.stages[:2] for b in s.blocks)
    assert all(b.attn is not None and b.attn.sr_ratio == 1 for s in ti.stages[2:] for b in s.blocks)
    assert all(isinstance(s.downsample, DeformableTokenMerging) for s in ti.stages[1:])
    assert ti.stages[3].cls_token is not None and ti.global_pool == "token"
    s = meta("lit_s")
    attn = s.stages[2].blocks[0].attn
    assert attn.rel_pos.grid == (14, 14) and s.global_pool == "avg"
    assert attn.rel_pos.relative_position_bias_table.shape == (27 * 27, 12)


@pytest.mark.parametrize("name", ["lit_ti", "lit_s"])
def test_dense_prediction_at_512x384(name):
    torch.manual_seed(0)
    m = lgvit.create_model(name, img_size=(512, 384), depths=(1, 1, 1, 1)).eval()
    fm = lgvit.create_model(name, img_size=(512, 384), depths=(1, 1, 1, 1), features_only=True)
    with torch.no_grad():
        maps = m.forward_intermediates(torch.randn(1, 3, 512, 384), intermediates_only=True)
        maps2 = fm.eval()(torch.randn(1, 3, 512, 384))
    want = [(128, 96), (64, 48), (32, 24), (16, 12)]
    assert [tuple(t.shape[-2:]) for t in maps] == want
    assert [t.shape[1] for t in maps] == m.feature_info.channels()
    assert m.feature_info.reduction() == [4, 8, 16, 32] == fm.feature_info.reduction()
    assert [tuple(t.shape[-2:]) for t in maps2] == want
    # A 224px checkpoint loads into the 512x384 backbone: absolute positions (bilinear) and
    # relative-bias tables (bicubic) are resized.
    res = m.load_state_dict(lgvit.create_model(name, depths=(1, 1, 1, 1)).state_dict())
    assert not res.missing_keys and not res.unexpected_keys


def test_offset_weights_train_at_a_fraction_of_the_rate():
    m = meta("lit_ti")
    groups = param_groups(m, 0.05, 0.01)
    names = {id(p): n for n, p in m.named_parameters()}
    offsets = [g for g in groups if g["lr_scale"] == 0.01]
    assert len(offsets) == 1 and offsets[0]["weight_decay"] == 0.05
    assert sorted(names[id(p)] for p in offsets[0]["params"]) == [
        f"stages.{i}.downsample.offset_conv.weight" for i in (1, 2, 3)
    ]
    no_decay = next(g for g in groups if g["weight_decay"] == 0.0)
    nd = {names[id(p)] for p in no_decay["params"]}
    assert "stages.1.downsample.offset_conv.bias" in nd and no_decay["lr_scale"] == 1.0


def test_odd_batches_and_offsets_that_move():
    torch.manual_seed(0)
    m = lgvit.create_model("lit_ti", img_size=64).eval()
    for s in m.stages[1:]:
        torch.nn.init.normal_(s.downsample.offset_conv.weight, std=0.5)
    x = torch.randn(5, 3, 64, 64)  # the authors' CUDA kernel refuses odd batches >= 5
    with torch.no_grad():
        full = m(x)
        torch.testing.assert_close(m(x[3:4]), full[3:4], rtol=1e-4, atol=1e-4)


def _authors_sd(keys: list) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, shape in keys:
        if k.endswith(("relative_position_index", "num_batches_tracked")):
            sd[k] = torch.zeros(shape, dtype=torch.long)
        elif k.endswith("running_var"):
            sd[k] = torch.rand(shape, generator=g) + 0.5
        else:
            sd[k] = 0.02 * torch.randn(shape, generator=g)
    return sd


@pytest.mark.parametrize("name", ["lit_ti", "lit_s", "lit_m", "lit_b"])
def test_authors_key_names_and_shapes_load_strictly(name, tmp_path):
    # Facts from the authors' models (built once from their code): every key and shape.
    keys = json.loads(FIXTURE.read_text())[name]
    assert any("dconv.conv_offset" in k for k, _ in keys)
    torch.save(_authors_sd(keys), tmp_path / f"{name}.pth")
    with torch.device("meta") if name in ("lit_m", "lit_b") else torch.device("cpu"):
        m = lgvit.create_model(name)
    if name in ("lit_m", "lit_b"):
        m = m.to_empty(device="cpu")
    m.load_state_dict(m.checkpoint_filter_fn(_authors_sd(keys)))  # strict
    if name in ("lit_ti", "lit_s"):
        m = lgvit.create_model(name, checkpoint_path=str(tmp_path / f"{name}.pth")).eval()
        with torch.no_grad():
            assert torch.isfinite(m(torch.randn(1, 3, 224, 224))).all()
