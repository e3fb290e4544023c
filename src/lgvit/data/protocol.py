"""The engine's loader contract, which every task's loaders keep.

The engine (:mod:`lgvit.run.engine`) counts a loader's batches for the epoch's length and the lr
schedule, iterates it, tells it the epoch (and, resuming mid-epoch, the batch to continue at
with the augmentation stream's saved state), and saves that state in mid-epoch checkpoints.
An evaluation loader is only counted and iterated, by the task's own ``evaluate``.

A loader that reads its samples while it iterates (files, shards, a dataset's rows) may find
some unreadable or unlabelled: it leaves them out of their batch and counts them per pass,
``bad`` (how many) and ``first_bad`` (the first one's name), which :func:`skipped_in_pass`
reads, so that the run reports them for each epoch and each evaluation, whatever the source.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from lgvit.core.runtime import Dist, all_reduce_sum

__all__ = ["Loader", "TrainLoader", "check_loaders", "skipped_in_pass", "skipped_text"]


@runtime_checkable
class Loader(Protocol):
    """Batches of a split: ``len()`` (this process's batches) and iteration."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


@runtime_checkable
class TrainLoader(Loader, Protocol):
    """A training loader whose epochs a run can continue exactly."""

    def set_epoch(self, epoch: int, batch: int = 0, state: Any = None) -> None:
        """Select ``epoch``'s order and random draws; ``batch`` and ``state`` (what
        :meth:`aug_state` gave after that many batches) continue the epoch in the middle, for
        the next pass only."""
        ...

    def aug_state(self) -> Any:
        """The augmentation stream's state after the batches yielded so far this pass, or None
        for a loader whose draws depend only on (seed, epoch, image)."""
        ...


def check_loaders(train: object, test: object) -> None:
    """A ``TypeError`` naming what a task's loaders lack of the contract: a train loader without
    ``aug_state`` would otherwise fail at the first mid-epoch save, hours into a run."""
    for loader, contract, what in ((train, TrainLoader, "train"), (test, Loader, "test")):
        if isinstance(loader, contract):
            continue
        names = ("__len__", "__iter__", "set_epoch", "aug_state")
        missing = [n for n in names if hasattr(contract, n) and not hasattr(loader, n)]
        raise TypeError(
            f"the task's {what} loader ({type(loader).__name__}) is not a {contract.__name__}: "
            f"it has no {', '.join(missing)} (lgvit.data.protocol)"
        )


def skipped_in_pass(loader: object, d: Dist | None = None) -> tuple[int, str | None] | None:
    """(samples ``loader``'s last pass left out, the first one's name) -- summed over the ranks
    of ``d`` (a collective: every rank calls it), the name this rank's; None for a loader that
    reads nothing it could find bad (decoded in memory)."""
    bad = getattr(loader, "bad", None)
    if not isinstance(bad, int) or isinstance(bad, bool):
        return None
    if d is not None and d.world_size > 1:
        bad = int(all_reduce_sum(torch.tensor([float(bad)], device=d.device), d).item())
    return bad, getattr(loader, "first_bad", None)


def skipped_text(skipped: tuple[int, str | None] | None, what: str = "") -> str:
    """`` (skipped 2 unreadable or unlabelled<what>, e.g. NAME)``, or nothing when none was."""
    if not skipped or not skipped[0]:
        return ""
    example = f", e.g. {skipped[1]}" if skipped[1] else ""
    return f" (skipped {skipped[0]} unreadable or unlabelled{what}{example})"
