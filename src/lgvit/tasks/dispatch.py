"""Which task a command runs: ``lgvit train`` (the config's task, or the resumed run's:
:func:`resumed_task`, which :func:`lgvit.tasks.run.train` runs) and ``lgvit eval`` /
``predict`` (the checkpoint's: :func:`task_of_checkpoint`). Imports no training code."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lgvit.core.errors import LgvitError
from lgvit.tasks import DEFAULT_TASK, TASKS, TaskSpec, get_task, task_of_data

if TYPE_CHECKING:
    from lgvit.run.config import TrainConfig
    from lgvit.run.rundir import Resumed


def resumed_task(cfg: TrainConfig, resumed: Resumed | None) -> str:
    """The task of the run ``cfg.resume`` continues, from its checkpoint's record
    (``resumed``: :func:`lgvit.run.rundir.read_resumed`), else ``cfg.task``: ``lgvit train --out
    RUN --resume auto`` alone must resume any task's run, and the command line's default task
    is classification. A task given explicitly that differs is refused by the task's
    ``identity_keys``; a missing or broken checkpoint is left to the engine to report."""
    return resumed.record.task if resumed is not None else cfg.task


def task_of_checkpoint(args: argparse.Namespace) -> TaskSpec:
    """The task ``lgvit eval`` / ``predict`` runs: the checkpoint's record says it; a file
    without one (the authors' ``.pth``) by the released weights' table, then by ``--data`` or a
    flag that implies a task (``--detector``); else classification."""
    from lgvit.checkpoints.files import load_metadata
    from lgvit.checkpoints.record import CheckpointRecord
    from lgvit.models.hub import folder_named
    from lgvit.models.weights import find_weights

    if folder_named(args.checkpoint) is not None:  # save_pretrained writes classifiers only
        return get_task(DEFAULT_TASK)
    try:
        meta = load_metadata(args.checkpoint)
    except LgvitError:  # not an lgvit file: released weights by name say their task
        name = getattr(find_weights(args.checkpoint), "task", None)
    else:  # a malformed header is its one line here, whichever task reads it
        record = CheckpointRecord.from_meta(meta, args.checkpoint)
        name = record.task if record.is_lgvit_header(meta) else None
    if name is not None:
        return get_task(name)
    by_data = task_of_data(getattr(args, "data", None))
    if by_data is not None:
        return by_data
    for t in TASKS.values():
        if any(getattr(args, flag, None) is not None for flag in t.implied_by):
            return t
    return TASKS[DEFAULT_TASK]
