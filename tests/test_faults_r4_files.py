"""Faults and bad input, round four: files. Released weights that would run code, where
``lgvit export`` writes, and a weights cache named by a file."""

from __future__ import annotations

import argparse
import io
import os

import pytest
import torch
from conftest import quick_init
from test_weights import SMALL, FakeReleases, _left, _state

import lgvit
from lgvit.cli import main
from lgvit.errors import LgvitError
from lgvit.models.download import ENV_DIR, ENV_MIRROR, record_path


@pytest.fixture(autouse=True)
def _quick_init():
    with quick_init():  # every model here is loaded from a file or exported: its draw is moot
        yield


# ------------------------------------------------------------- released weights that run code


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))  # what unpickling it would run


def _with_payload(marker) -> bytes:
    """The authors' layout (weights beside their argparse Namespace) plus a call of os.system."""
    obj = {
        "model": _state(SMALL, cheap=True),
        "args": argparse.Namespace(model=SMALL.model),
        "hook": _Payload(str(marker)),
    }
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture
def served(tmp_path, monkeypatch):
    server = FakeReleases()
    folder = tmp_path / "weights"
    monkeypatch.setenv(ENV_DIR, str(folder))
    monkeypatch.setenv(ENV_MIRROR, server.base)
    yield server, folder
    server.httpd.shutdown()


def test_released_weights_holding_code_are_refused_not_run_not_kept(served, tmp_path, capsys):
    server, cache = served
    marker = tmp_path / "ran"
    server.files[SMALL.filename] = _with_payload(marker)
    with pytest.raises(LgvitError) as e:
        lgvit.create_model(SMALL.name, pretrained=True)
    text = str(e.value)
    assert "\n" not in text and f"{server.base}/{SMALL.filename}" in text
    assert "holds code that would run" in text and f"system('touch {marker}')" in text
    assert not marker.exists() and _left(cache) == []  # not run, no file, no record
    # The command says the same in one line.
    assert main(["weights", "download", SMALL.name]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"system('touch {marker}')" in err and not marker.exists() and _left(cache) == []
    # A copy put in the cache by hand is refused too, and not recorded as checked.
    (cache / SMALL.filename).write_bytes(server.files[SMALL.filename])
    with pytest.raises(LgvitError, match=r"holds code that would run .*system\('touch"):
        lgvit.create_model(SMALL.name, pretrained=True)
    assert not record_path(cache / SMALL.filename).exists() and not marker.exists()
