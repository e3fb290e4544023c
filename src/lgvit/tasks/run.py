"""``train(cfg)``: a run of the configured task (or of the run being resumed) on the engine,
the function behind ``lgvit train``."""

from __future__ import annotations

from typing import Any

from lgvit.run.config import TrainConfig
from lgvit.run.engine import run
from lgvit.run.rundir import read_resumed
from lgvit.tasks import get_task
from lgvit.tasks.dispatch import resumed_task


def train(cfg: TrainConfig, explicit: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run (or resume) a run of ``cfg.task`` as configured; returns the last epoch's metrics.
    See :func:`lgvit.run.engine.run` for resuming and the run directory."""
    resumed = read_resumed(cfg.resume, cfg.out)  # once: it says the task, then the classes
    return run(cfg, get_task(resumed_task(cfg, resumed)).make_task(), explicit, resumed)
