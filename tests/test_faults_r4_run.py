"""Faults and bad input, round four: the run. Another run's checkpoint resumed into a folder
holding a run, ``--resume auto`` with nothing to resume nor train, a resume with another batch
size, configs and label files nested too deeply to read, ``lgvit configs --show`` of a file
that is no config, and ImageNet-ReaL labels that score no image."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from test_eval import eval_args, v2_checkpoint  # noqa: F401 -- its fixture, by name
from test_train import FAST

from lgvit.checkpoints.files import load_checkpoint_pair
from lgvit.cli import main
from lgvit.run.config import shipped_configs

SYN = ["train", *FAST, "--data", "synthetic", "--amp", "none"]


def _train(args: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warm-up as long as a 2-step run
        assert main(args) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs: ``one``, 2 iterations (started as a preemption script would, with
    ``--resume auto`` on its first launch); ``two``, batch 128 (4 steps an epoch), cut after the
    first of 2 epochs by its time limit."""
    root = tmp_path_factory.mktemp("runs")
    _train([*SYN, "--iters", "2", "--seed", "1", "--out", str(root / "one"), "--resume", "auto"])
    _train([*SYN, "--epochs", "2", "--batch-size", "128", "--set", "time_limit_min=1e-9",
            "--out", str(root / "two")])  # fmt: skip
    return root


def _files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def _one_line(capsys, code: int, *needles: str) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, out[-2000:], err[-2000:])
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------- 1: another run's checkpoint


def test_another_runs_checkpoint_into_a_folder_holding_a_run_is_refused(runs, tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(runs / "one", one)
    shutil.copytree(runs / "two", two)
    before = _files(two)
    capsys.readouterr()
    code = main(["train", "--out", str(two), "--resume", str(one / "last")])
    _one_line(capsys, code, "another run", str(one), str(two), "--resume auto")
    assert _files(two) == before  # its metrics and checkpoints, byte for byte
    # Its own checkpoint by path still resumes it (here: finished, nothing to do).
    assert main(["train", "--out", str(one), "--resume", str(one / "last")]) == 0


def test_another_runs_checkpoint_starts_a_new_folder_with_its_metrics(runs, tmp_path):
    """Resumed into a new folder, the run carries its history: ``metrics.jsonl`` starts with
    the source run's rows, so the curve is whole (here the run is finished: nothing to do)."""
    new = tmp_path / "new"
    _train(["train", "--out", str(new), "--resume", str(runs / "one" / "last")])
    assert (new / "metrics.jsonl").read_bytes() == (runs / "one" / "metrics.jsonl").read_bytes()


# ---------------------------------------------------------- 8: nothing to resume; batch size


def test_resume_auto_with_nothing_to_resume_nor_train_is_refused(tmp_path, capsys):
    """A bare ``--resume auto`` on a missing folder once started a default run (downloading
    CIFAR-10); a first launch that says what to train starts it (the ``runs`` fixture)."""
    missing = tmp_path / "nonexist"
    code = main(["train", "--out", str(missing), "--resume", "auto", "--batch-size", "8"])
    _one_line(capsys, code, "--resume auto", str(missing), "holds no run", "--config")
    assert not missing.exists()


def test_resume_with_another_batch_size_notes_it_and_trains_every_epoch(runs, tmp_path, capsys):
    """The schedule's step was kept in the old batch's steps: with twice the batch the last
    epoch trained nothing (train loss 0.0), silently."""
    two = tmp_path / "two"
    shutil.copytree(runs / "two", two)
    capsys.readouterr()
    _train(["train", "--out", str(two), "--resume", "auto", "--batch-size", "256",
            "--set", "time_limit_min=null"])  # fmt: skip
    out = capsys.readouterr().out
    assert "the global batch is 256 images, not 128 as the run trained: 2 steps an epoch" in out
    assert "continues after epoch 1 at step 2 (was 4)" in out
    assert "base lr scaled with the batch to 0.00025 (was 0.000125)" in out
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["epoch"] == 1 and rows[1]["train_loss"] > 0 and rows[1]["img_per_s"] > 0
    assert load_checkpoint_pair(two / "last")[1]["global_step"] == 4  # 4 + 2 steps of 256


def test_resume_of_an_iteration_budget_with_another_batch_size_is_refused(runs, tmp_path, capsys):
    run = tmp_path / "one"
    shutil.copytree(runs / "one", run)
    before = _files(run)
    capsys.readouterr()
    code = main(["train", "--out", str(run), "--resume", "auto", "--batch-size", "16",
                 "--iters", "4"])  # fmt: skip
    _one_line(capsys, code, "budget of 4 iterations counts steps of 32 images", "not 16")
    assert _files(run) == before


# ---------------------------------------------------------------- 6: nested too deeply


def test_configs_nested_too_deeply_are_one_line(tmp_path, capsys):
    """A YAML config or a ``--set`` value nested thousands deep was a RecursionError
    traceback."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("lr: " + "[" * 5000 + "]" * 5000 + "\n")
    out = tmp_path / "out"
    code = main(["train", "--config", str(deep), "--out", str(out)])
    _one_line(capsys, code, f"{deep}: YAML nested too deeply to read")
    code = main(["train", "--set", "lr=" + "[" * 3000 + "]" * 3000, "--out", str(out)])
    _one_line(capsys, code, "--set lr: YAML nested too deeply to read")
    code = main(["configs", "--show", str(deep)])
    _one_line(capsys, code, f"{deep}: YAML nested too deeply to read")
    assert not out.exists()


def test_real_labels_nested_too_deeply_or_all_empty_are_one_line(request, tmp_path, capsys):
    """A ReaL file nested 100000 deep was a RecursionError traceback; one whose every list is
    empty printed "ReaL top-1 0.00% (0 images ...)"."""
    root, files = request.getfixturevalue("v2_checkpoint")
    deep, empty = tmp_path / "deep.json", tmp_path / "empty.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    empty.write_text(json.dumps([[] for _ in files]))
    code = main(eval_args(root, "--real-labels", str(deep)))
    _one_line(capsys, code, f"--real-labels {deep}: JSON nested too deeply to read")
    code = main(eval_args(root, "--real-labels", str(empty)))
    _one_line(capsys, code, str(empty), f"none of the {len(files)} images has a ReaL label")


# ----------------------------------------------------------------- 15: configs --show


def test_configs_show_prints_configs_only(tmp_path, capsys):
    """``lgvit configs --show /etc/passwd`` printed the file: --show takes a shipped config's
    name or a .yaml/.yml file holding config keys."""
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "secret.yml").write_text("password: hunter2\n")
    for name, needle in (("passwd", "not a config (a .yaml or .yml file)"),
                         ("list.yaml", "top level must be a mapping"),
                         ("secret.yml", "unknown config key 'password'")):  # fmt: skip
        code = main(["configs", "--show", str(tmp_path / name)])
        assert "hunter2" not in _one_line(capsys, code, str(tmp_path / name), needle)
        assert capsys.readouterr().out == ""
    mine = tmp_path / "mine.yml"
    mine.write_text("# my run\nlr: 0.001\n")
    for spec, path in (("cifar10_lsa_tiny", shipped_configs()["cifar10_lsa_tiny"]), (mine, mine)):
        assert main(["configs", "--show", str(spec)]) == 0
        assert capsys.readouterr().out == path.read_text()
