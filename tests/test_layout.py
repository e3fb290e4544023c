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


# Imports point down: a layer never imports one above it (lazily inside a function neither).
RUN = ("lgvit.engine", "lgvit.optim", "lgvit.preempt", "lgvit.rundir", "lgvit.config")
APPLICATION = ("lgvit.tasks", *RUN, "lgvit.cli")
LAYER_RULES = {  # a layer's package -> what it may not import (a module or its package)
    "lgvit.data": APPLICATION,
    "lgvit.models": APPLICATION,  # the model zoo words its messages without the tasks
    "lgvit.inference": APPLICATION,
    "lgvit.dense": tuple(m for m in APPLICATION if m != "lgvit.config"),  # DETECTORS: config's
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("layer", sorted(LAYER_RULES))
def test_imports_point_down(layer):
    graph = _graph()
    wrong = sorted(
        f"{m} imports {n}"
        for m in graph
        if _within(m, layer)
        for n in graph[m]
        if any(_within(n, above) for above in LAYER_RULES[layer])
    )
    assert not wrong, wrong


TRAINING = {"lgvit.engine", "lgvit.optim", "lgvit.tasks.run"} | {
    m for m in MODULES if m.startswith("lgvit.tasks.") and m.endswith(".train")
}


def test_eval_bench_predict_never_import_training():
    """``lgvit eval``, ``predict`` and ``bench`` and every task's evaluation and command code
    never reach the engine or any task's training module (the registry imports a task's
    modules by name, on first use: ``cmd_eval`` reaches only the one it runs)."""
    graph = _graph()
    cli = ast.parse(MODULES["lgvit.cli"].read_text())
    for fn in ("cmd_eval", "cmd_bench", "cmd_predict", "_run_task_command"):
        node = next(n for n in cli.body if isinstance(n, ast.FunctionDef) and n.name == fn)
        reach = _reachable(graph, _imports(node, "lgvit.cli", False))
        assert not reach & TRAINING, (fn, sorted(reach & TRAINING))
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
    training = module in TRAINING - {"lgvit.optim", "lgvit.tasks.run"}  # the loop and tasks
    limit = MAX_TRAINING_MODULE_LINES if training else MAX_MODULE_LINES
    assert text.count("\n") <= limit, f"{path}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name == "build_parser" or node.name.startswith("_add_"):
                continue  # argparse builders: one line per flag
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{path}:{node.lineno} {node.name} is {n} lines"
