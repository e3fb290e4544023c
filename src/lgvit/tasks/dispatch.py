"""How a command reaches a task's code.

Each task's name leads to its ``lgvit eval`` / ``predict`` code and its released files' builder
by plain imports (:data:`CLI`, :data:`BUILD_RELEASED`; its training is :mod:`lgvit.tasks.run`'s,
which this module never imports). Which task a command runs: ``lgvit train`` the config's task,
or the resumed run's (:func:`resumed_task`); ``lgvit eval`` / ``predict`` the checkpoint's
(:func:`task_of_checkpoint`).

The tasks' eval/predict flags (:class:`lgvit.tasks.flags.Flag` items in each ``cli``): the
command's parser takes the union (:func:`add_task_flags`: a flag several tasks read is one
option whose choices are the union of theirs), and every task flag is parsed to "absent" unless
given. Once the checkpoint says which task runs, :func:`apply_task_flags` refuses in one line a
flag that task does not read (or a value outside its choices; a task's ``REFUSAL_HINTS`` may add
what to do instead) and fills in the task's defaults for the rest: a flag is either used or
refused, never ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lgvit.core.errors import LgvitError
from lgvit.task_table import DEFAULT_TASK, TASKS, TaskSpec, get_task, task_of_data
from lgvit.tasks import classification, detection, segmentation
from lgvit.tasks.classification import cli as classification_cli
from lgvit.tasks.detection import cli as detection_cli
from lgvit.tasks.flags import Flag
from lgvit.tasks.segmentation import cli as segmentation_cli

if TYPE_CHECKING:
    from lgvit.run.config import TrainConfig
    from lgvit.run.rundir import Resumed

# Each task's eval/predict code (``EVAL_FLAGS``, ``PREDICT_FLAGS``, ``run_eval``, ``run_predict``)
# and the model one of its released files loads into (``lgvit weights`` checks a download with it).
CLI: dict[str, ModuleType] = {
    "classification": classification_cli,
    "segmentation": segmentation_cli,
    "detection": detection_cli,
}
BUILD_RELEASED: dict[str, Callable[[Any], Any]] = {
    "classification": classification.build_released,
    "segmentation": segmentation.build_released,
    "detection": detection.build_released,
}
COMMANDS = {"eval": "EVAL_FLAGS", "predict": "PREDICT_FLAGS"}


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


def task_flags(task: TaskSpec, command: str) -> tuple[Flag, ...]:
    """The flags ``task`` reads in ``command`` (eval or predict), beyond the common ones."""
    return tuple(getattr(CLI[task.name], COMMANDS[command]))


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
        hint = getattr(CLI[task.name], "REFUSAL_HINTS", {}).get((command, dest), "")
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
