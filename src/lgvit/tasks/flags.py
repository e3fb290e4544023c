"""``lgvit eval`` / ``predict`` flags declared by the tasks that read them.

A task's ``cli`` module lists the flags it reads beyond the command's common ones
(``EVAL_FLAGS``, ``PREDICT_FLAGS``) as :class:`Flag` items with that task's default, choices
and help. The command's parser takes the union (:func:`add_task_flags`: a flag several tasks
read is one option whose choices are the union of theirs), and every task flag is parsed to
"absent" unless given. Once the checkpoint says which task runs, :func:`apply_task_flags`
refuses in one line a flag that task does not read (or a value outside its choices; a task's
``REFUSAL_HINTS`` may add what to do instead) and fills in the task's defaults for the rest: a
flag is either used or refused, never ignored.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from lgvit.core.constants import DECODE_WORKERS
from lgvit.core.errors import LgvitError
from lgvit.tasks import TASKS, TaskSpec

COMMANDS = {"eval": "EVAL_FLAGS", "predict": "PREDICT_FLAGS"}


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


def task_flags(task: TaskSpec, command: str) -> tuple[Flag, ...]:
    """The flags ``task`` reads in ``command`` (eval or predict), beyond the common ones."""
    return tuple(getattr(task.module("cli"), COMMANDS[command]))


def _declarations(command: str) -> dict[str, list[tuple[str, Flag]]]:
    """Every task flag of ``command`` by destination: [(task name, its declaration)]."""
    out: dict[str, list[tuple[str, Flag]]] = {}
    for t in TASKS.values():
        for f in task_flags(t, command):
            out.setdefault(f.dest, []).append((t.name, f))
    return out


def add_task_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One option per task flag of ``command``: the first declaration's type, nargs and
    metavar, the union of the declared choices, each task's help (naming the tasks)."""
    for dest, decls in _declarations(command).items():
        first = decls[0][1]
        names = {f.names for _, f in decls}
        if len(names) != 1:
            raise AssertionError(f"{dest}: declared as {sorted(names)} by different tasks")
        kwargs = {k: v for k, v in first.kwargs.items() if k not in ("default", "help")}
        choices = [c for _, f in decls for c in (f.choices or ())]
        if choices:
            kwargs["choices"] = list(dict.fromkeys(choices))
        helps = dict.fromkeys(f.kwargs.get("help", "") for _, f in decls)
        who = ", ".join(t for t, _ in decls)
        if len(helps) == 1:
            text = f"{next(iter(helps))} [{who}]"
        else:
            text = "; ".join(f"{t}: {f.kwargs.get('help', '')}" for t, f in decls)
        defaults = {t: f.default for t, f in decls if f.default not in (None, False)}
        if defaults:
            text += " (default " + ", ".join(f"{v}" for v in dict.fromkeys(defaults.values())) + ")"
        parser.add_argument(*first.names, default=argparse.SUPPRESS, help=text, **kwargs)


def apply_task_flags(args: argparse.Namespace, task: TaskSpec, command: str) -> None:
    """Refuse each given flag ``task`` does not read in ``command`` (and a value outside its
    choices), in one line naming the flag, the task and the tasks that do read it; set every
    flag it reads that was not given to the task's default."""
    own = {f.dest: f for f in task_flags(task, command)}
    for dest, decls in _declarations(command).items():
        if dest in own or dest not in vars(args):
            continue
        readers = [f"{t} {command}" for t, _ in decls]
        verb = "does" if len(readers) == 1 else "do"
        option = decls[0][1].option
        hint = getattr(task.module("cli"), "REFUSAL_HINTS", {}).get((command, dest), "")
        raise LgvitError(
            f"{option}: {args.checkpoint} is a {task.name} checkpoint and {task.name} {command} "
            f"does not take {option} ({' and '.join(readers)} {verb})"
            f"{'; ' + hint if hint else ''}"
        )
    for dest, f in own.items():
        if dest not in vars(args):
            setattr(args, dest, f.default)
        elif f.choices is not None and getattr(args, dest) not in f.choices:
            raise LgvitError(
                f"{f.option} {getattr(args, dest)}: {task.name} {command} takes {f.option} "
                f"{' or '.join(map(str, f.choices))}"
            )
