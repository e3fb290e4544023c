"""Timing on a GPU, proven on the CPU: the device-aware timing helper (synchronised, warmed up
until stable, several calls a round on CUDA) and ``lgvit bench``'s training step, which uses
the optimizer ``lgvit train`` builds."""

from __future__ import annotations

import math
import types

import pytest
import torch

from lgvit.cli import main
from lgvit.tools import measure


class FakeClock:
    """``perf_counter`` for measure: a call of a step advances it by the step's duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    return c


@pytest.fixture
def syncs(monkeypatch):
    """Every ``torch.cuda.synchronize`` call, recorded (no GPU needed)."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    return events


def test_timed_on_cuda_syncs_around_the_calls_not_between(syncs, clock):
    def step() -> None:
        syncs.append("call")
        clock.now += 0.25

    sec = measure.timed(step, torch.device("cuda"), steps=4)
    assert syncs == ["sync"] + ["call"] * 4 + ["sync"]
    assert sec == pytest.approx(0.25)  # per call


def test_timed_on_cpu_never_syncs(syncs, clock):
    def step() -> None:
        syncs.append("call")
        clock.now += 0.5

    assert measure.timed(step, "cpu") == pytest.approx(0.5)
    assert syncs == ["call"]


def test_cuda_warm_up_runs_until_stable_and_sizes_the_rounds(syncs, clock):
    # A compile, then calls settling: warm-up goes on until two agree (binary fractions, so
    # the fake clock's sums are exact).
    durations = iter([8.0, 2**-7, 2**-8, 2**-9, 2**-10] + [2**-10] * 10_000)
    calls = []

    def step() -> None:
        calls.append(1)
        clock.now += next(durations)

    first, steps = measure.warm_up(step, "cuda")
    assert first == 8.0  # the compile, reported
    assert len(calls) == 6  # until two calls in a row take as long
    t = measure.CUDA_TIMING
    assert steps == max(t.min_steps, min(t.max_steps, math.ceil(t.round_s / 2**-10))) > 1
    assert syncs.count("sync") == 2 * len(calls)  # every warm-up call synchronised

    calls.clear()
    sec = measure.time_fn(step, warmup=1, repeats=3, device="cuda")
    assert sec == 2**-10
    # At least CUDA_TIMING.warmup calls to warm up (here two agree at once), then 3 rounds.
    assert len(calls) == t.warmup + 3 * steps


def test_cpu_timing_is_one_warm_up_call_and_one_call_a_round(clock):
    calls = []

    def step() -> None:
        calls.append(1)
        clock.now += 0.1 * len(calls)  # never stable: the CPU does not wait for it

    assert measure.warm_up(step, "cpu") == (pytest.approx(0.1), 1)
    assert len(calls) == 1
    calls.clear()
    measure.time_fn(step, warmup=2, repeats=5, device="cpu")
    assert len(calls) == 2 + 5


def test_cuda_timing_has_at_least_the_warm_up_asked():
    t = measure.step_timing("cuda", warmup=40)
    assert t.warmup == 40 and t.max_warmup >= 40
    assert measure.step_timing("cpu", warmup=3) == measure.StepTiming(warmup=3, max_warmup=3)


def _settings(opt: torch.optim.Optimizer) -> tuple:
    """What makes two optimizers the same kind of step, the lr aside (training schedules it)."""
    d = opt.defaults
    groups = [(g["weight_decay"], g.get("lr_scale"), len(g["params"])) for g in opt.param_groups]
    return type(opt), d.get("fused"), d.get("foreach"), d["betas"], d["eps"], groups


@pytest.fixture
def made(monkeypatch):
    """Every optimizer built while the fixture is active."""
    out: list[torch.optim.Optimizer] = []
    real_init = torch.optim.Optimizer.__init__

    def spy(self, params, defaults):  # noqa: ANN001
        real_init(self, params, defaults)
        out.append(self)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", spy)
    return out


def test_bench_trains_with_the_optimizer_lgvit_train_builds(made, tmp_path, capsys):
    main(["train", "--model", "lsa_micro_cifar", "--img-size", "16", "--batch-size", "8",
          "--device", "cpu", "--amp", "none", "--data", "synthetic", "--set", "iters=1",
          "--set", "log_every=1000", "--out", str(tmp_path / "run")])  # fmt: skip
    trained = [o for o in made if isinstance(o, torch.optim.AdamW)]
    assert len(trained) == 1
    made.clear()
    main(["bench", "lsa_micro_cifar", "--img-size", "16", "--batch-size", "2", "--train",
          "--rounds", "1", "--no-memory", "--amp", "none", "--quiet"])  # fmt: skip
    capsys.readouterr()
    benched = [o for o in made if isinstance(o, torch.optim.AdamW)]
    assert len(benched) == 1
    assert _settings(benched[0]) == _settings(trained[0])
    assert benched[0].defaults["fused"] is True  # the fused kernel, as training


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bench_optimizer_on_each_device_is_the_runs(device):
    from lgvit.run.config import TrainConfig
    from lgvit.run.optim import build_optimizer, param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = TrainConfig()
    run = build_optimizer(cfg, param_groups(model, cfg.weight_decay), 1.0, torch.device(device))
    bench = measure.train_optimizer(model, device)
    assert _settings(bench) == _settings(run)
    assert bench.defaults["fused"] is True  # fused AdamW on the CPU and on CUDA
