"""``lgvit train --compile [MODE]`` on the CPU: the mode reaches ``torch.compile``, static shapes
give one graph per progressive-resizing size (and evaluation's), each logged once, the losses
are eager's, checkpoints hold the model's own keys and resume uncompiled; CUDA graphs' step
marks and output copies checked with a stand-in compiler (no GPU here).

One compiled run for the whole file, through AOT autograd's ``aot_eager`` backend: the graphs
Dynamo captures and the forward/backward split are Inductor's, only its code generation is
left out (with it the file took 10 minutes on 2 busy cores). ``LGVIT_TEST_INDUCTOR=1``
compiles with Inductor itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch._dynamo.testing import CompileCounterWithBackend

import lgvit
from lgvit.cli import build_parser, main
from lgvit.core.runtime import COMPILE_MODES
from lgvit.run import compiled
from lgvit.run.compiled import CompiledNet, compile_net
from lgvit.run.config import load_config
from lgvit.tasks.classification.train import ClassificationTask

# lsa_micro_cifar, 512 synthetic images at 16px, 4 steps an epoch; progressive resizing trains
# epoch 1 at 8px and epoch 2 at 16px. No drop path: the compiled graph's random numbers are
# not eager's, so the two runs would drop other paths.
ARGS = [
    "train", "--model", "lsa_micro_cifar", "--data", "synthetic", "--img-size", "16",
    "--batch-size", "128", "--epochs", "2", "--set", "log_every=1000",
    "--set", "warmup_epochs=1", "--set", "drop_path=0", "--set", "train_size_start=8",
    "--set", "train_size_ramp=[0.0,0.5]", "--amp", "none",
]  # fmt: skip
MODE = "max-autotune-no-cudagraphs"  # not the default: the test sees it arrive
BACKEND = "inductor" if os.environ.get("LGVIT_TEST_INDUCTOR") == "1" else "aot_eager"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An eager run and the same run compiled; the spy records torch.compile's arguments and
    compiles with ``BACKEND`` through a counter of the graphs it compiles (the mode is
    Inductor's alone: max-autotune would autotune every matmul, minutes on the CPU)."""
    root = tmp_path_factory.mktemp("compile")
    assert main([*ARGS, "--out", str(root / "eager")]) == 0
    calls, real = [], torch.compile
    counter = CompileCounterWithBackend(BACKEND)

    def spy(model, **kw):
        calls.append(kw)
        return real(model, backend=counter, dynamic=kw.get("dynamic"))

    torch._dynamo.reset()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "compile", spy)
            assert main([*ARGS, "--compile", MODE, "--out", str(root / "compiled")]) == 0
    finally:
        torch._dynamo.reset()
    return root / "eager", root / "compiled", calls, counter


def test_compiled_losses_are_eagers(runs):
    eager, comp, _, _ = runs
    want, got = _metrics(eager), _metrics(comp)
    assert [m["train_size"] for m in got] == [8, 16]
    for key in ("train_loss", "test_loss"):
        for w, g in zip(want, got, strict=True):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), (key, w[key], g[key])


def test_the_mode_reaches_torch_compile_with_static_shapes(runs):
    calls = runs[2]
    assert calls == [{"mode": MODE, "dynamic": False}]


def test_each_shape_compiles_once_and_is_logged_once(runs):
    """Two training sizes and evaluation's one batch (128 test images): 3 graphs, though each
    was fed every epoch, and one log line each, naming the input."""
    comp, counter = runs[1], runs[3]
    assert counter.frame_count == 3
    log = (comp / "train.log").read_text().splitlines()
    lines = [line for line in log if "torch.compile (" in line]
    assert len(lines) == 3, lines
    for shape, kind in (("128x3x8x8", "training"), ("128x3x16x16", "eval"),
                        ("128x3x16x16", "training")):  # fmt: skip
        assert sum(f"input {shape} ({kind})" in line for line in lines) == 1, (shape, lines)
    assert "compiling for input 128x3x8x8 (training), graph 1 of at most 4" in lines[0]
    assert all("recompiling" in line for line in lines[1:])


def test_checkpoint_is_the_models_own_and_resumes_uncompiled(runs, tmp_path):
    comp = runs[1]
    weights = load_file(comp / "last.safetensors")
    assert not [k for k in weights if "_orig_mod" in k or k.startswith("module.")]
    model = lgvit.create_model("lsa_micro_cifar", num_classes=10, img_size=16)
    model.load_state_dict(weights)  # strict: every key the eager model's
    resumed = tmp_path / "resumed"
    for name in ("last.safetensors", "last.state.pt", "config.yaml", "metrics.jsonl"):
        (resumed / name).parent.mkdir(exist_ok=True)
        (resumed / name).write_bytes((comp / name).read_bytes())
    assert main(["train", "--out", str(resumed), "--resume", "auto", "--epochs", "3",
                 "--set", "compile=false"]) == 0  # fmt: skip
    rows = _metrics(resumed)
    assert [m["epoch"] for m in rows] == [0, 1, 2]
    assert "torch.compile" not in (resumed / "train.log").read_text()


def test_unknown_mode_refused_in_one_line_nothing_written(tmp_path, capsys):
    out = tmp_path / "never"
    assert main([*ARGS, "--set", "compile=fast", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lgvit train: error: compile='fast' (from --set): must be true, false or "
                   f"a mode: {', '.join(COMPILE_MODES)}"]  # fmt: skip
    assert not out.exists()
    with pytest.raises(SystemExit):  # the flag: argparse's choices
        build_parser().parse_args(["train", "--compile", "fast"])


def test_bare_compile_is_the_default_mode_and_the_config_takes_bools():
    parse = build_parser().parse_args
    assert parse(["train", "--compile", "--epochs", "2"]).compile == "default"
    assert parse(["train"]).compile is None
    assert load_config(None, ["compile=true"]).compile is True
    assert load_config(None, ["compile=reduce-overhead"]).compile == "reduce-overhead"
    assert [compiled.compile_mode(v) for v in (False, None, True, "reduce-overhead")] == [
        None, None, "default", "reduce-overhead"]  # fmt: skip


def test_compiled_graphs_counts_the_schedule():
    """Sizes 16 -> 32 in steps of 8 over the run's middle half: 16, 24, 32, and eval's two."""
    task = ClassificationTask()
    task.cfg = load_config(None, ["epochs=10", "train_size_start=16", "train_size_step=8",
                                  "train_size_ramp=[0.25,0.75]"])  # fmt: skip
    task.img_size = 32
    assert task.train_sizes() == [16, 24, 32]
    assert task.compiled_graphs() == 5
    task.cfg = load_config(None, ["epochs=10"])  # no resizing: one size
    assert task.compiled_graphs() == 3


class _Buffer(nn.Module):
    """Returns its own buffer, as a CUDA graph returns its static output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("out", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


class _Same(nn.Module):
    """A stand-in for torch.compile's module: the network as ``_orig_mod``, its calls."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self._orig_mod = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(x)


def _identity_compile(monkeypatch, calls):
    def fake(net, **kw):
        calls.append(kw)
        return _Same(net)

    monkeypatch.setattr(torch, "compile", fake)


def test_cuda_graphs_mark_each_step_and_copy_eval_outputs(monkeypatch):
    calls, marks, lines = [], [], []
    _identity_compile(monkeypatch, calls)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    net = CompiledNet(_Buffer(), "reduce-overhead", 2, lines.append, cuda_graphs=True)
    out = net.train()(torch.zeros(4, 3))
    assert len(marks) == 1 and out is net._orig_mod.out  # training: consumed before the next
    with torch.no_grad():
        a = net.eval()(torch.zeros(4, 3))
        b = net(torch.zeros(4, 3))
    assert len(marks) == 3
    assert a.data_ptr() != b.data_ptr() != net._orig_mod.out.data_ptr()  # copies, kept apart
    assert calls == [{"mode": "reduce-overhead", "dynamic": False}]
    assert len(lines) == 2  # a training shape, then the eval one


def test_a_new_shape_is_logged_once_and_the_limit_raised(monkeypatch):
    lines = []
    _identity_compile(monkeypatch, [])
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 8)
    net = CompiledNet(nn.Flatten(), "default", 12, lines.append)
    assert torch._dynamo.config.cache_size_limit == 12
    for size in (8, 8, 16, 8, 16):
        net(torch.zeros(2, 3, size, size))
    assert [line.split(": ", 1)[1] for line in lines] == [
        "compiling for input 2x3x8x8 (training), graph 1 of at most 12 (dynamo's limit 12)",
        "recompiling for input 2x3x16x16 (training), graph 2 of at most 12 (dynamo's limit 12)",
    ]


def test_reduce_overhead_on_the_cpu_compiles_in_default_mode(monkeypatch):
    calls, lines = [], []
    _identity_compile(monkeypatch, calls)
    net = compile_net(nn.Flatten(), "reduce-overhead", torch.device("cpu"), None, lines.append)
    assert calls == [{"mode": "default", "dynamic": None}] and not net.cuda_graphs
    assert lines == ["compile reduce-overhead: CUDA graphs run on CUDA only; compiling in "
                     "default mode on cpu"]  # fmt: skip
    assert compile_net(nn.Flatten(), False, torch.device("cpu"), 3, lines.append).__class__ \
        is nn.Flatten  # fmt: skip
