"""Shared test helpers."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

import pytest
import torch

# Which device the device-sensitive tests (tests/test_device.py, marked ``device``) run on:
# ``cpu`` (unset) or ``cuda`` (LGVIT_TEST_DEVICE=cuda, on a GPU machine). Every other test is a
# CPU test: its commands leave ``--device`` at ``auto``, which would pick a GPU.
TEST_DEVICE = os.environ.get("LGVIT_TEST_DEVICE", "").strip().lower() or "cpu"
TEST_DEVICES = ("cpu", "cuda")
# CUDA_VISIBLE_DEVICES as the run's first pytest process found it (JSON; null: unset), kept
# in a variable of its own because the pin below hides the GPUs from every process it starts,
# xdist's workers included.
_FOUND = "LGVIT_TEST_FOUND_CUDA_VISIBLE_DEVICES"
os.environ.setdefault(_FOUND, json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES")))


def _reveal(env: MutableMapping[str, str]) -> None:
    found = json.loads(env.get(_FOUND, "null"))
    if found is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = found


def device_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a command a device test starts: it sees the GPUs
    the run was given, where a CPU test's command sees none."""
    env = dict(os.environ if env is None else env)
    _reveal(env)
    return env


if TEST_DEVICE == "cuda":
    _reveal(os.environ)
    if torch.cuda.is_available():
        # CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises: initialised now (and the
        # count cached, which torch reads from the variable until then), this process keeps
        # its GPUs for the device tests while every command a CPU test starts sees none.
        torch.cuda.init()
        torch.cuda.device_count()
# Hidden before anything initialises CUDA, so `make test` on a GPU machine runs as on a CPU
# one, in this process and in every command it starts (they inherit the variable).
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "device: runs on LGVIT_TEST_DEVICE (cpu or cuda)")
    # The slow device tests, which gpu_check's part b runs after the rest.
    config.addinivalue_line("markers", "ddp: a device test with several processes")
    config.addinivalue_line("markers", "dense: a device test of a dense task")
    if TEST_DEVICE not in TEST_DEVICES:
        raise pytest.UsageError(
            f"LGVIT_TEST_DEVICE={TEST_DEVICE!r}: must be one of {', '.join(TEST_DEVICES)}"
        )


@pytest.fixture(params=[TEST_DEVICE])
def device(request: pytest.FixtureRequest) -> str:
    """The device a ``device``-marked test runs on (in its id: ``[cpu]`` or ``[cuda]``)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("LGVIT_TEST_DEVICE=cuda, but torch.cuda.is_available() is False here")
    return request.param


@pytest.fixture(autouse=True)
def _cpu_unless_device_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Under LGVIT_TEST_DEVICE=cuda this process still sees its GPUs (for the device tests):
    every other test's ``auto`` device resolves to the CPU, as in the plain suite."""
    if TEST_DEVICE == "cuda" and request.node.get_closest_marker("device") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core (pytest -n auto): each gets one thread, and so do the
    # commands it starts (two 2-thread torch processes on 2 cores slow each other several-fold).
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture
def one_epoch(tmp_path):
    """``one_epoch(model, batches, optimizer, cfg, epoch=0, schedule=None)``: one training epoch
    of the classification task on the shared engine, with no data set, run directory or saves
    (a plain list of ``(x, y)`` batches as the loader); returns ``(mean loss, images, step)``."""
    from lgvit.core.progress import RunClock
    from lgvit.core.runtime import Dist
    from lgvit.run.engine import Optimisation, Prepared, Run, RunLog, train_one_epoch
    from lgvit.run.preempt import RunControl
    from lgvit.tasks.classification.train import ClassificationTask

    def run_epoch(model, batches, optimizer, cfg, epoch=0, schedule=None, img_size=0):
        d = Dist()
        cfg.out = str(tmp_path)
        task = ClassificationTask(cfg=cfg, img_size=img_size)
        schedule = schedule or dict(total_steps=len(batches), warmup_steps=0, cfg=cfg,
                                    base_lr=optimizer.param_groups[0]["lr"])  # fmt: skip
        prepared = Prepared(model, batches, [], {}, "test")
        opt = Optimisation(optimizer, None, None, schedule)
        clock = RunClock(len(batches), 0, len(batches))
        run = Run(cfg, task, d, Path(tmp_path), RunLog(Path(tmp_path), False),
                  RunControl(cfg, d), prepared, None, opt, model, clock)  # fmt: skip
        return train_one_epoch(run, epoch, 0)

    return run_epoch


@contextlib.contextmanager
def quick_init() -> Iterator[None]:
    """Models built inside get a clamped normal where lgvit draws torch's rejection-sampled
    truncated normal (``nn.init.trunc_normal_``: most of the time of building a model on a
    CPU), for tests whose checks do not depend on the initial draw."""

    def trunc_normal_(t, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):  # noqa: ANN001, ANN202
        with torch.no_grad():
            return t.normal_(mean, std, generator=generator).clamp_(a, b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.init, "trunc_normal_", trunc_normal_)
        yield


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One small RGB PNG (40x36) to predict on."""
    from PIL import Image

    path = tmp_path_factory.mktemp("img") / "x.png"
    Image.new("RGB", (40, 36), (120, 60, 30)).save(path)
    return str(path)


class NanBatches:
    """``n`` batches ``(x, y)`` for a linear model of 6 inputs and 3 classes; the batches whose
    index is in ``bad`` hold a NaN (a loss that is not finite)."""

    def __init__(self, n: int, bad: set[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(8, 6, generator=g), torch.arange(8) % 3) for _ in range(n)]
        for i in bad:
            self.batches[i][0][0, 0] = float("nan")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)
