"""The model contract: every registered model, whatever its family, passes these checks.

Each model runs at the small ``smoke_input_size`` its config stores. Models are built once per
name (a module-scoped fixture, so pytest runs all checks of one model together).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import quick_init

import lgvit
from lgvit.models.layers import Stage

ALL = lgvit.list_models()


@pytest.fixture(scope="module", autouse=True)
def _quick_init():
    """Nothing here depends on the initial draw (finite gradients, equal outputs of two paths
    of the same weights, shapes, names); most of the time of building a model is it."""
    with quick_init():
        yield


@pytest.fixture(scope="module", params=ALL)
def built(request):
    name = request.param
    cfg = lgvit.get_model_config(name)
    torch.manual_seed(0)
    model = lgvit.create_model(name, num_classes=7, img_size=cfg.smoke_input_size[-1])
    x = torch.randn(3, *cfg.smoke_input_size)
    return name, model, x


def test_forward_backward(built):
    name, model, x = built
    m = copy.deepcopy(model).train()
    y = m(x[:2])
    assert y.shape == (2, 7)
    y.logsumexp(-1).sum().backward()
    for n, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: {n} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name}: {n} has a non-finite gradient"


def test_batch_of_one_equals_batch(built):
    name, model, x = built
    m = model.eval()
    with torch.no_grad():
        full = m(x)
        single = m(x[1:2])
    torch.testing.assert_close(single[0], full[1], rtol=1e-4, atol=1e-4)


def test_feature_info_agrees_with_intermediates(built):
    name, model, x = built
    m = model.eval()
    with torch.no_grad():
        final, maps = m.forward_intermediates(x[:1])
        feats = m.forward_features(x[:1])
    info = m.feature_info
    assert len(maps) == len(info) > 0
    for f, i in zip(maps, info, strict=True):
        assert f.shape[1] == i["num_chs"], f"{name}: {i['module']} channels"
        # The stride: the map is the input over the reduction, give or take the rounding of
        # convs and pools on sizes they do not divide.
        for d in (-2, -1):
            want = x.shape[d] / i["reduction"]
            assert abs(f.shape[d] - want) < 1, f"{name}: {i['module']} stride {i['reduction']}"
    torch.testing.assert_close(final, feats)
    assert info.channels() == [i["num_chs"] for i in info]


def test_features_only(built):
    name, model, x = built
    cfg = lgvit.get_model_config(name)
    n = len(model.feature_info)
    take = [0, n - 1] if n > 1 else [0]
    fm = lgvit.create_model(
        name, img_size=cfg.smoke_input_size[-1], features_only=True, out_indices=take
    ).eval()
    with torch.no_grad():
        maps = fm(x[:1])
    assert [m.shape[1] for m in maps] == fm.feature_info.channels()
    assert fm.feature_info.channels() == [model.feature_info[i]["num_chs"] for i in take]
    # timm's FeatureInfo: every level in .info, the returned ones by out_indices
    info = fm.feature_info
    assert info.out_indices == tuple(take) and len(info.info) == n
    assert [d["index"] for d in info.get_dicts()] == take
    assert all(fm.model.get_submodule(mod) is not None for mod in info.module_name())
    assert fm.default_cfg is fm.pretrained_cfg and fm.output_fmt == "NCHW"


def test_timm_feature_and_head_layouts(built):
    """timm's contract: forward_features in ``output_fmt`` (a pyramid's NHWC map of
    ``pool_size`` at the config's input size, or ViT tokens), pre-logits of
    ``head_hidden_size``, and with no classifier and no pooling the unpooled features."""
    name, model, x = built
    m = copy.deepcopy(model).eval()
    with torch.no_grad():
        feats = m.forward_features(x[:1])
        pre = m.forward_head(feats, pre_logits=True)
        assert pre.shape == (1, m.head_hidden_size)
        torch.testing.assert_close(m.forward_head(feats), m(x[:1]))
        if m.output_fmt == "NHWC":
            assert feats.shape[0] == 1 and feats.shape[-1] == m.num_features, name
            assert tuple(feats.shape[1:3]) == m.pretrained_cfg["pool_size"], name
        else:
            assert m.output_fmt == "NLC" and feats.ndim == 3 and m.num_prefix_tokens > 0
        m.reset_classifier(0, "")
        torch.testing.assert_close(m(x[:1]), feats)


def test_reset_classifier_and_pooling(built):
    name, model, x = built
    m = copy.deepcopy(model).eval()
    assert m.get_classifier() is m.head
    m.reset_classifier(3)
    assert m(x[:1]).shape == (1, 3)
    m.reset_classifier(0)
    assert m(x[:1]).shape == (1, m.num_features) and m.head_hidden_size == m.num_features
    with pytest.raises(ValueError, match="global_pool"):
        m.reset_classifier(2, global_pool="max-ish")


def test_no_weight_decay_names_exist(built):
    name, model, _ = built
    names = dict(model.named_parameters())
    nwd = model.no_weight_decay()
    assert all(n in names for n in nwd), f"{name}: {sorted(set(nwd) - set(names))}"
    assert all("pos_embed" not in n or n in nwd for n in names), f"{name}: a pos_embed decays"


def test_position_embeddings_resize_on_load(built):
    name, model, x = built
    cfg = lgvit.get_model_config(name)
    big = lgvit.create_model(name, num_classes=7, img_size=2 * cfg.smoke_input_size[-1])
    res = big.load_state_dict(model.state_dict())
    assert not res.missing_keys and not res.unexpected_keys
    with torch.no_grad():
        y = big.eval()(torch.randn(1, 3, 2 * x.shape[-2], 2 * x.shape[-1]))
    assert torch.isfinite(y).all()


def test_grad_checkpointing_same_outputs_and_gradients(built):
    name, model, x = built
    outs, grads = [], []
    for enable in (False, True):
        m = copy.deepcopy(model).train()
        m.set_grad_checkpointing(enable)
        torch.manual_seed(5)  # drop path draws the same masks both times
        y = m(x[:2])
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0])
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)
    assert any(isinstance(s, Stage) and s.grad_checkpointing for s in m.modules()) or (
        m.stages_attr == "blocks" and m.grad_checkpointing
    )


def test_pretrained_cfg_is_timm_shaped(built):
    name, model, _ = built
    cfg = model.pretrained_cfg
    for key in ("input_size", "mean", "std", "crop_pct", "interpolation", "num_classes",
                "first_conv", "classifier"):  # fmt: skip
        assert key in cfg, f"{name}: pretrained_cfg has no {key!r}"
    assert model.default_cfg["mean"] == cfg["mean"]
    assert cfg["input_size"][1:] == tuple(model.img_size)
    assert cfg["num_classes"] == 7
    assert isinstance(model.get_submodule(cfg["classifier"]), torch.nn.Linear)
    model.get_submodule(cfg["first_conv"])  # names a real module
