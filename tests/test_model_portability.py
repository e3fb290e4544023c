"""Portability: every registered model traces with torch.fx (plain and with timm's tracer
arguments), runs in float16 and under float16 autocast, takes channels_last, names real
``first_conv`` and ``classifier`` weights, and builds for 1 or 4 input channels, where 3-channel
weights load adapted as timm adapts them.

Each model runs at its small ``smoke_input_size``, built once per name (as test_contract.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from conftest import quick_init
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import lgvit
from lgvit.models.loading import adapt_first_convs, adapt_input_conv

ALL = lgvit.list_models()


def timm_tracer_kwargs() -> dict:
    """The tracer arguments timm's own fx tests trace its models with."""
    timm_models = pytest.importorskip("timm.models")
    return dict(
        leaf_modules=timm_models.get_notrace_modules(),
        autowrap_functions=timm_models.get_notrace_functions(),
        param_shapes_constant=True,
    )


TRACERS = {"plain": None, "timm": "timm"}
# timm's tracer arguments name only timm's own modules and functions, so they trace lgvit's
# models as the plain tracer does; one model per family checks that (suite time).
TIMM_TRACED = {
    "lsa_tiny_cifar", "lsa_tiny_224_authors", "deit_tiny", "localvit_tiny", "localvit_t2t_vit_7",
    "tnt_tiny", "pvt_tiny", "lit_ti", "lit_s", "swin_tiny",
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _quick_init():
    """Nothing here depends on the initial draw (traces equal to eager, finite half-precision
    outputs, strictly loaded adapted weights); this file builds each model three times."""
    with quick_init():
        yield


@pytest.fixture(scope="module", params=ALL)
def built(request):
    name = request.param
    cfg = lgvit.get_model_config(name)
    torch.manual_seed(0)
    model = lgvit.create_model(name, num_classes=42, img_size=cfg.smoke_input_size[-1]).eval()
    x = torch.randn(2, *cfg.smoke_input_size)
    with torch.no_grad():
        y = model(x)
    return name, model, x, y


def _kwargs(tracer: str | None, name: str) -> dict:
    if tracer == "timm" and name not in TIMM_TRACED:
        pytest.skip("timm's tracer arguments: one model per family (TIMM_TRACED)")
    return timm_tracer_kwargs() if tracer == "timm" else {}


@pytest.mark.parametrize("tracer", list(TRACERS.values()), ids=list(TRACERS))
def test_fx_trace_and_feature_extractor_eval(built, tracer):
    name, model, x, y = built
    kw = _kwargs(tracer, name)
    _, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
    fx = create_feature_extractor(model, return_nodes=[eval_nodes[-1]], tracer_kwargs=kw).eval()
    with torch.no_grad():
        if not kw:
            torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), y, rtol=0, atol=1e-6)
        (out,) = fx(x).values()
        torch.testing.assert_close(out, y, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("tracer", list(TRACERS.values()), ids=list(TRACERS))
def test_fx_train_backward(built, tracer):
    """timm's test_model_backward_fx: traced in train mode, every parameter gets a gradient."""
    name, model, x, _ = built
    kw = _kwargs(tracer, name)
    m = copy.deepcopy(model).train()
    train_nodes, eval_nodes = get_graph_node_names(m, tracer_kwargs=kw)
    fx = create_feature_extractor(
        m, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]],
        tracer_kwargs=kw,
    ).train()  # fmt: skip
    (out,) = fx(x).values()
    assert out.shape == (2, 42)
    out.mean().backward()
    for n, p in fx.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: {n} got no gradient through the traced graph"


def test_fx_traced_model_still_checks_its_input(built):
    name, model, x, _ = built
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(ValueError, match="floating-point"):
        gm((x * 255).to(torch.uint8))


def test_half_and_float16_autocast(built):
    name, model, x, y = built
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.float16):
            amp = model(x)
        half = copy.deepcopy(model).half()(x.half())
    assert half.dtype == torch.float16
    for got in (amp, half):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.float(), y, rtol=0.05, atol=0.05, msg=name)


def test_channels_last(built):
    name, model, x, y = built
    m = copy.deepcopy(model).to(memory_format=torch.channels_last)
    convs = [p for p in m.parameters() if p.ndim == 4 and p.shape[-1] > 1]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convs), name
    assert all(p.shape == q.shape for p, q in zip(m.parameters(), model.parameters(), strict=True))
    with torch.no_grad():
        for inp in (x, x.contiguous(memory_format=torch.channels_last)):
            torch.testing.assert_close(m(inp), y, rtol=1e-5, atol=1e-5, msg=name)  # conv order


def test_first_conv_and_classifier_name_weights(built):
    name, model, _, _ = built
    cfg = model.pretrained_cfg
    sd = model.state_dict()
    first = (cfg["first_conv"],) if isinstance(cfg["first_conv"], str) else cfg["first_conv"]
    for conv in first:
        assert f"{conv}.weight" in sd, f"{name}: first_conv {conv!r} names no weight"
        w = sd[f"{conv}.weight"]
        # A conv's input channels; T2T's first layer is a linear map of unfolded 7x7 patches.
        assert (w.shape[-3] if w.ndim >= 3 else w.shape[-1] // 49) == 3, f"{name}: {conv!r}"
    assert f"{cfg['classifier']}.weight" in sd, f"{name}: classifier names no weight"


def test_in_chans_builds_runs_and_adapts_rgb_weights(built):
    name, model, x, _ = built
    cfg = lgvit.get_model_config(name)
    for in_chans in (1, 4):
        m = lgvit.create_model(
            name, num_classes=42, img_size=cfg.smoke_input_size[-1], in_chans=in_chans
        ).eval()
        assert m.pretrained_cfg["input_size"][0] == in_chans
        if not name.endswith("t2t_vit_7"):  # T2T's LayerNorm over unfolded patches: no adapting
            adapted = adapt_first_convs(model.state_dict(), m, cfg.first_conv)
            m.load_state_dict(adapted)  # strict: every first conv now fits
        with torch.no_grad():
            y = m(torch.randn(1, in_chans, *x.shape[-2:]))
        assert y.shape == (1, 42) and torch.isfinite(y).all()


@pytest.mark.parametrize("in_chans", [1, 2, 4, 7])
@pytest.mark.parametrize("shape", [(8, 3, 3, 3), (5, 8, 3, 3, 3)])
def test_adapt_input_conv_matches_timm(in_chans, shape):
    manipulate = pytest.importorskip("timm.models._manipulate")
    w = torch.randn(shape)
    ours = adapt_input_conv(w, in_chans)
    if len(shape) == 4:
        want = manipulate.adapt_input_conv(in_chans, w.clone())
    else:  # LSA's stacked convs: each of the T convs adapted alone
        want = torch.stack([manipulate.adapt_input_conv(in_chans, c.clone()) for c in w])
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    assert adapt_input_conv(w.half(), in_chans).dtype == torch.float16


@pytest.mark.parametrize("name", ["deit_tiny", "lsa_tiny_cifar"])
def test_rgb_checkpoint_loads_into_other_channel_counts(name, tmp_path):
    cfg = lgvit.get_model_config(name)
    size = cfg.smoke_input_size[-1]
    torch.manual_seed(0)
    rgb = lgvit.create_model(name, num_classes=5, img_size=size)
    path = tmp_path / "rgb.pth"
    torch.save(rgb.state_dict(), path)
    key = f"{cfg.first_conv}.weight"
    for in_chans in (1, 4):
        m = lgvit.create_model(name, img_size=size, in_chans=in_chans, checkpoint_path=str(path))
        want = adapt_input_conv(rgb.state_dict()[key], in_chans)
        torch.testing.assert_close(m.state_dict()[key], want, rtol=0, atol=0)
        if in_chans == 1:  # a grey image: the logits the RGB model gives it in three channels
            grey = torch.randn(1, 1, size, size)
            with torch.no_grad():
                got, ref = m.eval()(grey), rgb.eval()(grey.expand(-1, 3, -1, -1))
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["deit_tiny", "t2t_vit_7", "lsa_tiny_cifar"])
def test_wrong_input_size_names_the_image_and_the_size_taken(name):
    m = lgvit.create_model(name).eval()
    side = m.img_size[0]
    with torch.no_grad(), pytest.raises(ValueError) as err:
        m(torch.randn(1, 3, side + 8 if side < 64 else 40, side + 8 if side < 64 else 40))
    msg = str(err.value)
    got = side + 8 if side < 64 else 40
    assert f"input {got}x{got} gives" in msg and f"{side}x{side}" in msg, msg
    assert "\n" not in msg
