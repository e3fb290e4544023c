"""Dynamo traces one model of every family as one graph, with no call that older torch's Dynamo
cannot trace.

lgvit supports torch 2.4 and later. torch 2.11's Dynamo broke the graph at
``torch.amp.is_autocast_available`` (torch 2.14's, installed here, traces it); the models asked
it in every forward (the input check, LSA's folded statistics). These tests make the calls that
older Dynamo cannot trace break the graph here too, and ask ``torch._dynamo.explain`` for one
graph and no break: in float32 and under bf16 autocast, in eval and training mode.
``tests/test_compile.py`` compiles the same families and checks outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch

import lgvit
from lgvit.models import get_model_config

# One model per family (and per LSA path: folded, plain, the CvT stem), smallest of each.
MODELS = (
    "lsa_micro_cifar", "lsa_tiny_224", "lsa_tiny_cifar_cvt_local", "deit_tiny", "pvt_tiny",
    "swin_tiny", "t2t_vit_7", "tnt_tiny", "lit_ti", "localvit_tiny", "localvit_pvt_tiny",
    "localvit_swin_tiny", "localvit_t2t_vit_7", "localvit_tnt_tiny",
)  # fmt: skip
# Each built shallow and narrow: every code path of its family at a fraction of the tracing
# (Swin keeps two blocks in its first stage, the second one's windows shifted and masked).
SMALL = {
    "lsa_micro_cifar": dict(dims=(32, 64), depths=(1, 1), num_heads=(2, 2)),
    "lsa_tiny_224": dict(dims=(48, 48), depths=(1, 1)),  # its patch still wider: plain path
    "lsa_tiny_cifar_cvt_local": dict(dims=(48, 48), depths=(1, 1)),
    "deit_tiny": dict(depth=1),
    "pvt_tiny": dict(depths=(1, 1, 1, 1)),
    "swin_tiny": dict(depths=(2, 1, 1, 1)),
    "t2t_vit_7": dict(depth=1),
    "tnt_tiny": dict(depth=1),
    "lit_ti": dict(depths=(1, 1, 1, 1)),
    "localvit_tiny": dict(depth=1),
    "localvit_pvt_tiny": dict(depths=(1, 1, 1, 1)),
    "localvit_swin_tiny": dict(depths=(2, 1, 1, 1)),
    "localvit_t2t_vit_7": dict(depth=1),
    "localvit_tnt_tiny": dict(depth=1),
}

# Calls torch 2.4-2.11's Dynamo cannot trace (a graph break there), by module and name.
UNTRACEABLE_BEFORE_2_14 = ((torch.amp, "is_autocast_available"),)


@pytest.fixture(autouse=True)
def _as_older_dynamo(monkeypatch):
    """Each untraceable call breaks the graph here as it does on older torch."""
    for module, name in UNTRACEABLE_BEFORE_2_14:
        real = getattr(module, name, None)
        if real is None:
            continue

        def breaking(*args, _real=real, **kwargs):
            torch._dynamo.graph_break()
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, breaking)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    size = get_model_config(name).smoke_input_size
    torch.manual_seed(0)
    kwargs = dict(num_classes=5, img_size=size[-1], **SMALL[name])
    return lgvit.create_model(name, **kwargs), torch.randn(2, *size)


def _explain(model: torch.nn.Module, x: torch.Tensor, amp: bool):
    """``explain`` of the forward: under autograd in training mode, as a training step runs."""
    with torch.autocast("cpu", torch.bfloat16, enabled=amp), torch.set_grad_enabled(model.training):
        return torch._dynamo.explain(model)(x)


@pytest.mark.parametrize("name", MODELS)
def test_one_graph_in_float32_eval_and_bf16_training(name):
    """Eval in float32, then the training forward under bf16 autocast (where the autocast
    type is read): one graph each, no break."""
    model, x = _model(name)
    for train, amp in ((False, False), (True, True)):
        model.train(train)
        out = _explain(model, x, amp)
        reasons = [(r.reason, r.user_stack[-1:]) for r in out.break_reasons]
        mode = f"{name} {'train bf16' if amp else 'eval fp32'}"
        assert out.graph_break_count == 0, f"{mode}: {reasons}"
        assert out.graph_count == 1, mode


@pytest.mark.parametrize("name", ["lsa_micro_cifar", "deit_tiny"])
def test_one_graph_in_bf16_eval_and_float32_training(name):
    """The other two combinations, where the code branches on precision and mode: LSA's fold,
    and the CPU attention kernel's choice without a mask (with one, as in Swin's shifted
    windows, it is the same in every mode on the CPU)."""
    model, x = _model(name)
    for train, amp in ((False, True), (True, False)):
        model.train(train)
        out = _explain(model, x, amp)
        assert out.graph_break_count == 0, [
            (r.reason, r.user_stack[-1:]) for r in out.break_reasons
        ]
        assert out.graph_count == 1
