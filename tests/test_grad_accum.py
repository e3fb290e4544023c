"""Gradient accumulation (``grad_accum_steps``): N micro-batches of B are one step of N x B (the
weights, the EMA, the clipped gradient), the schedule and budgets count optimizer steps, DDP
reduces once per window, and a mid-epoch resume is exact or refused in one line."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import NanBatches
from test_train import ENV, FAST

from lgvit.checkpoints.files import load_checkpoint_pair, load_weights
from lgvit.cli import main
from lgvit.run import engine, nonfinite
from lgvit.run.config import TrainConfig, scaled_lr
from lgvit.run.optim import build_optimizer, lr_at, param_groups

# No randomness between the loader and the loss (no augmentation, mixup or drop path), so the
# samples of a step depend only on the epoch's order, which the batch size does not change.
PLAIN = [
    *FAST, "--data", "synthetic", "--amp", "none", "--device", "cpu", "--drop-path", "0",
    "--mixup", "0", "--cutmix", "0", "--aa", "none", "--reprob", "0", "--set", "train_crop=none",
    "--set", "hflip=false", "--set", "warmup_epochs=0",
]  # fmt: skip
# 512 synthetic images: batch 32, or 2 micro-batches of 16, gives 16 optimizer steps an epoch.
HALVES = ["--batch-size", "16", "--grad-accum-steps", "2"]


def _train(out: Path, *args: str) -> int:
    return main(["train", *PLAIN, "--out", str(out), *args])


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=2e-6, msg=k)


# Short runs whose steps must be the same: the clip active (on the accumulated gradient), the EMA
# lagging visibly behind the weights.
STEPS = ["--iters", "3", "--clip-grad", "0.05", "--model-ema", "--model-ema-decay", "0.5"]


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """3 optimizer steps of one batch of 32."""
    out = tmp_path_factory.mktemp("accum") / "big"
    assert _train(out, *STEPS, "--batch-size", "32") == 0
    return out


def _weights(out: Path, name: str = "last") -> dict:
    return load_weights(out / f"{name}.safetensors")


def test_two_micro_batches_equal_one_batch_of_both(big, tmp_path):
    """3 optimizer steps of 2 x 16 images equal 3 of 32 (the same samples per step, the same
    peak lr since the global batch counts the accumulation), the clip on the accumulated
    gradient, the EMA updated once per step; 3 steps of 16 without accumulation differ."""
    assert _train(tmp_path / "acc", *STEPS, *HALVES) == 0
    _close(_weights(big), _weights(tmp_path / "acc"))
    _close(_weights(big, "last_ema"), _weights(tmp_path / "acc", "last_ema"))
    assert any(not torch.equal(v, _weights(big, "last_ema")[k]) for k, v in _weights(big).items())
    _, state = load_checkpoint_pair(tmp_path / "acc/last")
    assert state["global_step"] == 3
    assert _train(tmp_path / "one", *STEPS, "--batch-size", "16") == 0
    with pytest.raises(AssertionError):
        _close(_weights(big), _weights(tmp_path / "one"))


def test_two_processes_accumulating_equal_one_process_with_the_whole_batch(big, tmp_path):
    """torchrun, 2 processes (gloo) x 2 micro-batches of 8: each step sees the 32 images the
    one-process batch sees, averaged over the ranks once per window; the same weights."""
    run = tmp_path / "ddp"
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "lgvit", "train", *PLAIN, *STEPS, "--batch-size", "8", "--grad-accum-steps", "2",
         "--out", str(run)],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "global batch 32 (8 x 2 process(es) x 2 accumulated)" in p.stdout
    _close(_weights(big), _weights(run))
    _close(_weights(big, "last_ema"), _weights(run, "last_ema"))


def test_the_schedule_budget_and_logs_count_optimizer_steps(tmp_path, monkeypatch, capsys):
    """Warm-up (a quarter epoch = 4 of its 16 steps), the cosine decay over ``iters`` 6, the
    log every 2 steps and the run's line all count windows of 2 micro-batches."""
    lrs, calls = [], {"backward": 0, "step": 0}
    set_lr, backward, step = (engine.Optimisation.set_lr, engine.Optimisation.backward,
                              engine.Optimisation.step)  # fmt: skip

    def record_lr(self, s):
        lrs.append((s, set_lr(self, s)))
        return lrs[-1][1]

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(engine.Optimisation, "set_lr", record_lr)
    monkeypatch.setattr(engine.Optimisation, "backward", count("backward", backward))
    monkeypatch.setattr(engine.Optimisation, "step", count("step", step))
    args = ["--iters", "6", "--set", "warmup_epochs=0.25", "--set", "log_every=2", *HALVES]
    assert _train(tmp_path / "r", *args) == 0
    assert calls == {"backward": 12, "step": 6}
    cfg = TrainConfig(batch_size=16, grad_accum_steps=2, warmup_epochs=0.25, iters=6)
    base = scaled_lr(cfg, 1)
    assert base == pytest.approx(cfg.lr * 32 / cfg.lr_base_batch)
    want = [lr_at(s, total_steps=6, warmup_steps=4, cfg=cfg, base_lr=base) for s in range(6)]
    assert [s for s, _ in lrs] == list(range(6))
    assert [lr for _, lr in lrs] == pytest.approx(want)
    out = capsys.readouterr().out
    assert "global batch 32 (16 x 1 process(es) x 2 accumulated)" in out
    assert _train(tmp_path / "zero", "--grad-accum-steps", "0") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("grad_accum_steps=0 (from --grad-accum-steps): must be >= 1"), err
    assert not (tmp_path / "zero").exists()
    assert [ln.split(" loss")[0][-17:] for ln in out.splitlines() if "/16 loss " in ln] == [
        "epoch 1 step 2/16", "epoch 1 step 4/16", "epoch 1 step 6/16"
    ]  # fmt: skip


class CountingDDP(nn.Module):
    """DDP's ``no_sync`` as the engine sees it: records, for each forward and backward, whether
    it ran inside ``no_sync``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.inside, self.forwards, self.backwards = module, False, [], []

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards.append(self.inside)
        out = self.module(x)
        out.register_hook(lambda _: self.backwards.append(self.inside))  # at backward time
        return out


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))


def test_no_all_reduce_before_a_windows_last_micro_batch(one_epoch):
    """7 micro-batches in windows of 3: the forward and backward of every micro-batch but each
    window's last run inside ``no_sync`` (the short last window has only its last); 3
    optimizer steps, equal to 3 plain steps on the windows' joined batches (the short window's
    gradient is its own mean: divided by 1, not 3)."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 5, (4,), generator=g))
               for _ in range(7)]  # fmt: skip
    joined = [tuple(torch.cat(t) for t in zip(*batches[a:b], strict=True))
              for a, b in ((0, 3), (3, 6), (6, 7))]  # fmt: skip
    ends = []
    for accum, data in ((3, batches), (1, joined)):
        cfg = TrainConfig(grad_accum_steps=accum, clip_grad=None, label_smoothing=0.0,
                          sched="none", log_every=1000)  # fmt: skip
        net = CountingDDP(_linear())
        opt = torch.optim.SGD(net.module.parameters(), lr=0.5)
        _, images, step = one_epoch(net, data, opt, cfg)
        assert step == 3 and images == 28
        ends.append(net)
    in_sync = [True, True, False, True, True, False, False]
    assert ends[0].forwards == in_sync and ends[0].backwards == in_sync
    assert ends[1].forwards == [False] * 3
    _close(ends[0].module.state_dict(), ends[1].module.state_dict())


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    cfg = TrainConfig(opt_eps=1e-6)
    return build_optimizer(cfg, param_groups(model, 0.05), 0.05, torch.device("cpu"))


def test_fp16s_scaler_scales_each_micro_batch_and_unscales_once():
    """Under a GradScaler each micro-batch's loss is scaled and the sum unscaled once before the
    clip and the step: the same weights as without one (the scale is a power of two)."""
    batches = NanBatches(4, set()).batches
    ends = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = _tiny()
        o = engine.Optimisation(_adamw(model), scaler, None, {})
        for w in range(2):
            o.optimizer.zero_grad(set_to_none=True)
            for x, y in batches[2 * w : 2 * w + 2]:
                o.backward(nn.functional.cross_entropy(model(x), y), 2)
            o.step(model, None, 0.1, None)
        ends.append(model.state_dict())
    _close(*ends)


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_a_nonfinite_micro_batch_skips_its_whole_window(one_epoch, monkeypatch, where):
    """A NaN in the first micro-batch of the first window (its second is finite): that whole
    window's step is skipped, on the host (CPU) or on the device (found_inf, as on a GPU),
    and the run ends where a run without that window ends."""
    real = nonfinite.skips_on_device
    monkeypatch.setattr(nonfinite, "skips_on_device",
                        lambda o, s, _: real(o, s, torch.device(where)))  # fmt: skip
    cfg = TrainConfig(grad_accum_steps=2, clip_grad=1.0, sched="none", label_smoothing=0.0,
                      max_nonfinite=5, log_every=1000)  # fmt: skip
    ends = []
    for data in (NanBatches(6, {0}).batches, NanBatches(6, set()).batches[2:]):
        model = _tiny()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the host path's "skipped"
            one_epoch(model, data, _adamw(model), cfg)
        ends.append(model.state_dict())
    assert all(torch.isfinite(v).all() for v in ends[0].values())
    _close(*ends)


def _stop_at(monkeypatch, step: int) -> None:
    monkeypatch.setenv("LGVIT_SIGTERM_AT_STEP", str(step))


def test_a_resume_at_a_window_boundary_is_exact_and_another_n_is_refused(
    tmp_path, monkeypatch, capsys
):
    """Stopped by SIGTERM after optimizer step 5 (micro-batch 10) with a periodic save at step
    3 before it, then resumed: the weights equal the uninterrupted run's bit for bit. Resuming
    that mid-epoch checkpoint with another ``grad_accum_steps`` is one line, nothing written."""
    args = ["--iters", "8", "--set", "save_every_steps=3", *HALVES]
    assert _train(tmp_path / "full", *args) == 0
    cut = tmp_path / "cut"
    _stop_at(monkeypatch, 5)
    assert _train(cut, *args) == 128 + signal.SIGTERM
    monkeypatch.delenv("LGVIT_SIGTERM_AT_STEP")
    err = capsys.readouterr()
    assert "saved a mid-epoch checkpoint at epoch 1 step 3" in err.out
    assert "stopped by SIGTERM at epoch 1 step 5/16" in err.err
    _, state = load_checkpoint_pair(cut / "last")
    assert state["extra"]["mid_epoch"]["batch"] == 10 and state["global_step"] == 5
    files = {p.name: p.read_bytes() for p in cut.iterdir() if p.is_file()}
    code = main(["train", "--out", str(cut), "--resume", "auto", "--grad-accum-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "saved inside epoch 1 with grad_accum_steps=2" in err[0]
    assert "resume it with --grad-accum-steps 2" in err[0]
    assert {p.name: p.read_bytes() for p in cut.iterdir() if p.is_file()} == files
    assert main(["train", "--out", str(cut), "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    full, resumed = _weights(tmp_path / "full"), _weights(cut)
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    # An iteration budget counts steps of the run's global batch: another one is refused.
    finished = main(["train", "--out", str(tmp_path / "full"), "--resume", "auto", "--iters",
                     "12", "--grad-accum-steps", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert finished == 2 and "counts steps of 32 images" in err, err
    assert "(--batch-size 16 on 1 process(es) x 2 accumulated), not 16" in err
