"""torch.compile on one model per family: the whole forward is one graph (``fullgraph=True``,
no graph break) in inference and in training (forward and backward through AOT autograd), a new
batch size reuses the graph (no recompile), and the outputs and gradients are eager's.

Dynamo's tracing is what these check, with the cheap ``eager`` / ``aot_eager`` backends: the
graph Inductor would compile is the same one (``lgvit bench --compile`` and ``lgvit train
--compile`` run Inductor itself). Each model runs at its small ``smoke_input_size``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lgvit
from lgvit.models import get_model_config

# One model per family (and per code path that differs within one: LSA's per-variant convs,
# LSA's CvT stem, LIT's deformable merging, T2T's performer, TNT's inner blocks).
FAMILIES = (
    "lsa_micro_cifar", "lsa_tiny_cifar_cvt_local", "lsa_tiny_224_authors", "deit_tiny",
    "localvit_tiny", "localvit_t2t_vit_7", "tnt_tiny", "pvt_tiny", "lit_ti", "lit_s",
    "swin_tiny",
)  # fmt: skip
# LGVIT_TEST_ALL_COMPILE=1: all registered models (about 15 min on 2 cores).
NAMES = lgvit.list_models() if os.environ.get("LGVIT_TEST_ALL_COMPILE") == "1" else FAMILIES


def _model(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    size = get_model_config(name).smoke_input_size
    torch.manual_seed(0)
    model = lgvit.create_model(name, num_classes=5, img_size=size[-1], drop_path_rate=0.0)
    for m in model.modules():  # T2T's performer dropout: the two runs would draw other masks
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model, size


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", NAMES)
def test_inference_is_one_graph_for_every_batch_size(name):
    model, size = _model(name)
    model.eval()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, *size)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} compiles for 3 batch sizes"


@pytest.mark.parametrize("name", NAMES)
def test_training_step_is_one_graph_with_eagers_gradients(name):
    model, size = _model(name)
    model.train()
    twin = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, *size)
    compiled(x).square().mean().backward()
    twin(x).square().mean().backward()
    assert counter.frame_count == 1, name
    for (key, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, key
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{name} {key}: {m}")  # fmt: skip


@pytest.mark.parametrize("name", ["deit_tiny", "swin_tiny"])
def test_bf16_autocast_inference_is_one_graph(name):
    """Under bf16 autocast on the CPU the attention kernel is chosen from the CPU's features
    (read from /proc/cpuinfo once): a constant to the compiler, not a graph break."""
    model, size = _model(name)
    model.eval()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, *size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    assert counter.frame_count == 1
