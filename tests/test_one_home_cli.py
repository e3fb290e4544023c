"""Each list of names the command line offers lives in the module that owns it: every flag's
``choices`` is read from there, and no other module retypes the list (or a part of it)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import torch

from lgvit import task_table as tasks
from lgvit.checkpoints import kinds
from lgvit.cli import build_parser, main
from lgvit.core.errors import LgvitError
from lgvit.core.runtime import AMP_MODES, COMPILE_MODES, resolve_amp
from lgvit.data.device_decode import DECODE_DEVICES
from lgvit.data.transforms import INTERPOLATIONS
from lgvit.run import config
from lgvit.tools import bench, export, plot, scaling, viz

SRC = Path(__file__).resolve().parents[1] / "src" / "lgvit"

# (subcommand, option dest) -> the owning module's tuple. A flag with choices missing here fails
# test_every_choices_flag_reads_its_owner: a new flag names its owner in this table.
OWNERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("bench", "amp"): AMP_MODES,
    ("bench", "compile"): COMPILE_MODES,
    ("bench", "scaling"): scaling.STUDY_NAMES,
    ("export", "format"): export.FORMATS,
    ("train", "task"): tasks.TASK_NAMES,
    ("train", "detector"): kinds.DETECTORS,
    ("train", "data"): tasks.ALL_DATASETS,
    ("train", "amp"): AMP_MODES,
    ("train", "compile"): COMPILE_MODES,
    ("eval", "data"): tasks.ALL_DATASETS,
    ("eval", "amp"): AMP_MODES,
    ("eval", "tta"): tasks.TTA_MODES,
    ("eval", "detector"): kinds.DETECTORS,
    ("predict", "detector"): kinds.DETECTORS,
    ("viz", "what"): viz.KINDS,
}
# The task flags are the union of the tasks' declarations (lgvit.tasks.dispatch), a new list by
# construction: equal to the owner's, in its order.
UNIONS = {("eval", "tta"), ("eval", "detector"), ("predict", "detector")}


def _choice_actions() -> dict[tuple[str, str], argparse.Action]:
    found: dict[tuple[str, str], argparse.Action] = {}

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif a.choices is not None:
                found[(command, a.dest)] = a

    walk(build_parser(), "")
    return found


def test_every_choices_flag_reads_its_owner():
    actions = _choice_actions()
    assert set(actions) == set(OWNERS)
    for key, action in actions.items():
        if key in UNIONS:
            assert tuple(action.choices) == OWNERS[key], key
        else:
            assert action.choices is OWNERS[key], key


def test_the_config_and_the_tasks_read_the_same_lists():
    assert config.AMP_MODES is AMP_MODES
    assert config.TTA_MODES is tasks.TTA_MODES
    for t in tasks.TASKS.values():  # each task's augmentations are the first few of the list
        assert t.eval_tta == tasks.TTA_MODES[: len(t.eval_tta)], t.name


# Each list and the one module that may spell it (or a part of it) out as a literal.
LISTS = (
    ("lgvit/core/runtime.py", AMP_MODES),
    ("lgvit/core/runtime.py", COMPILE_MODES),
    ("lgvit/task_table.py", tasks.TTA_MODES),
    ("lgvit/tools/export.py", export.FORMATS),
    ("lgvit/tools/viz.py", viz.KINDS),
    ("lgvit/tools/bench.py", bench.FORMATS),
    ("lgvit/tools/plot.py", plot.FORMATS),
    ("lgvit/tools/scaling.py", scaling.STUDY_NAMES),
    ("lgvit/checkpoints/kinds.py", kinds.DETECTORS),
    ("lgvit/data/transforms.py", tuple(INTERPOLATIONS)),
)


def _string_literals(tree: ast.AST) -> list[tuple[int, set[str]]]:
    """Each tuple/list/set literal of two or more strings (and each dict's string keys)."""
    out = []
    for node in ast.walk(tree):
        elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict) or len(elts) < 2:
            continue
        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
            out.append((node.lineno, {e.value for e in elts}))
    return out


def test_no_list_is_retyped_anywhere_in_the_source():
    retyped = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC.parent).as_posix()
        for line, values in _string_literals(ast.parse(path.read_text())):
            for owner, names in LISTS:
                if owner != where and values <= set(names):
                    retyped.append(f"{where}:{line} retypes {owner}'s {names}")
    assert not retyped, retyped


def test_help_defaults_are_formatted_from_their_owners():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    helps = {a.dest: a.help for a in train._actions}
    assert helps["detector"] == f"detection: default {config.TrainConfig.detector}"
    assert helps["model"] == f"registered model name (default: {config.TrainConfig.model})"
    assert f"global batch of {config.TrainConfig.lr_base_batch} " in helps["lr"]
    assert helps["sched"] == " | ".join(config.SCHEDULES)  # poly included


def test_help_lists_are_formatted_from_their_owners():
    """A help text that lists a flag's values reads them from the tuple they describe."""
    commands = build_parser()._subparsers._group_actions[0].choices
    helps = {c: {a.dest: a.help for a in commands[c]._actions}
             for c in ("train", "eval", "predict", "bench", "export")}  # fmt: skip
    assert helps["train"]["device"] == " | ".join(config.DEVICES)
    assert helps["train"]["decode_device"].startswith(" | ".join(DECODE_DEVICES) + ": ")
    assert helps["eval"]["interpolation"].startswith(" | ".join(INTERPOLATIONS) + " (")
    assert helps["eval"]["device"] == helps["predict"]["device"]
    assert helps["eval"]["device"].startswith("cpu, cuda, cuda:N ")
    assert helps["bench"]["device"].startswith("cpu, cuda or cuda:N ")
    assert all(f"NAME{s}" in helps["export"]["out"] for s in export.SUFFIXES.values() if s)


def test_resolve_amp_refuses_an_unknown_mode():
    # Before, any other word ran silently as auto (a library caller's typo chose bf16).
    with pytest.raises(LgvitError, match=r"--amp 'bf61': must be one of auto, bf16, fp16, none"):
        resolve_amp("bf61", torch.device("cpu"))


def test_bench_format_refused_in_one_line_naming_the_formats(capsys):
    assert main(["bench", "lsa_micro_cifar", "--format", "xml", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == "lgvit bench: error: --format 'xml': choose table, markdown, csv or json\n"
