"""``lgvit eval`` / ``predict`` flags as the tasks that read them declare them.

A task's ``cli`` module lists the flags it reads beyond the command's common ones
(``EVAL_FLAGS``, ``PREDICT_FLAGS``) as :class:`Flag` items with that task's default, choices
and help; :func:`finite_float` is the number type they check at parsing. Merging them into the
command's parser and applying them once the task is known is :mod:`lgvit.tasks.dispatch`'s.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from lgvit.core.constants import DECODE_WORKERS


class Flag:
    """One option as ``argparse.add_argument`` takes it: ``Flag("--batch-size", type=int,
    default=128, help=...)``. ``default`` is the task's; the parser itself defaults to absent."""

    def __init__(self, *names: str, **kwargs: Any) -> None:
        self.names = names
        self.kwargs = kwargs

    @property
    def option(self) -> str:
        return self.names[-1]

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.option.lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        return self.kwargs.get("default", False if self.kwargs.get("action") == "store_true"
                               else None)  # fmt: skip

    @property
    def choices(self) -> tuple[Any, ...] | None:
        c = self.kwargs.get("choices")
        return None if c is None else tuple(c)


# Every task's eval reads -j: one declaration, with the loaders' default.
WORKERS_FLAG = Flag("-j", "--workers", type=int, default=DECODE_WORKERS,
                    help="decoding processes for an image folder")  # fmt: skip


def finite_float(
    low: float | None = None, high: float | None = None, *, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[low, high]`` (``(low, high]`` with
    ``low_open``; None: unbounded on that side). nan, inf or a value out of range is refused at
    parsing, in argparse's error line naming the flag, the value and the range."""
    if low is None and high is None:
        wanted = "a finite number"
    elif high is None:
        wanted = f"a finite number {'>' if low_open else '>='} {low:g}"
    else:
        lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
        wanted = f"a number in {lo}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number: must be {wanted}"
            ) from None
        inside = math.isfinite(value) and (
            (low is None or (value > low if low_open else value >= low))
            and (high is None or value <= high)
        )  # fmt: skip
        if not inside:
            raise argparse.ArgumentTypeError(f"{text}: must be {wanted}")
        return value

    return parse
