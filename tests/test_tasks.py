"""The tasks package (lgvit.tasks): one registry that every consumer reads, each task's three
modules, every eval/predict flag either read or refused by each task (the flag x task matrix),
and the task of a command taken from the checkpoint, never from a flag's presence."""

from __future__ import annotations

import argparse
import ast
from importlib import import_module
from pathlib import Path

import pytest

from lgvit.cli import build_parser, main
from lgvit.core.errors import LgvitError
from lgvit.task_table import ALL_DATASETS, TASK_NAMES, TASKS, get_task
from lgvit.tasks.dispatch import BUILD_RELEASED, CLI, COMMANDS, apply_task_flags, task_flags
from lgvit.tasks.run import MAKE_TASK, make_task

SRC = Path(__file__).resolve().parents[1] / "src" / "lgvit"
# What every task's eval/predict reads (declared once by the command, not by a task).
COMMON = {
    "eval": {"checkpoint", "model", "data", "data_dir", "amp", "device", "json"},
    "predict": {"checkpoint", "model", "device", "json", "images"},
}
# Task names outside lgvit/tasks, each for a reason that is not choosing a task's behaviour.
NAMED_OUTSIDE = {
    "task_table.py": "the task table: what each task is",
    "data/coco.py": "COCO's annotation field 'segmentation'",
    "models/weights.py": "the released files' table: which task each file is for",
    "dense/detection.py": "the detector builder asks the table for detection weights",
    "dense/semfpn.py": "the segmenter builder asks the table for segmentation weights",
}


def _all_flags(command: str) -> dict[str, list[str]]:
    """Every task flag of ``command``: dest -> the tasks that declare it."""
    out: dict[str, list[str]] = {}
    for t in TASKS.values():
        for f in task_flags(t, command):
            out.setdefault(f.dest, []).append(t.name)
    return out


def _flag(command: str, dest: str):
    return next(f for t in TASKS.values() for f in task_flags(t, command) if f.dest == dest)


def _given(command: str, dest: str) -> list[str]:
    """argv giving ``dest`` a value every task that declares it accepts."""
    f = _flag(command, dest)
    if f.kwargs.get("action") == "store_true":
        return [f.option]
    if f.choices:
        return [f.option, str(f.choices[0])]
    n = f.kwargs.get("nargs", 1)
    kind = f.kwargs.get("type")  # int, a number in a range (finite_float: 0.5 fits all) or str
    value = "3" if kind is int else "x" if kind is None else "0.5"
    return [f.option] + [value] * n


def _parse(command: str, extra: list[str]) -> argparse.Namespace:
    base = {"eval": ["eval", "--checkpoint", "c", "--data", "cifar10"],
            "predict": ["predict", "--checkpoint", "c", "img.png"]}[command]  # fmt: skip
    return build_parser().parse_args(base[:1] + extra + base[1:])


def test_every_task_has_its_three_modules_and_the_engines_interface():
    for t in TASKS.values():
        task = make_task(t.name)
        for member in ("prepare", "param_groups", "loss", "evaluate", "summary", "identity_keys"):
            assert hasattr(task, member), (t.name, member)
        assert "task" in task.identity_keys, t.name  # a resume cannot change the task
        cli = CLI[t.name]
        assert callable(cli.run_eval) and callable(cli.run_predict), t.name
        evaluate = import_module(f"lgvit.tasks.{t.name}.evaluate")
        assert evaluate.__name__ == f"lgvit.tasks.{t.name}.evaluate"
        assert set(t.eval_tta) <= {"none", "flip", "flip-translate"} and "none" in t.eval_tta
        assert isinstance(t.record_defaults({"task": t.name}), dict)
    assert TASK_NAMES == tuple(TASKS) and set(ALL_DATASETS) == {
        d for t in TASKS.values() for d in t.datasets
    }


def test_each_task_name_links_to_its_own_code():
    """The plain imports that link a name to its code (eval/predict, released files, training)
    name every task of the table once, each with its own package's code."""
    for links, part in ((CLI, ".cli"), (BUILD_RELEASED, ""), (MAKE_TASK, ".train")):
        assert tuple(links) == TASK_NAMES, (part, tuple(links))
        for name, code in links.items():
            where = getattr(code, "__name__" if part == ".cli" else "__module__")
            assert where == f"lgvit.tasks.{name}{part}", (name, where)


def test_the_registry_is_what_train_and_the_config_read():
    from lgvit.run.config import TrainConfig, validate_config

    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                 if a.dest == "task")  # fmt: skip
    assert tuple(train.choices) == TASK_NAMES
    for t in TASKS.values():
        validate_config(TrainConfig(task=t.name, data=t.datasets[0]))
        other = next(d for d in ALL_DATASETS if d not in t.datasets)
        with pytest.raises(LgvitError, match=f"task={t.name} trains on"):
            validate_config(TrainConfig(task=t.name, data=other))
    with pytest.raises(LgvitError, match="unknown task 'ocr': one of classification"):
        get_task("ocr")


def test_no_module_outside_tasks_names_a_task():
    """Task-specific behaviour is found through the registry, not by comparing names."""
    found = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("tasks/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in TASKS:
                found.setdefault(rel, []).append(node.lineno)
    assert set(found) <= set(NAMED_OUTSIDE), {k: v for k, v in found.items()
                                              if k not in NAMED_OUTSIDE}  # fmt: skip


def _reads(module: object) -> set[str]:
    """Every ``args.X`` the task's cli module reads."""
    tree = ast.parse(Path(module.__file__).read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "args"}  # fmt: skip


@pytest.mark.parametrize("task", TASK_NAMES)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_task_reads_every_flag_it_declares_and_only_those(task, command):
    t = get_task(task)
    declared = {f.dest for f in task_flags(t, command)}
    fn = {"eval": "run_eval", "predict": "run_predict"}[command]
    module = CLI[t.name]
    reads = _reads(module)
    assert declared <= reads, f"{task} {command} declares but never reads {declared - reads}"
    other = {"eval": "predict", "predict": "eval"}[command]
    own = COMMON[command] | declared | COMMON[other] | {f.dest for f in task_flags(t, other)}
    assert reads <= own, f"{task}'s cli reads undeclared {reads - own}"
    assert callable(getattr(module, fn))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flag_by_task_matrix_every_flag_is_used_or_refused(command):
    """Every task flag given to every task: kept if the task declares it, else one line naming
    the flag, the task and the tasks that read it; flags not given take the task's default."""
    flags = _all_flags(command)
    assert flags, command
    for dest, readers in flags.items():
        for t in TASKS.values():
            args = _parse(command, _given(command, dest))
            given = getattr(args, dest)
            if t.name in readers:
                apply_task_flags(args, t, command)
                assert getattr(args, dest) == given
                for f in task_flags(t, command):  # the rest: the task's defaults
                    if f.dest != dest:
                        assert getattr(args, f.dest) == f.default, (t.name, f.dest)
            else:
                with pytest.raises(LgvitError) as e:
                    apply_task_flags(args, t, command)
                msg = str(e.value)
                assert "\n" not in msg and _flag(command, dest).option in msg, msg
                assert f"{t.name} {command} does not take" in msg, msg
                assert all(r in msg for r in readers), msg


def test_a_choice_outside_the_tasks_own_is_refused():
    args = _parse("eval", ["--tta", "flip-translate"])
    with pytest.raises(LgvitError, match="--tta flip-translate: segmentation eval takes --tta "
                       "none or flip"):  # fmt: skip
        apply_task_flags(args, get_task("segmentation"), "eval")
    args = _parse("eval", ["--tta", "flip-translate"])
    apply_task_flags(args, get_task("classification"), "eval")
    assert args.tta == "flip-translate"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A classification checkpoint as lgvit writes it (a tiny model, random weights)."""
    import lgvit
    from lgvit.checkpoints.files import save_checkpoint
    from lgvit.checkpoints.record import CheckpointRecord

    stem = tmp_path_factory.mktemp("cls") / "c"
    model = lgvit.create_model("lsa_micro_cifar", num_classes=10)
    record = CheckpointRecord(model="lsa_micro_cifar", img_size=32, num_classes=10)
    save_checkpoint(stem, model.state_dict(), metadata=record.to_meta())
    return stem.with_suffix(".safetensors")


def test_a_classifier_refuses_dense_flags_it_once_ignored_or_switched_on(
    classifier, tmp_path, capsys
):
    """``predict --out`` used to switch a classifier to the segmentation path; ``--score-thr``
    and ``--detector`` were silently ignored."""
    img = tmp_path / "a.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (120, 30, 200)).save(img)
    for extra, flag in ((["--out", str(tmp_path / "o")], "--out"),
                        (["--score-thr", "0.5"], "--score-thr")):  # fmt: skip
        code = main(["predict", "--checkpoint", str(classifier), *extra, str(img)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert f"{flag}: {classifier} is a classification checkpoint" in err[0], err
    assert not (tmp_path / "o").exists()
    code = main(["predict", "--checkpoint", str(classifier), "--json", str(img)])
    assert code == 0, capsys.readouterr().err
    code = main(["eval", "--checkpoint", str(classifier), "--data", "ade20k", "--data-dir",
                 str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a classifier; evaluate it on one of" in err[0]


def test_classification_eval_and_predict_compile_the_model(classifier, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    """``--compile`` runs the model through torch.compile (dynamo's eager backend here: the
    graph is Inductor's, its compilation is what takes minutes), with the same predictions."""
    import json

    import torch
    from PIL import Image

    compiled = []
    real = torch.compile

    def eager_compile(model, **kwargs):  # noqa: ANN001, ANN003
        compiled.append(model)
        return real(model, backend="eager", fullgraph=True)

    monkeypatch.setattr(torch, "compile", eager_compile)
    img = tmp_path / "a.png"
    Image.new("RGB", (40, 30), (20, 160, 90)).save(img)
    outs = []
    for extra in ([], ["--compile"]):
        code = main(["predict", "--checkpoint", str(classifier), "--json", *extra, str(img)])
        assert code == 0, capsys.readouterr().err
        outs.append(json.loads(capsys.readouterr().out))
    assert len(compiled) == 1 and outs[0] == outs[1]
    code = main(["eval", "--checkpoint", str(classifier), "--data", "synthetic", "--compile",
                 "--batch-size", "8", "--json"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert len(compiled) == 2 and json.loads(capsys.readouterr().out)["count"] > 0
