"""The run's CUDA paths, proven on the CPU: one process per GPU (LOCAL_RANK against the device
count), the non-finite-loss skip without a host sync per step, and the run's TF32 and
determinism settings (applied at its start, recorded in its config, undone at its end)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import yaml
from conftest import NanBatches
from test_train import FAST

from lgvit.cli import main
from lgvit.core import runtime
from lgvit.core.errors import LgvitError
from lgvit.run import engine, nonfinite
from lgvit.run.config import TrainConfig
from lgvit.run.optim import ModelEma, build_optimizer, param_groups

SYN = ["train", *FAST, "--data", "synthetic", "--amp", "none", "--device", "cpu"]

# ------------------------------------------------------------------ one process per GPU


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine with one CUDA device, as torch sees it; the process group and the device
    are only recorded (a refused start reaches neither)."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("device", dev)))
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda b: calls.append(("pg", b)))
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 0)
    for key in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    return calls


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_more_processes_than_gpus_is_one_line_on_every_rank(one_gpu, monkeypatch, local_rank):
    """torchrun --nproc_per_node 2 on a one-GPU machine: both ranks stop with the same line
    (rank 0 too, rather than waiting for a rank 1 that never joins)."""
    for key, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", local_rank)):
        monkeypatch.setenv(key, value)
    with pytest.raises(LgvitError) as e:
        runtime.setup_distributed("auto")
    assert str(e.value) == (
        "LOCAL_RANK 1 but this machine has 1 CUDA device: start at most 1 process(es) per "
        "machine (torchrun --nproc_per_node 1), one per GPU, or use --device cpu"
    )
    assert one_gpu == []  # neither cuda:1 asked for nor a process group started


def test_more_processes_than_gpus_through_the_command_line(one_gpu, monkeypatch, capsys, tmp_path):
    for key, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    assert main(["train", *FAST, "--data", "synthetic", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lgvit train: error: LOCAL_RANK 1 but this machine has 1 CUDA device: start at most 1 "
        "process(es) per machine (torchrun --nproc_per_node 1), one per GPU, or use --device cpu"
    ]
    assert not out.exists()  # nothing written


def test_one_process_per_gpu_gets_its_own(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    d = runtime.setup_distributed("cuda")
    assert d.device == torch.device("cuda:0") and one_gpu == [("device", torch.device("cuda:0"))]


def test_a_local_rank_that_is_no_integer_is_one_line(one_gpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(LgvitError, match=r"^LOCAL_RANK='one': expected an integer"):
        runtime.setup_distributed("auto")


# ------------------------------------------------------------------ the non-finite skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer lgvit builds for a GPU run (on the CPU here), or torch's foreach AdamW
    (what an optimizer without ``found_inf`` gets: the host check)."""
    if kind == "foreach_adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
    cfg = TrainConfig(opt=kind, opt_eps=1e-6)
    groups = param_groups(model, 0.05)
    return build_optimizer(cfg, groups, 0.05, torch.device("cuda"))


OPTIMIZERS = ["adamw", "sgd", "lamb", "foreach_adamw"]


_DECIDE = nonfinite.skips_on_device


def _decided_on(device: str):  # noqa: ANN202
    """The skip decided as on ``device`` (the device's type is all the decision reads)."""
    return lambda opt, scaler, _: _DECIDE(opt, scaler, torch.device(device))


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    monkeypatch.setattr(nonfinite, "skips_on_device", _decided_on("cuda"))


@pytest.fixture
def host_syncs(monkeypatch):
    """Counts every read of a tensor's value on the host (each one a sync on a GPU)."""
    count = [0]
    for name in ("item", "__bool__", "__int__", "__float__", "__index__", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            count[0] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return count


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(epochs=1, log_every=0, max_nonfinite=5, clip_grad=1.0, sched="none", **kw)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lamb"])
def test_the_skip_reads_nothing_on_the_host_per_step(one_epoch, as_on_a_gpu, host_syncs, kind):
    """On a GPU, lgvit's optimizers (fused AdamW, fused SGD, LAMB) skip a non-finite loss with
    no host sync: the reads per epoch do not grow with its steps (the epoch's mean loss and the
    count of skipped steps are read once, at its end)."""
    counts = []
    for n in (4, 12):
        model = _model()
        host_syncs[0] = 0
        one_epoch(model, NanBatches(n, {1}), _optimizer(kind, model), _cfg())
        counts.append(host_syncs[0])
    assert counts[0] == counts[1] <= 2, counts


def _state(opt: torch.optim.Optimizer) -> list:
    return [copy.deepcopy({k: v for k, v in s.items()}) for s in opt.state.values()]


def _same(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=False)


@pytest.mark.parametrize("ema", [False, True])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_nan_step_leaves_weights_and_state_as_they_were(as_on_a_gpu, kind, ema):
    """Through the engine's own step (backward, clip, step, EMA): a NaN loss after a good step
    changes no weight, no optimizer state and not the EMA; decided as on a GPU."""
    model = _model()
    opt = _optimizer(kind, model)
    avg = ModelEma(model, 0.9) if ema else None
    o = engine.Optimisation(opt, None, avg, {})
    guard = nonfinite.NonFiniteGuard(opt, None, _cfg(), torch.device("cpu"))
    assert guard.on_device == (kind != "foreach_adamw")  # foreach AdamW: the host skips it
    x, y = next(iter(NanBatches(1, set())))
    for i, xb in enumerate([x, x.clone().fill_(float("nan"))]):
        if i == 1:
            weights = copy.deepcopy(model.state_dict())
            state, shadow = _state(opt), copy.deepcopy(avg.shadow) if avg else None
        loss = torch.nn.functional.cross_entropy(model(xb), y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the host path's "skipped" warning
            if guard.before_step(loss, 0, i):
                continue
        o.step(model, guard.backward_loss(loss), 1.0, guard.bad)
        guard.finite_part(loss)
    _same(model.state_dict(), weights)
    _same(_state(opt), state)
    if avg is not None:
        _same(avg.shadow, shadow)
    assert not hasattr(opt, "found_inf")  # handed over for the step only


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lamb"])
def test_a_run_skipping_on_the_device_matches_the_host_check(one_epoch, monkeypatch, kind):
    """NaN losses at the first and the third step (a skipped first step leaves the optimizer
    as new: torch's fused SGD would otherwise keep uninitialised momentum buffers) end where
    the host-checked run ends."""
    ends = []
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(nonfinite, "skips_on_device", _decided_on(device))
        model = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, _, _ = one_epoch(model, NanBatches(6, {0, 2}), _optimizer(kind, model), _cfg())
        ends.append((loss, model.state_dict()))
        monkeypatch.undo()
    (loss_host, w_host), (loss_dev, w_dev) = ends
    torch.testing.assert_close(w_dev, w_host)
    assert loss_dev == pytest.approx(loss_host)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lamb"])
def test_under_a_grad_scaler_a_nan_loss_is_its_skip_too(as_on_a_gpu, host_syncs, kind):
    """fp16 (a GradScaler; the CPU's stands in for CUDA's): a NaN loss makes every gradient NaN,
    so the scaler's own check skips the step, with no host read; it lowers its scale."""
    model = _model()
    opt = _optimizer(kind, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    o = engine.Optimisation(opt, scaler, None, {})
    guard = nonfinite.NonFiniteGuard(opt, scaler, _cfg(), torch.device("cpu"))
    x, y = next(iter(NanBatches(1, set())))
    for i, xb in enumerate([x, x.clone().fill_(float("nan"))]):
        if i == 1:
            weights, state = copy.deepcopy(model.state_dict()), _state(opt)
            host_syncs[0] = 0
        loss = torch.nn.functional.cross_entropy(model(xb), y)
        assert guard.before_step(loss, 0, i) is False
        o.step(model, guard.backward_loss(loss), 1.0, guard.bad)
        guard.finite_part(loss)
    assert host_syncs[0] == 0
    _same(model.state_dict(), weights)
    _same(_state(opt), state)
    assert scaler.get_scale() == 512.0


def test_every_rank_skips_when_one_rank_has_a_nonfinite_loss(as_on_a_gpu, monkeypatch):
    """DDP averages a NaN into every rank's gradients: the flag is agreed on (a max over the
    ranks, on the device) so every rank skips the step and counts it."""
    reduced = []

    def all_reduce(t, op):  # noqa: ANN001, ANN202 -- the other rank's loss was NaN
        reduced.append(op)
        t.fill_(1)

    monkeypatch.setattr(nonfinite.dist, "all_reduce", all_reduce)
    model = _model()
    opt = _optimizer("adamw", model)
    guard = nonfinite.NonFiniteGuard(opt, None, _cfg(), torch.device("cpu"), distributed=True)
    assert guard.before_step(torch.tensor(1.0), 0, 0) is False
    assert reduced == [torch.distributed.ReduceOp.MAX]
    assert bool(guard.bad) and float(opt.found_inf) == 1.0 and int(guard.count_dev) == 1


def test_lamb_takes_the_step_count_the_host_path_saved(as_on_a_gpu):
    """A LAMB state saved by the host path (an int step) continues on the device path."""
    model = _model()
    opt = _optimizer("lamb", model)
    x, y = next(iter(NanBatches(1, set())))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # the host path: no found_inf
    assert all(s["step"] == 1 for s in opt.state.values())
    opt.found_inf = torch.zeros(())
    opt.step()
    del opt.found_inf
    assert all(torch.is_tensor(s["step"]) and float(s["step"]) == 2 for s in opt.state.values())


# ------------------------------------------------------------------ TF32 and determinism


@pytest.fixture
def numerics():
    """The process's settings, put back whatever the test does."""
    before = runtime._numerics_now()
    yield before
    runtime.restore_numerics()
    torch.set_float32_matmul_precision(str(before["precision"]))
    torch.backends.cudnn.allow_tf32 = bool(before["cudnn_tf32"])
    torch.backends.cudnn.benchmark = bool(before["benchmark"])
    torch.backends.cudnn.deterministic = bool(before["cudnn_deterministic"])
    torch.use_deterministic_algorithms(bool(before["deterministic"]),
                                       warn_only=bool(before["warn_only"]))  # fmt: skip


def test_tf32_and_determinism_are_set_on_cuda_and_restored(numerics, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = runtime._numerics_now()
    runtime.set_numerics(torch.device("cuda"), tf32=False, deterministic=True)
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cudnn.benchmark
    assert torch.backends.cudnn.deterministic and torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one: a warning
    assert runtime.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    runtime.restore_numerics()
    assert runtime._numerics_now() == before
    runtime.set_numerics(torch.device("cuda"), tf32=True, deterministic=False)
    assert torch.get_float32_matmul_precision() == "high"  # timm's train.py
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.benchmark
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in runtime.os.environ
    runtime.restore_numerics()
    assert runtime._numerics_now() == before


def test_the_cpu_keeps_its_precision(numerics):
    before = runtime._numerics_now()
    runtime.set_numerics(torch.device("cpu"), tf32=True, deterministic=True)
    now = runtime._numerics_now()
    assert now["deterministic"] and now["precision"] == before["precision"]
    assert now["cudnn_tf32"] == before["cudnn_tf32"] and now["benchmark"] == before["benchmark"]


def test_a_run_applies_records_and_resumes_its_numerics(numerics, monkeypatch, tmp_path):
    """Through the command line: the settings hold from the run's start (read where it picks
    its precision), are in its config, a resume keeps them, and the process is as it was once
    the run is over."""
    seen = []
    real = engine.resolve_amp

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*a, **k)

    monkeypatch.setattr(engine, "resolve_amp", spy)
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warm-up as long as the short run
        assert main([*SYN, "--iters", "1", "--out", str(out),
                     "--set", "deterministic=true", "--set", "tf32=false"]) == 0  # fmt: skip
        assert not torch.are_deterministic_algorithms_enabled()  # undone after the run
        saved = yaml.safe_load((out / "config.yaml").read_text())
        assert saved["deterministic"] is True and saved["tf32"] is False
        # The finished run resumed: its saved settings, not the defaults, are applied.
        assert main(["train", "--out", str(out), "--resume", "auto"]) == 0
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("value", ["maybe", "2"])
@pytest.mark.parametrize("key", ["tf32", "deterministic"])
def test_bad_numerics_values_are_one_line(key, value, capsys, tmp_path):
    out = tmp_path / "run"
    assert main([*SYN, "--out", str(out), "--set", f"{key}={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lgvit train: error: --set {key}={value}: expected true or false"]
    assert not out.exists()
