"""The package's shape, checked from its source: no import cycle, evaluation, prediction and
benchmarking (and every task's evaluation and command code) never import training, and no
module or function grows past what one reads in a sitting (docs/architecture.md is the map)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULE_LINES = 950
MAX_TRAINING_MODULE_LINES = 700
MAX_FUNCTION_LINES = 90


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (SRC / "lgvit").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """lgvit modules ``tree`` imports, at any depth (lazy imports inside functions count)."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]  # fmt: skip
        for name in names:
            target = _resolve(name) if name.startswith("lgvit") else None
            if target and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    return {
        m: _imports(ast.parse(p.read_text()), m, p.name == "__init__.py")
        for m, p in MODULES.items()
    }


def _reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


def test_no_import_cycle():
    graph = _graph()
    for m in graph:
        back = [n for n in graph[m] if m in _reachable(graph, {n})]
        assert not back, f"{m} imports {back}, which import {m} back"


def test_import_lgvit_leaves_the_compiler_unimported():
    # torch._dynamo costs about 1.0 s to import (a decorator pulled it in once): `import lgvit`
    # and `lgvit --help` do not pay for it. (timm: test_timm_native checks the same.)
    code = "import sys, lgvit\nprint('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Imports point down: a module never imports one of a layer above its own, lazily inside a
# function neither. The layers, bottom up (docs/architecture.md draws them). The task table (what
# each task is: names, datasets, checkpoint defaults, words) sits below the checkpoints, whose
# record reads it; the tasks' code sits above the run, which it plugs into. ``lgvit`` itself is
# the public face of the model zoo.
LAYERS = (
    ("lgvit.core",),  # errors, constants, atomic writes, restricted unpickling, runtime
    ("lgvit.data",),
    ("lgvit.task_table",),  # one record per task, facts only
    ("lgvit.checkpoints",),  # files, record, kinds: what the model zoo loads
    ("lgvit.models", "lgvit"),
    ("lgvit.dense",),
    ("lgvit.inference",),  # a checkpoint -> a ready eval model, for every task
    ("lgvit.run",),  # config, engine, optim, rundir, preempt
    ("lgvit.tasks",),
    ("lgvit.tools",),  # bench, measure, scaling, export, viz, plot, weights
    ("lgvit.cli", "lgvit.__main__"),
)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> int:
    """The index in LAYERS of ``module``'s layer (the innermost package that names one)."""
    if module == "lgvit":
        return next(i for i, names in enumerate(LAYERS) if "lgvit" in names)
    found = [(len(p), i) for i, names in enumerate(LAYERS) for p in names
             if p != "lgvit" and _within(module, p)]  # fmt: skip
    assert found, f"{module} is in no layer of LAYERS: add its package there"
    return max(found)[1]


def _upward(graph: dict[str, set[str]], here: int) -> list[str]:
    return sorted(f"{m} imports {n}" for m in graph if _layer(m) == here
                  for n in graph[m] if _layer(n) > here)  # fmt: skip


@pytest.mark.parametrize("layer", [names[0] for names in LAYERS])
def test_imports_point_down(layer):
    here = next(i for i, names in enumerate(LAYERS) if names[0] == layer)
    wrong = _upward(_graph(), here)
    assert not wrong, wrong


def test_the_model_zoo_never_reaches_the_application():
    """Not even through a module below it: the models, the dense heads and the checkpoint
    layer reach no task code, no run, no tool and no command line."""
    graph = _graph()
    application = ("lgvit.tasks", "lgvit.run", "lgvit.tools", "lgvit.cli")
    for base in ("lgvit.checkpoints", "lgvit.models", "lgvit.dense"):
        start = {m for m in graph if _within(m, base)}
        reach = {m for m in _reachable(graph, start) if any(_within(m, a) for a in application)}
        assert not reach, (base, sorted(reach))


def test_the_layer_rule_catches_an_upward_import():
    """The rule can fail: a model module that imports the run's config is reported."""
    graph = _graph()
    graph["lgvit.models.vit"] = graph["lgvit.models.vit"] | {"lgvit.run.config"}
    wrong = _upward(graph, _layer("lgvit.models.vit"))
    assert wrong == ["lgvit.models.vit imports lgvit.run.config"]


TRAINING = {"lgvit.run.engine", "lgvit.run.optim", "lgvit.tasks.run"} | {
    m for m in MODULES if m.startswith("lgvit.tasks.") and m.endswith(".train")
}


def test_eval_bench_predict_never_import_training():
    """``lgvit eval``, ``predict`` and ``bench`` and every task's evaluation and command code
    never reach the engine or any task's training module (``lgvit.tasks.dispatch`` imports
    every task's ``cli``, none of which imports training; ``lgvit.tasks.run`` alone imports
    the tasks' ``train``). ``bench`` may reach ``run.optim`` alone: its training step is timed
    with the optimizer training builds."""
    graph = _graph()
    cli = ast.parse(MODULES["lgvit.cli"].read_text())
    for fn in ("cmd_eval", "cmd_bench", "cmd_predict", "_run_task_command"):
        node = next(n for n in cli.body if isinstance(n, ast.FunctionDef) and n.name == fn)
        reach = _reachable(graph, _imports(node, "lgvit.cli", False))
        allowed = {"lgvit.run.optim"} if fn == "cmd_bench" else set()
        assert not reach & TRAINING - allowed, (fn, sorted(reach & TRAINING - allowed))
    tasks = {m.rpartition(".")[0] for m in TRAINING if m.endswith(".train")}
    assert len(tasks) == 3, tasks
    for task in sorted(tasks):
        for part in ("evaluate", "cli"):
            reach = _reachable(graph, {f"{task}.{part}"})
            assert not reach & TRAINING, (f"{task}.{part}", sorted(reach & TRAINING))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_and_function_sizes(module):
    path = MODULES[module]
    text = path.read_text()
    training = module in TRAINING - {"lgvit.run.optim", "lgvit.tasks.run"}  # the loop and tasks
    limit = MAX_TRAINING_MODULE_LINES if training else MAX_MODULE_LINES
    assert text.count("\n") <= limit, f"{path}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name == "build_parser" or node.name.startswith("_add_"):
                continue  # argparse builders: one line per flag
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{path}:{node.lineno} {node.name} is {n} lines"
