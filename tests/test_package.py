"""What a pip install holds: the shipped configs found by name, ``lgvit configs``, the demo
extra's one-line error, and the built wheel installed alone into a fresh venv, where the demo
trains from a folder with no repository beside it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.run.config import (
    config_description,
    load_config,
    resolve_config,
    shipped_configs,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((REPO / "src" / "lgvit" / "configs").glob("*.yaml"))
DEMO = "digits_lsa_micro_demo"


def _error(spec: str) -> str:
    with pytest.raises(LgvitError) as e:
        load_config(spec)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ configs by name


def test_every_config_file_is_shipped_with_a_one_line_description() -> None:
    shipped = shipped_configs()
    assert sorted(shipped) == [p.stem for p in CONFIG_FILES] and len(shipped) >= 40
    for name, path in shipped.items():
        text = config_description(path)
        # the first comment line is the description `lgvit configs` shows: one short sentence
        assert 20 <= len(text) <= 100, (name, text)


def test_a_config_by_name_with_or_without_yaml_equals_its_file() -> None:
    by_file = load_config(str(REPO / "src" / "lgvit" / "configs" / f"{DEMO}.yaml"))
    assert resolve_config(DEMO) == resolve_config(f"{DEMO}.yaml") == shipped_configs()[DEMO]
    assert load_config(DEMO) == by_file == load_config(f"{DEMO}.yaml")
    assert by_file.data == "digits" and by_file.epochs == 30


def test_a_file_that_exists_wins_over_a_shipped_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path(f"{DEMO}.yaml").write_text("epochs: 2\n")
    assert load_config(f"{DEMO}.yaml").epochs == 2  # the local file
    assert load_config(DEMO).epochs == 30  # no file of that exact name here: the shipped one


def test_unknown_names_and_the_old_folder_are_one_line() -> None:
    msg = _error("digits_lsa_micro_dem")
    assert "no such config file or shipped config" in msg and "lgvit configs" in msg
    assert f"did you mean {DEMO}?" in msg
    assert "did you mean" not in _error("nothing_like_it")
    # where a checkout kept them before they shipped: the message names the new form
    assert f"the shipped one is --config {DEMO}" in _error(f"configs/{DEMO}.yaml")


def test_lgvit_configs_lists_every_config_with_its_description(capsys) -> None:
    assert main(["configs"]) == 0
    out, err = capsys.readouterr()
    rows = out.splitlines()
    assert [r.split()[0] for r in rows] == list(shipped_configs())
    demo = next(r for r in rows if r.startswith(DEMO + " "))
    assert "handwritten digits" in demo and "lgvit train --config NAME" in err
    assert main(["configs", "imagenet_lit_*"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4  # lit_ti, lit_s, lit_m, lit_b
    assert main(["configs", "--show", DEMO]) == 0
    assert capsys.readouterr().out == (CONFIG_FILES[0].parent / f"{DEMO}.yaml").read_text()


def test_lgvit_configs_and_train_refuse_unknown_names_in_one_line(capsys) -> None:
    for args in (["configs", "nope_*"], ["configs", "--show", "nope"], ["train", "--config", "x"]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lgvit configs" in err[0], err


def test_the_demo_without_scikit_learn_names_the_extra(tmp_path, monkeypatch, capsys) -> None:
    for name in ("sklearn", "sklearn.datasets"):  # as if scikit-learn were not installed
        monkeypatch.setitem(sys.modules, name, None)
    args = ["train", "--config", DEMO, "--out", str(tmp_path / "run"), "--epochs", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "lgvit[demo]"' in err[0], err


# ------------------------------------------------------------------ the wheel, alone


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 180) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (cmd, p.stdout[-3000:], p.stderr[-3000:])
    return p.stdout


def _build_wheel(tmp: Path, env: dict[str, str]) -> Path:
    """The wheel built from a copy of the sources: a build in the repository would leave
    build/ there, and a stale build/lib would slip removed files into later wheels."""
    import shutil

    src = tmp / "source"
    shutil.copytree(
        REPO / "src" / "lgvit",
        src / "src" / "lgvit",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    wheel = [*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    _run([*wheel, "-w", str(tmp / "dist")], tmp, env)
    (found,) = (tmp / "dist").glob("lgvit-*.whl")
    return found


def _check_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert all(n.startswith(("lgvit/", "lgvit-")) for n in names), names  # no tests, no docs
    assert {n for n in names if n.startswith("lgvit/configs/")} == {
        f"lgvit/configs/{p.name}" for p in CONFIG_FILES
    }
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "License-Expression: MIT" in meta
    assert 'Requires-Dist: scikit-learn; extra == "demo"' in meta


def _fresh_venv(tmp: Path, env: dict[str, str]) -> Path:
    """A venv without pip that reuses this environment's installed packages (torch, numpy, ...)
    through a .pth line, so nothing is downloaded. A directory named in a .pth file joins
    sys.path but its own .pth files are not read: the editable install's path hook to src/
    stays out, and lgvit can come only from the wheel."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(python), "-c", code], tmp, env).strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_lgvit_test_reuse.pth").write_text("".join(f"{p}\n" for p in ours))
    return venv


@pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None,
    reason="the demo's digits need scikit-learn (the demo extra)",
)
def test_the_wheel_alone_runs_the_demo_from_another_folder(tmp_path) -> None:
    if tuple(int(x) for x in version("setuptools").split(".")[:2]) < (77, 0):
        pytest.skip("building the wheel offline needs setuptools>=77 installed (PEP 639)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # One thread: beside another process on a small machine, more spin and run 10x slower.
    env.update(PYTHONNOUSERSITE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    wheel = _build_wheel(tmp_path, env)
    _check_wheel_contents(wheel)
    venv = _fresh_venv(tmp_path, env)
    python, lgvit = venv / "bin" / "python", venv / "bin" / "lgvit"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    _run([*pip, "install", "--no-deps", "--no-index", "-q", str(wheel)], tmp_path, env)

    away = tmp_path / "elsewhere"  # no repository beside it, no configs/ folder
    away.mkdir()
    probe = (
        "import json, sys, lgvit, lgvit.run.config as c; print(json.dumps({'file': lgvit.__file__, "
        f"'config': str(c.resolve_config('{DEMO}')), 'path': sys.path}}))"
    )
    where = json.loads(_run([str(python), "-c", probe], away, env))
    installed = venv.resolve()
    assert Path(where["file"]).resolve().is_relative_to(installed), where["file"]
    assert Path(where["config"]).resolve().is_relative_to(installed), where["config"]
    assert str(REPO / "src") not in where["path"]

    listing = _run([str(lgvit), "configs"], away, env).splitlines()
    assert len(listing) == len(CONFIG_FILES) and any(r.startswith(DEMO + " ") for r in listing)
    out = _run(
        [str(lgvit), "train", "--config", DEMO, "--epochs", "1", "--out", "run",
         "--set", "warmup_epochs=0"],
        away, env,
    )  # fmt: skip
    assert "final test top-1" in out and (away / "run" / "last.safetensors").is_file()
    ev = _run([str(lgvit), "eval", "--checkpoint", "run/last", "--data", "digits"], away, env)
    assert "top-1" in ev
