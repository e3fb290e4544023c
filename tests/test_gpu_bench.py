"""Timing on a GPU, proven on the CPU: the device-aware timing helper (synchronised, warmed up
until stable, several calls a round on CUDA) and ``lgvit bench``'s training step, which uses
the optimizer ``lgvit train`` builds."""

from __future__ import annotations

import csv
import io
import json
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


# ----------------------------------------------------------------- lgvit bench as GPU users run it


def _fake_speed(monkeypatch, img_s: dict[int, float], oom_from: int | None = None) -> list[int]:
    """``lgvit bench``'s steps timed as ``img_s[batch]`` images a second (the real steps still
    run, on tiny inputs); a step at ``oom_from`` or more images raises CUDA's out-of-memory
    error, as a GPU would. Returns the batches steps were built for."""
    from lgvit.tools import bench

    built: list[int] = []
    real_make = bench.make_step

    def make(model, input_size, batch, train, *args, **kw):  # noqa: ANN001, ANN202
        built.append(batch)
        if oom_from is not None and batch >= oom_from:

            def oom() -> None:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch}")

            return oom
        step = real_make(model, input_size, 2, train, *args, **kw)  # tiny: the CPU is shared
        step.batch = batch
        return step

    def timed(step, device="cpu", steps=1):  # noqa: ANN001, ANN202
        step()
        return step.batch / img_s[step.batch]

    monkeypatch.setattr(bench, "make_step", make)
    monkeypatch.setattr(bench, "timed", timed)
    return built


def _auto(**kw) -> dict:
    from lgvit.tools.bench import BenchOptions, run_bench

    opts = BenchOptions(batch_size="auto", img_size=16, rounds=1, amp="none", memory=False,
                        busy=False, **kw)  # fmt: skip
    return run_bench(["lsa_micro_cifar"], opts, log=lambda m: None)["rows"][0]


def test_auto_batch_doubles_until_out_of_memory(monkeypatch):
    built = _fake_speed(monkeypatch, {64: 100.0, 128: 200.0}, oom_from=256)
    row = _auto(train=True)
    assert row["error"] is None, row["error"]
    for kind in ("infer", "train"):
        assert row[f"{kind}_sweep"] == {64: 100.0, 128: 200.0}
        assert row[f"{kind}_sweep_stop"] == "out of memory at batch 256"
        assert row[f"{kind}_best_batch"] == 128
        # the paper's batch and the best, both timed in the alternating rounds
        assert row[f"{kind}_img_s"] == pytest.approx(100.0)
        assert row[f"{kind}_best_img_s"] == pytest.approx(200.0)
        assert row[f"{kind}_best_mfu"] == pytest.approx(2 * row[f"{kind}_mfu"])
    assert built == [64, 128, 256] * 2  # nothing past the batch that ran out of memory


def test_auto_batch_stops_under_5_percent_gain(monkeypatch):
    built = _fake_speed(monkeypatch, {64: 100.0, 128: 150.0, 256: 155.0, 512: 1e6})
    row = _auto()
    assert row["infer_sweep"] == {64: 100.0, 128: 150.0, 256: 155.0}  # 512 never tried
    assert row["infer_sweep_stop"] == "under 5% gain at batch 256"
    assert row["infer_best_batch"] == 256 and built == [64, 128, 256]


def test_out_of_memory_at_the_papers_batch_is_the_rows_reason(monkeypatch):
    _fake_speed(monkeypatch, {}, oom_from=64)
    row = _auto()
    assert row["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert row.get("infer_img_s") is None


def test_sweep_stops_at_its_limit_and_keeps_the_first_and_best_steps():
    from lgvit.tools.bench import sweep_batch

    def make(batch: int):  # noqa: ANN202
        def step() -> None:
            pass

        step.batch = batch
        return step

    sweep = sweep_batch(make, "cpu", start=4, limit=16, gain=-1.0)  # any speed counts as a gain
    assert list(sweep.img_s) == [4, 8, 16] and sweep.stop == "at the sweep's limit, batch 16"
    assert set(sweep.kept) == {4, sweep.best}


def test_a_failure_other_than_memory_is_not_the_end_of_a_sweep_but_an_error():
    from lgvit.tools.bench import is_out_of_memory, sweep_batch

    def make(batch: int):  # noqa: ANN202
        if batch > 4:
            raise ValueError("shape mismatch")
        return lambda: None

    with pytest.raises(ValueError, match="shape mismatch"):
        sweep_batch(make, "cpu", start=4, gain=-1.0)
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert is_out_of_memory(RuntimeError("Triton: CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("size mismatch"))


@pytest.mark.parametrize(
    ("flag", "mode"),
    [([], None), (["--compile"], "default"),
     (["--compile", "max-autotune-no-cudagraphs"], "max-autotune-no-cudagraphs"),
     (["--compile", "reduce-overhead"], "reduce-overhead")],
)  # fmt: skip
def test_the_compile_mode_reaches_torch_compile(flag, mode, monkeypatch, capsys):
    real = torch.compile
    modes: list = []

    def spy(model, **kw):  # noqa: ANN001, ANN202
        modes.append(kw.get("mode"))
        assert kw.get("dynamic") is False  # a graph per batch, as a run at a fixed batch has
        return real(model, backend="eager")  # inductor takes minutes on a CPU

    monkeypatch.setattr(torch, "compile", spy)
    argv = [
        "bench",
        "lsa_micro_cifar",
        "--img-size",
        "16",
        "--batch-size",
        "2",
        "--rounds",
        "1",
        "--no-memory",
        "--no-busy",
        "--amp",
        "none",
        "--format",
        "json",
        "--quiet",
        *flag,
    ]
    assert main(argv) == 0
    assert modes == ([mode] if mode else [])
    result = json.loads(capsys.readouterr().out)
    row = result["rows"][0]
    assert result["compile"] == mode and row["error"] is None
    if mode:  # the compiled model's logits against eager's: the same model here
        assert row["compile_rel_err"] < 1e-5 and row["infer_compile_s"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--batch-size", "big"], "'big' is neither a count nor auto"),
     (["--batch-size", "0"], "--batch-size 0: a positive count or auto"),
     (["--compile", "fast"], "argument --compile: invalid choice: 'fast'")],
)  # fmt: skip
def test_bad_batch_and_compile_flags_are_refused(argv, message, capsys):
    try:
        code = main(["bench", "lsa_micro_cifar", "--no-memory", *argv])
    except SystemExit as e:  # argparse's own refusal of a flag's value
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_busy_fraction_of_a_cpu_step_is_a_share():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    step = measure.make_step(model, (64,), 16, True)
    step()
    busy = measure.busy_fraction(step, "cpu", steps=2)
    assert busy is not None and 0 < busy <= 1


def test_busy_share_counts_overlapping_kernels_once():
    # two streams' kernels overlap in 3..4; a gap 6..8 is the host's
    assert measure.busy_share([(0, 4), (3, 6), (8, 10)], 10) == pytest.approx(0.8)
    assert measure.busy_share([(0, 2), (0.5, 1)], 1) == 1.0  # clock skew: at most 1
    assert measure.busy_share([], 10) is None


def test_cudnn_autotunes_while_measuring_on_cuda_only():
    from lgvit.tools.bench import measuring

    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        with measuring(torch.device("cuda"), None):
            assert torch.backends.cudnn.benchmark is True
        assert torch.backends.cudnn.benchmark is False
        with measuring(torch.device("cpu"), None):
            assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before


def test_the_table_has_the_sweep_busy_and_compile_columns(monkeypatch):
    from lgvit.tools.bench import BenchOptions, format_result, run_bench

    _fake_speed(monkeypatch, {64: 100.0, 128: 200.0}, oom_from=256)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager"))
    opts = BenchOptions(batch_size="auto", img_size=16, rounds=1, amp="none", memory=False,
                        train=True, compile="default")  # fmt: skip
    result = run_bench(["lsa_micro_cifar"], opts, log=lambda m: None)
    head = format_result(result, "table").splitlines()[0].split()
    assert head[:4] == ["model", "input", "params", "(M)"]
    text = " ".join(head)
    assert ("infer img/s MFU best batch img/s MFU busy train img/s MFU best batch img/s MFU busy"
            in text), text  # fmt: skip
    assert text.endswith("compile s train compile s compiled vs eager")
    row = result["rows"][0]
    assert 0 < row["infer_busy"] <= 1 and 0 < row["train_busy"] <= 1
    md = format_result(result, "markdown")
    assert "| best batch | img/s | MFU | busy |" in md and "batch 64 and the best of a sweep" in md
    rows = list(csv.DictReader(io.StringIO(format_result(result, "csv"))))
    assert rows[0]["infer_best_batch"] == "128" and rows[0]["infer_sweep_stop"]
