"""A SLURM launch (``srun``) without torchrun: rank, world size, local rank and the rendezvous
come from SLURM's variables (lgvit.core.runtime.slurm_environment)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from test_train import ENV, FAST, metrics

from lgvit.core.errors import LgvitError
from lgvit.core.runtime import SLURM_PORT_BASE, first_host, slurm_environment


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node1", "node1"),
        ("gpu[07-09,12],cpu3", "gpu07"),
        ("gpu[12,07-09]", "gpu12"),  # SLURM's order, not sorted
        ("rack[1-2]-n[005,007]", "rack1-n005"),
        ("a-b[001-004],c[1-2]", "a-b001"),
        ("localhost", "localhost"),
    ],
)
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_a_broken_node_list_is_one_line():
    with pytest.raises(LgvitError, match=r"SLURM_NODELIST='gpu\[07': not a SLURM node list"):
        first_host("gpu[07")


SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}  # fmt: skip


def test_slurm_variables_give_torchruns():
    assert slurm_environment(SLURM) == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(SLURM_PORT_BASE + 4242 % 1000),
    }  # fmt: skip
    # the step's task count wins over the job's; MASTER_PORT when set
    env = {**SLURM, "SLURM_STEP_NUM_TASKS": "2", "MASTER_PORT": "1234"}
    got = slurm_environment(env)
    assert got["WORLD_SIZE"] == "2" and got["MASTER_PORT"] == "1234"


@pytest.mark.parametrize("var", ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"])
def test_torchrun_variables_win(var):
    """srun starting torchrun: torchrun's variables are the ones to use."""
    assert slurm_environment({**SLURM, var: "0"}) == {}


def test_a_single_task_or_no_slurm_changes_nothing():
    assert slurm_environment({**SLURM, "SLURM_NTASKS": "1"}) == {}
    assert slurm_environment({}) == {}


def test_srun_without_the_local_id_is_one_line():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}
    with pytest.raises(LgvitError, match="SLURM_PROCID is set but SLURM_LOCALID is not"):
        slurm_environment(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_with_slurm_variables_train_as_one_run(tmp_path):
    """What srun gives two tasks on one node, set by hand: one two-process run (gloo)."""
    run = tmp_path / "slurm"
    base = {k: v for k, v in ENV.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                      "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    base.update(SLURM_NTASKS="2", SLURM_NODELIST="localhost", SLURM_JOB_ID="7",
                MASTER_PORT=str(_free_port()))  # fmt: skip
    cmd = [sys.executable, "-m", "lgvit", "train", *FAST, "--batch-size", "16", "--data",
           "synthetic", "--epochs", "1", "--device", "cpu", "--out", str(run)]  # fmt: skip
    procs = [
        subprocess.Popen(cmd, env={**base, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    out = outs[0][0] + outs[1][0]
    assert "2 process(es)" in out and "global batch 32" in out
    assert out.count("final test top-1") == 1  # rank 0 alone reports and writes
    assert len(metrics(run)) == 1
