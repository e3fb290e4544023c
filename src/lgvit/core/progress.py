"""Live progress for training and evaluation: a tqdm bar on a terminal, plain lines elsewhere.

On a terminal (rank 0 only) each epoch and each evaluation gets a bar with img/s, loss, lr, the
epoch's ETA and the whole run's ETA. When stdout is not a terminal (CI, a log file, ``nohup``)
there are no control characters: training prints a plain line every ``log_every`` steps instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm


def on_terminal() -> bool:
    return sys.stdout.isatty()


def format_duration(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


class RunClock:
    """ETA of the whole run from the steps done so far in this process (a resumed run counts
    from where it resumed). ``epoch_cost(epoch)``: the relative cost of that epoch's steps
    (progressive resizing: early, smaller epochs are cheaper), so the ETA is not thrown off by
    them; ``steps_per_epoch`` goes with it."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        steps_per_epoch: int | None = None,
        epoch_cost: Callable[[int], float] | None = None,
    ) -> None:
        self.total, self.start = total_steps, start_step
        self.per_epoch = steps_per_epoch or max(total_steps, 1)
        epochs = -(-total_steps // self.per_epoch)
        self.epoch_cost = [epoch_cost(e) if epoch_cost else 1.0 for e in range(epochs)]
        self.cum = [0.0]  # cost of the epochs before each epoch
        for c in self.epoch_cost:
            self.cum.append(self.cum[-1] + c * self.per_epoch)
        self.t0 = time.perf_counter()

    def _cost(self, step: int) -> float:
        """Cost of steps 0 .. step-1."""
        step = min(max(step, 0), self.total)
        e, r = divmod(step, self.per_epoch)
        return self.cum[e] + (self.epoch_cost[e] * r if r else 0.0)

    def eta(self, step: int) -> float | None:
        done = self._cost(step) - self._cost(self.start)
        if done <= 0:
            return None
        return (time.perf_counter() - self.t0) / done * (self._cost(self.total) - self._cost(step))


class StepProgress:
    """Progress over one pass of a loader: ``update(images, **postfix)`` after each step.

    ``bar``: draw a tqdm bar (rank 0 on a terminal); otherwise nothing is drawn and the caller
    logs plain lines."""

    def __init__(self, total_steps: int, desc: str, bar: bool) -> None:
        self.total = total_steps
        self.t0 = time.perf_counter()
        self.images = 0
        self.steps = 0
        self.bar = (
            tqdm(
                total=total_steps,
                desc=desc,
                unit="step",
                dynamic_ncols=True,
                leave=False,
                file=sys.stdout,
            )  # fmt: skip
            if bar
            else None
        )
        self._last_refresh = 0.0

    @property
    def img_per_s(self) -> float:
        return self.images / max(time.perf_counter() - self.t0, 1e-9)

    def eta(self) -> float:
        elapsed = time.perf_counter() - self.t0
        return elapsed / max(self.steps, 1) * (self.total - self.steps)

    def wants_postfix(self) -> bool:
        """Whether the bar is due for new figures (about twice a second): reading the loss
        synchronises with the device, so it is not read every step."""
        if self.bar is None:
            return False
        now = time.perf_counter()
        if now - self._last_refresh < 0.5 and self.steps + 1 < self.total:
            return False
        self._last_refresh = now
        return True

    def update(self, images: int, **postfix: Any) -> None:
        self.images += images
        self.steps += 1
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix_str(
                    f"{self.img_per_s:.0f} img/s, "
                    + ", ".join(f"{k} {v}" for k, v in postfix.items()),
                    refresh=False,
                )
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
