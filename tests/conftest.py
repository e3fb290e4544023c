"""Shared test helpers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core (pytest -n auto): each gets one thread, and so do the
    # commands it starts (two 2-thread torch processes on 2 cores slow each other several-fold).
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture
def one_epoch(tmp_path):
    """``one_epoch(model, batches, optimizer, cfg, epoch=0, schedule=None)``: one training epoch
    of the classification task on the shared engine, with no data set, run directory or saves
    (a plain list of ``(x, y)`` batches as the loader); returns ``(mean loss, images, step)``."""
    from lgvit.core.progress import RunClock
    from lgvit.core.runtime import Dist
    from lgvit.run.engine import Optimisation, Prepared, Run, RunLog, train_one_epoch
    from lgvit.run.preempt import RunControl
    from lgvit.tasks.classification.train import ClassificationTask

    def run_epoch(model, batches, optimizer, cfg, epoch=0, schedule=None, img_size=0):
        d = Dist()
        cfg.out = str(tmp_path)
        task = ClassificationTask(cfg=cfg, img_size=img_size)
        schedule = schedule or dict(total_steps=len(batches), warmup_steps=0, cfg=cfg,
                                    base_lr=optimizer.param_groups[0]["lr"])  # fmt: skip
        prepared = Prepared(model, batches, [], {}, "test")
        opt = Optimisation(optimizer, None, None, schedule)
        clock = RunClock(len(batches), 0, len(batches))
        run = Run(cfg, task, d, Path(tmp_path), RunLog(Path(tmp_path), False),
                  RunControl(cfg, d), prepared, None, opt, model, clock)  # fmt: skip
        return train_one_epoch(run, epoch, 0)

    return run_epoch


@contextlib.contextmanager
def quick_init() -> Iterator[None]:
    """Models built inside get a clamped normal where lgvit draws torch's rejection-sampled
    truncated normal (``nn.init.trunc_normal_``: most of the time of building a model on a
    CPU), for tests whose checks do not depend on the initial draw."""

    def trunc_normal_(t, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):  # noqa: ANN001, ANN202
        with torch.no_grad():
            return t.normal_(mean, std, generator=generator).clamp_(a, b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.init, "trunc_normal_", trunc_normal_)
        yield
