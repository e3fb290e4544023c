"""The engine's loader contract, which every task's loaders keep.

The engine (:mod:`lgvit.run.engine`) counts a loader's batches for the epoch's length and the lr
schedule, iterates it, tells it the epoch (and, resuming mid-epoch, the batch to continue at
with the augmentation stream's saved state), and saves that state in mid-epoch checkpoints.
An evaluation loader is only counted and iterated, by the task's own ``evaluate``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

__all__ = ["Loader", "TrainLoader", "check_loaders"]


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
