"""A run folder's file names are spelled in one module, ``lgvit.checkpoints.run_layout``: every
reader and writer of a run folder asks its ``RunLayout``. Checked from the source: no other
module holds one of those names in a string literal (docstrings aside: they name files for
their readers)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from lgvit.checkpoints import run_layout
from lgvit.checkpoints.run_layout import STATE_SUFFIX, WEIGHTS_SUFFIX, RunLayout

SRC = Path(__file__).resolve().parents[1] / "src"
HOME = Path(run_layout.__file__).resolve().relative_to(SRC).as_posix()

# Every name the layout spells: its own, each checkpoint's two files and the pair's suffixes.
NAMES = {v for k, v in vars(RunLayout).items() if k.isupper() and isinstance(v, str)}
SUFFIXES = (WEIGHTS_SUFFIX, STATE_SUFFIX)
NAMES |= {*SUFFIXES, *(stem + suffix for stem in RunLayout.CHECKPOINTS for suffix in SUFFIXES)}

# A plain word of the layout that means something else in a module: (module, word) -> what.
OTHER_MEANINGS = {
    ("lgvit/dense/backbone.py", RunLayout.LAST): "out_norms 'last': the last level's norm only",
    ("lgvit/run/loggers.py", RunLayout.TENSORBOARD): "a log_to value and its package",
    ("lgvit/models/download.py", RunLayout.LOCK): "a weights download's lock",
}

_WORD = re.compile(r"[^\s()\[\]{},;:`'\"<>=|]+")  # a path stays whole: / . - _ * are in words


def spelled(text: str) -> set[str]:
    """The layout's names ``text`` spells: all of it, a path's last part (``runs/x/best``), or
    a word that can only be a file's name (``metrics.jsonl``, ``.safetensors``; not ``best``)."""
    found = {text} & NAMES
    for word in _WORD.findall(text):
        last = word.rpartition("/")[2]
        if last in NAMES and ("/" in word or not last.isalpha()):
            found.add(last)
        if last.startswith(RunLayout.KEPT_PREFIX) and last.endswith(WEIGHTS_SUFFIX):
            found.add(RunLayout.KEPT_PREFIX)  # a kept epoch's file
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    scopes = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes) and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip


def spellings(source: str) -> list[tuple[int, str]]:
    """(line, name) of each layout name in ``source``'s string literals (f-strings' parts
    included), docstrings left out."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted(
        (node.lineno, name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        for name in spelled(node.value)
    )


def test_the_run_folder_names_are_spelled_in_one_module():
    wrong = []
    for path in sorted((SRC / "lgvit").rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where == HOME:
            continue
        for line, name in spellings(path.read_text()):
            if (where, name) not in OTHER_MEANINGS:
                wrong.append(f"{where}:{line} spells {name!r}: ask {HOME}'s RunLayout")
    assert not wrong, wrong


def test_the_scan_catches_a_name_and_leaves_prose_and_docstrings():
    source = '''
def f(out, path):
    """Writes metrics.jsonl and runs/x/best."""
    a = out / "metrics.jsonl"
    b = f"pass a run's {path / 'last'} or a .safetensors file"
    c = "see runs/x/best or kept/epoch-0003_ema.safetensors"
    d = "the last good checkpoint is kept; the best epoch; model.safetensors"
    return a, b, c, d
'''
    assert spellings(source) == [
        (4, "metrics.jsonl"), (5, ".safetensors"), (5, "last"), (6, "best"), (6, "epoch-"),
    ]  # fmt: skip


def test_the_layout_is_the_one_runs_have_written():
    """The names are the run folders' on disk: a rename would orphan every existing run."""
    layout = RunLayout("runs/x")
    assert [p.name for p in layout.files] == [
        "last.safetensors", "last.state.pt", "best.safetensors", "best.state.pt",
        "last_ema.safetensors", "metrics.jsonl", "train.log", "config.yaml",
    ]  # fmt: skip
    assert layout.last == Path("runs/x/last") and layout.best == Path("runs/x/best")
    assert layout.kept_index == Path("runs/x/kept/kept.json")
    assert RunLayout.kept_name(11, False) == "epoch-0012.safetensors"
    assert RunLayout.kept_name(11, True) == "epoch-0012_ema.safetensors"
    assert (layout.lock.name, layout.tensorboard.name, layout.wandb_id.name) == (
        ".lock", "tensorboard", "wandb_id",
    )  # fmt: skip
    assert RunLayout("runs/x") == layout and RunLayout(Path("runs/x")).out == Path("runs/x")
