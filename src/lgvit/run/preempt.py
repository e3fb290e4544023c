"""What may interrupt a training epoch: SIGTERM/SIGINT (finish the step, save, stop with exit
code 128 + the signal) and the periodic mid-epoch checkpoint; multi-process runs agree on both
so every rank saves and stops at the same step."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.errors import Preempted
from lgvit.core.runtime import Dist, all_reduce_sum
from lgvit.run.config import TrainConfig

AGREE_EVERY = 8  # multi-process runs agree on a signal or a timed save every this many steps


class RunControl:
    """What may interrupt an epoch: SIGTERM/SIGINT (finish the step, save, stop) and the
    periodic mid-epoch checkpoint (``save_every_steps`` / ``save_every_min``)."""

    def __init__(self, cfg: TrainConfig, d: Dist) -> None:
        self.cfg, self.d = cfg, d
        self.signum: int | None = None
        self.last_save = time.perf_counter()
        self._old: dict[int, Any] = {}
        self.test_signals = [
            (sig, int(os.environ[f"LGVIT_{sig.name}_AT_STEP"]))
            for sig in (signal.SIGTERM, signal.SIGINT)
            if os.environ.get(f"LGVIT_{sig.name}_AT_STEP")
        ]

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def due(self, batch: int, last_batch: bool, step: int = -1) -> tuple[bool, bool]:
        """``(save now, then stop)`` after ``batch`` steps of the epoch (same on every rank)."""
        cfg = self.cfg
        for sig, at in self.test_signals:  # test hook: a preemption at a known step
            if step == at:
                os.kill(os.getpid(), sig)
        minutes = (time.perf_counter() - self.last_save) / 60
        periodic = not last_batch and (
            (cfg.save_every_steps and batch % cfg.save_every_steps == 0)
            or (cfg.save_every_min and minutes > cfg.save_every_min)
        )
        stop, periodic = bool(self.signum), bool(periodic)
        if self.d.world_size > 1:  # every rank must stop (and save) at the same step
            if batch % AGREE_EVERY and not last_batch:
                # Agreeing reads an all-reduce on the host (a GPU sync): only every few steps.
                # A step-count save is the same on every rank without it.
                steps_due = bool(cfg.save_every_steps and batch % cfg.save_every_steps == 0)
                return steps_due, False
            flags = torch.tensor([float(stop), float(periodic)], device=self.d.device)
            flags = all_reduce_sum(flags, self.d).cpu()
            stop, periodic = bool(flags[0]), bool(flags[1])
            if stop and not self.signum:
                self.signum = signal.SIGTERM
        return stop or periodic, stop

    def after_epoch(
        self, epoch: int, finished: bool, out: Path | str, log: Callable[[str], None]
    ) -> None:
        """At the end of an epoch, saved: a signal stops the run (:class:`Preempted`), unless
        that was the run's last epoch -- a signal after its last step (during the final
        evaluation) leaves nothing to continue, so the run ends as finished, saying so."""
        if not self.signum:
            return
        if not finished:
            raise self.preempted(f"after epoch {epoch + 1}", out)
        name = signal.Signals(self.signum).name
        log(f"{name} came after the last training step; the run is finished and saved in {out}")

    def preempted(self, where: str, out: Path | str) -> Preempted:
        name = signal.Signals(self.signum or signal.SIGTERM).name
        return Preempted(
            f"stopped by {name} {where}; saved {RunLayout(out).last}. Continue with: "
            f"lgvit train --out {out} --resume auto",
            self.signum or signal.SIGTERM,
        )
