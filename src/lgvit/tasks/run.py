"""``train(cfg)``: a run of the configured task (or of the run being resumed) on the engine,
the function behind ``lgvit train``; each task's training, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lgvit.run.config import TrainConfig
from lgvit.run.engine import Task, run
from lgvit.run.rundir import read_resumed
from lgvit.task_table import get_task
from lgvit.tasks.classification import train as classification
from lgvit.tasks.detection import train as detection
from lgvit.tasks.dispatch import resumed_task
from lgvit.tasks.segmentation import train as segmentation

# Each task's object on the engine (its ``train`` module's ``make_task``).
MAKE_TASK: dict[str, Callable[[], Task]] = {
    "classification": classification.make_task,
    "segmentation": segmentation.make_task,
    "detection": detection.make_task,
}


def make_task(name: str) -> Task:
    """The task object the engine runs for task ``name`` (an unknown one: one line)."""
    return MAKE_TASK[get_task(name).name]()


def train(cfg: TrainConfig, explicit: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run (or resume) a run of ``cfg.task`` as configured; returns the last epoch's metrics.
    See :func:`lgvit.run.engine.run` for resuming and the run directory."""
    resumed = read_resumed(cfg.resume, cfg.out)  # once: it says the task, then the classes
    return run(cfg, make_task(resumed_task(cfg, resumed)), explicit, resumed)
