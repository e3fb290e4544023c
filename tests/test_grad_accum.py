"""Gradient accumulation (``grad_accum_steps``): N micro-batches of B are one step of N x B (the
weights, the EMA, the clipped gradient), the schedule and budgets count optimizer steps, DDP
reduces once per window, and a mid-epoch resume is exact or refused in one line."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_train import FAST

from lgvit.checkpoints.files import load_checkpoint_pair, load_weights
from lgvit.cli import main
from lgvit.run import engine
from lgvit.run.config import TrainConfig, scaled_lr
from lgvit.run.optim import lr_at

# No randomness between the loader and the loss (no augmentation, mixup or drop path), so the
# samples of a step depend only on the epoch's order, which the batch size does not change.
PLAIN = [
    *FAST, "--data", "synthetic", "--amp", "none", "--drop-path", "0", "--mixup", "0",
    "--cutmix", "0", "--aa", "none", "--reprob", "0", "--set", "train_crop=none",
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


def test_two_micro_batches_equal_one_batch_of_both(tmp_path):
    """3 optimizer steps of 2 x 16 images equal 3 of 32 (the same samples per step, the same
    peak lr since the global batch counts the accumulation), with the clip active (on the
    accumulated gradient) and the EMA updated once per step."""
    common = ["--iters", "3", "--clip-grad", "0.05", "--model-ema", "--model-ema-decay", "0.5"]
    assert _train(tmp_path / "big", *common, "--batch-size", "32") == 0
    assert _train(tmp_path / "acc", *common, *HALVES) == 0
    big, acc = (
        load_weights(tmp_path / "big/last.safetensors"),
        load_weights(tmp_path / "acc/last.safetensors"),
    )
    first = load_weights(tmp_path / "big/last_ema.safetensors")
    _close(big, acc)
    _close(first, load_weights(tmp_path / "acc/last_ema.safetensors"))
    assert any(not torch.equal(big[k], first[k]) for k in big)  # the EMA lags: a real check
    _, s_big = load_checkpoint_pair(tmp_path / "big/last")
    _, s_acc = load_checkpoint_pair(tmp_path / "acc/last")
    assert s_big["global_step"] == s_acc["global_step"] == 3
    one = _train(tmp_path / "one", *common, "--batch-size", "16")  # no accumulation: differs
    assert one == 0
    with pytest.raises(AssertionError):
        _close(big, load_weights(tmp_path / "one/last.safetensors"))


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
    full, resumed = (
        load_weights(tmp_path / "full/last.safetensors"),
        load_weights(cut / "last.safetensors"),
    )
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
