"""Faults and bad input, round five: the run's tools and process set-up. ``lgvit average``
writing over a checkpoint it reads or a run's own files, W&B without credentials, a
TensorBoard folder that cannot be written, ranks outside the world and a rendezvous missing a
process, and the messages of ``--initial-checkpoint`` / ``average`` with hub folders, an
empty ``kept.json``, ``SLURM_NTASKS=0``, a copied checkpoint's resume and ``keep_best`` with an
EMA."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import types

import pytest
import torch
from test_faults_r4_run import SYN, _one_line, _train
from test_train import ENV

from lgvit.checkpoints.files import load_metadata
from lgvit.checkpoints.run_layout import RunLayout
from lgvit.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-iteration run."""
    root = tmp_path_factory.mktemp("r5")
    _train([*SYN, "--iters", "2", "--seed", "1", "--out", str(root / "run")])
    return root / "run"


def _files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _lgvit(
    *args: str, env: dict[str, str] | None = None, cwd=None, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lgvit", *args],
        capture_output=True, text=True, env=env or ENV, cwd=cwd, timeout=timeout,
    )  # fmt: skip


# ------------------------------------------------------------ 1: average over its own inputs


@pytest.fixture
def two(run, tmp_path, monkeypatch):
    """Two copies of the run, ``a`` and ``b``, in the working directory."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        shutil.copytree(run, tmp_path / name)
    return tmp_path


def test_average_out_as_one_of_its_inputs_is_refused(two, capsys):
    """``--out runs/a/last.safetensors`` replaced run a's checkpoint with the average (its pair
    id gone: ``--resume auto`` then failed)."""
    (two / "link").symlink_to(two / "a")
    before = _files(two / "a")
    for inputs, out in (
        (["a/last.safetensors", "b/last.safetensors"], "a/last.safetensors"),
        (["a/last", "b/last"], "a/last.safetensors"),  # stems
        (["a/last.safetensors", "b/last.safetensors"], "a/last"),  # no suffix
        ([str(two / "a/last.safetensors"), "b/last"], "./b/../a/last.safetensors"),
        (["link/last", "b/last"], str(two / "a/last.safetensors")),  # through a link
        (["a/best.safetensors", "b/best.safetensors"], "link/best.safetensors"),
    ):
        code = main(["average", *inputs, "--out", out])
        _one_line(capsys, code, f"--out {out}", "one of the checkpoints averaged")
    assert _files(two / "a") == before
    assert main(["train", "--out", "a", "--resume", "auto"]) == 0  # still resumable


def test_average_out_over_a_runs_checkpoint_or_kept_epochs_is_refused(two, capsys):
    from safetensors.torch import load_file

    from lgvit.run.kept import keep_epoch

    (two / "c").mkdir()
    shutil.copy(two / "b" / "last.safetensors", two / "c" / "x.safetensors")
    shutil.copy(two / "b" / "last.safetensors", two / "c" / "y.safetensors")
    w = load_file(two / "a" / "last.safetensors")
    keep_epoch(two / "a", 2, 0, 50.0, w, None, {"model": "lsa_micro_cifar"})
    before = _files(two / "a")
    inputs = ["c/x.safetensors", "c/y.safetensors"]
    for stem in ("last", "best", "last_ema"):
        code = main(["average", *inputs, "--out", f"a/{stem}.safetensors"])
        _one_line(capsys, code, f"--out a/{stem}.safetensors", "holds a run", f"{stem} checkpoint")
    for out in ("a/kept/epoch-0001.safetensors", "a/kept/mine.safetensors"):
        code = main(["average", *inputs, "--out", out])
        _one_line(capsys, code, f"--out {out}", "kept epochs")
    assert _files(two / "a") == before
    # beside the run under another name, or a folder that holds no run: written
    assert main(["average", *inputs, "--out", "a/average.safetensors"]) == 0
    assert main(["average", *inputs, "--out", "c/last.safetensors"]) == 0
    assert (two / "a" / "average.safetensors").is_file() and (two / "c/last.safetensors").is_file()


# ------------------------------------------------------------------ 14: an empty kept.json


def test_an_empty_kept_index_is_named(tmp_path, capsys):
    """It said "nothing to average: no checkpoints given"."""
    RunLayout(tmp_path).kept_dir.mkdir()
    index = RunLayout(tmp_path).kept_index
    index.write_text("[]")
    out = tmp_path / "avg.safetensors"
    code = main(["average", str(tmp_path), "--out", str(out)])
    _one_line(capsys, code, str(index), "lists no epochs")
    assert not out.exists()
    assert json.loads(index.read_text()) == []


# --------------------------------------------------------------- 9: W&B without credentials


def _no_wandb_env(home) -> dict[str, str]:
    """The test's environment without W&B credentials: an empty HOME (no ~/.netrc, no
    ~/.config/wandb), no WANDB_* variable."""
    drop = ("NETRC", "XDG_CONFIG_HOME")
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_") and k not in drop}
    return {**env, "HOME": str(home)}


def test_wandb_without_credentials_is_one_line_before_anything_is_written(tmp_path):
    """It was wandb's UsageError traceback, after the run's config and log were written."""
    pytest.importorskip("wandb")
    home, out = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    args = [*SYN[1:], "--iters", "2", "--set", "log_to=[wandb]", "--out", str(out)]
    p = _lgvit("train", *args, env=_no_wandb_env(home), cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    for needle in ("log_to wandb", "wandb login", "WANDB_API_KEY", "WANDB_MODE=offline"):
        assert needle in lines[0], lines[0]
    assert not out.exists() and not any(home.iterdir())
    assert not (tmp_path / "wandb").exists()


# ------------------------------------------------------- 10: a TensorBoard folder unwritable


def test_a_tensorboard_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """A file where ``<out>/tensorboard`` goes: the run wrote its config and log, then failed
    at the writer (unwritable: a writer-thread traceback interleaved with the error line)."""
    pytest.importorskip("torch.utils.tensorboard")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    code = main([*SYN, "--iters", "2", "--set", "log_to=[tensorboard]", "--out", str(out)])
    _one_line(capsys, code, f"log_to tensorboard: {out / 'tensorboard'}", "not a folder")
    assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]


def test_a_tensorboard_folder_without_write_permission_is_one_line(tmp_path, capsys):
    pytest.importorskip("torch.utils.tensorboard")
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard").chmod(0o500)
    try:
        if os.access(out / "tensorboard", os.W_OK):
            pytest.skip("this user (root) writes in a folder without write permission")
        code = main([*SYN, "--iters", "2", "--set", "log_to=[tensorboard]", "--out", str(out)])
        _one_line(capsys, code, f"log_to tensorboard: cannot write in {out / 'tensorboard'}")
        assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]
    finally:
        (out / "tensorboard").chmod(0o700)


# ------------------------------------------- 11: ranks outside the world; a missing process

_LAUNCH = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "TORCHELASTIC_USE_AGENT_STORE", "LGVIT_RENDEZVOUS_TIMEOUT")  # fmt: skip


def _launch_env(**given: str) -> dict[str, str]:
    """The test's environment with only ``given`` of the launchers' variables."""
    env = {k: v for k, v in ENV.items() if k not in _LAUNCH and not k.startswith("SLURM_")}
    return {**env, **given}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cpu(out, env: dict[str, str], timeout: int = 90) -> subprocess.CompletedProcess:
    return _lgvit(*SYN, "--iters", "2", "--device", "cpu", "--out", str(out), env=env,
                  timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    "given, needle",
    [
        (dict(SLURM_PROCID="3", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODELIST="localhost"),
         "SLURM_PROCID=3 with SLURM_NTASKS=2: the rank must be 0 to 1"),
        (dict(RANK="3", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1"),
         "RANK=3 with WORLD_SIZE=2: the rank must be 0 to 1"),
        (dict(RANK="-1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1"),
         "RANK=-1 with WORLD_SIZE=2"),
        (dict(RANK="0", WORLD_SIZE="0"), "WORLD_SIZE=0: a run needs at least 1 process"),
        (dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="2", LOCAL_WORLD_SIZE="2",
              MASTER_ADDR="127.0.0.1"), "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
        (dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_NTASKS_PER_NODE="1",
              SLURM_NODELIST="localhost"), "SLURM_LOCALID=1 with SLURM_NTASKS_PER_NODE=1"),
        # 14: it named SLURM_LOCALID and SLURM_NODELIST, which were not at fault
        (dict(SLURM_PROCID="0", SLURM_NTASKS="0"), "SLURM_NTASKS=0: a run needs at least 1"),
    ],
)  # fmt: skip
def test_ranks_outside_the_world_are_refused_at_once(tmp_path, given, needle):
    """``SLURM_PROCID=3 SLURM_NTASKS=2`` (or ``RANK=3 WORLD_SIZE=2``) waited forever for ranks
    that cannot come, without a word."""
    out = tmp_path / "run"
    p = _train_cpu(out, _launch_env(MASTER_PORT=str(_free_port()), **given))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert needle in lines[0], lines[0]
    assert not out.exists()


def test_a_world_of_two_with_one_process_stops_after_the_timeout(tmp_path):
    """``SLURM_NTASKS=2`` with one process started waited 30 minutes in silence: it says what it
    waits for, then stops after LGVIT_RENDEZVOUS_TIMEOUT naming the rank that never came."""
    port, out = str(_free_port()), tmp_path / "run"
    env = _launch_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", MASTER_PORT=port,
                      SLURM_NODELIST="localhost", LGVIT_RENDEZVOUS_TIMEOUT="3")  # fmt: skip
    p = _train_cpu(out, env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 2, p.stderr[-3000:]
    assert f"waiting for the other processes at localhost:{port} (world size 2)" in lines[0]
    assert "LGVIT_RENDEZVOUS_TIMEOUT" in lines[0]
    assert lines[1].startswith(f"lgvit train: error: rendezvous at localhost:{port}: after 3 s")
    assert "1 of 2 processes joined; rank(s) 1 did not" in lines[1]
    assert not out.exists()
    # rank 1 alone: nobody hosts the rendezvous
    env = _launch_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, LGVIT_RENDEZVOUS_TIMEOUT="2")  # fmt: skip
    p = _train_cpu(out, env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 2, p.stderr[-3000:]
    assert f"rank 1 of 2: no rendezvous at 127.0.0.1:{port} after 2 s" in lines[1]
    assert not out.exists()


def test_a_rendezvous_timeout_that_is_no_number_is_one_line(tmp_path):
    env = _launch_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()), LGVIT_RENDEZVOUS_TIMEOUT="soon")  # fmt: skip
    p = _train_cpu(tmp_path / "run", env)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "lgvit train: error: LGVIT_RENDEZVOUS_TIMEOUT='soon': expected seconds, a number above 0"
    ], p.stderr[-3000:]


# --------------------------------------- 14: hub folders for --initial-checkpoint and average


@pytest.fixture
def hub_folder(tmp_path, monkeypatch):
    """A ``save_pretrained`` folder of the run's model, and the same as ``hf-hub:me/micro``
    (huggingface_hub mocked as in test_hub: no network)."""
    import lgvit

    folder = tmp_path / "hf"
    lgvit.create_model("lsa_micro_cifar", img_size=16).save_pretrained(folder)
    fake = types.ModuleType("huggingface_hub")

    def hf_hub_download(repo_id: str, filename: str, revision=None) -> str:  # noqa: ANN001
        assert repo_id == "me/micro"
        return str(folder / filename)

    fake.hf_hub_download = hf_hub_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    return folder


def test_initial_checkpoint_takes_hub_folders_as_eval_does(hub_folder, tmp_path, capsys):
    """``local-dir:DIR`` and ``hf-hub:`` were "no such file" for ``train --initial-checkpoint``
    while eval, predict and export took them."""
    for i, source in enumerate((f"local-dir:{hub_folder}", "hf-hub:me/micro", str(hub_folder))):
        out = tmp_path / f"ft{i}"
        _train([*SYN, "--iters", "1", "--initial-checkpoint", source, "--out", str(out)])
        assert (
            f"started from the weights of {hub_folder / 'model.safetensors'}"
            in (out / "train.log").read_text()
        )


def test_average_takes_hub_folders(hub_folder, run, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "avg.safetensors"
    for source in (f"local-dir:{hub_folder}", "hf-hub:me/micro"):
        assert main(["average", source, str(run / "last"), "--out", str(out)]) == 0
        a, b = load_file(hub_folder / "model.safetensors"), load_file(run / "last.safetensors")
        got = load_file(out)
        torch.testing.assert_close(got["head.weight"], (a["head.weight"] + b["head.weight"]) / 2)
        # the folder's weights carry no lgvit record: the run's, so the average evaluates
        assert load_metadata(out)["model"] == "lsa_micro_cifar"


# ------------------------------------------- 14: a copied checkpoint resumed into a run folder


def test_a_copied_checkpoint_resumed_into_a_run_is_refused_in_true_words(run, tmp_path, capsys):
    """A run's checkpoint copied into a folder of checkpoints: its folder was called "another
    run" and `--out` it suggested (training into the folder of copies)."""
    copies, mine = tmp_path / "checkpoints", tmp_path / "mine"
    copies.mkdir()
    for name in ("last.safetensors", "last.state.pt"):
        shutil.copy(run / name, copies / name)
    shutil.copytree(run, mine)
    before = _files(mine)
    capsys.readouterr()
    code = main(["train", "--out", str(mine), "--resume", str(copies / "last")])
    line = _one_line(capsys, code, f"--resume {copies / 'last'}", f"started in {run}",
                     f"--initial-checkpoint {copies / 'last'}", f"--out {run}")  # fmt: skip
    assert "another run" not in line and f"--out {copies}" not in line
    assert _files(mine) == before


# ------------------------------------------------------ 14: keep_best with an EMA ranks by it


def test_keep_best_with_an_ema_ranks_by_the_emas_top1(tmp_path):
    """keep_best ranked by the plain model's top-1 while ``lgvit average`` averages the kept
    EMA weights: as timm, the EMA's top-1 ranks when the run evaluates an EMA, and the index
    says which metric ranked."""
    out = tmp_path / "ema"
    _train([*SYN, "--epochs", "3", "--model-ema", "--model-ema-decay", "0.5",
            "--set", "keep_best=2", "--out", str(out)])  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    index = json.loads(RunLayout(out).kept_index.read_text())
    want = sorted(rows, key=lambda r: -r["test_ema_acc1"])[:2]
    assert [r["epoch"] for r in index] == [r["epoch"] for r in want]
    assert [r["metric"] for r in index] == [r["test_ema_acc1"] for r in want]
    assert {r["ranked_by"] for r in index} == {"test_ema_acc1"}
    # without an EMA: the model's own top-1
    plain = tmp_path / "plain"
    _train([*SYN, "--epochs", "2", "--set", "keep_best=1", "--out", str(plain)])
    assert json.loads(RunLayout(plain).kept_index.read_text())[0]["ranked_by"] == "test_acc1"
