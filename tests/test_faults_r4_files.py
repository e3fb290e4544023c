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
from lgvit.core.errors import LgvitError
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
    assert "copy it to" not in text  # a copy in the cache would be refused in turn
    # The command says the same in one line.
    assert main(["weights", "download", SMALL.name]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"system('touch {marker}')" in err and not marker.exists() and _left(cache) == []
    # A copy put in the cache by hand is refused too, and not recorded as checked.
    (cache / SMALL.filename).write_bytes(server.files[SMALL.filename])
    with pytest.raises(LgvitError, match=r"holds code that would run .*system\('touch"):
        lgvit.create_model(SMALL.name, pretrained=True)
    assert not record_path(cache / SMALL.filename).exists() and not marker.exists()


# ------------------------------------------------------------------- where lgvit export writes

_EXPORT = ["export", "lsa_micro_cifar", "--img-size", "16", "--no-check"]


def _export_refused(capsys, *flags: str) -> str:
    """``lgvit export`` with ``flags`` refused before any work: its one line."""
    assert main([*_EXPORT, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".tmp-" not in err[0] and "random weights" not in err[0], err
    return err[0]


def test_export_out_that_cannot_be_written_is_one_line_naming_it(tmp_path, capsys):
    folder, afile = tmp_path / "d", tmp_path / "f"
    folder.mkdir()
    afile.write_text("kept")
    for fmt in ("onnx", "pt2"):
        line = _export_refused(capsys, "--format", fmt, "--out", str(folder))
        assert f"--out {folder}: a directory" in line
        line = _export_refused(capsys, "--format", fmt, "--out", str(afile / f"m.{fmt}"))
        assert f"{afile} is not a directory" in line
    # The hub layout is a folder: a file there, or under a file, is refused too.
    line = _export_refused(capsys, "--format", "hf", "--out", str(afile))
    assert f"--out {afile}: a file" in line
    line = _export_refused(capsys, "--format", "hf", "--out", str(afile / "hub"))
    assert f"{afile} is not a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"] and not any(folder.iterdir())
    assert afile.read_text() == "kept"


def test_export_into_a_read_only_folder_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: the folder answers as it would anyone else
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
            not mode & os.W_OK if os.fspath(p) == str(ro) else real(p, mode, **kw)))  # fmt: skip
    for fmt, out in (("onnx", ro / "m.onnx"), ("hf", ro / "hub"), ("hf", ro)):
        line = _export_refused(capsys, "--format", fmt, "--out", str(out))
        assert f"cannot write in {ro} (permission denied)" in line
    ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_export_suffix_and_format_must_agree(tmp_path, capsys):
    for fmt, name, says in (
        ("pt2", "m.onnx", "--format pt2 writes a .pt2 file"),
        ("onnx", "m.pt2", "--format onnx writes a .onnx file"),
        ("onnx", "model", "--format onnx writes a .onnx file"),
        ("hf", "m.onnx", "--format hf writes a folder"),
    ):
        line = _export_refused(capsys, "--format", fmt, "--out", str(tmp_path / name))
        assert f"--out {tmp_path / name}: " in line and says in line
    assert list(tmp_path.iterdir()) == []


def test_a_failed_atomic_write_names_the_file_not_its_temp_file(tmp_path):
    from lgvit.core.atomic import atomic_write, atomic_write_bytes

    folder = tmp_path / "d"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as e:  # the rename onto a folder
        atomic_write_bytes(folder, b"x")
    assert e.value.filename == str(folder) and ".tmp-" not in str(e.value)

    def denied(tmp):  # what open() says in a folder root could not write either
        raise PermissionError(13, "Permission denied", str(tmp))

    with pytest.raises(PermissionError) as e:
        atomic_write(tmp_path / "x.json", denied)
    assert e.value.filename == str(tmp_path / "x.json") and ".tmp-" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_export_failing_to_write_its_file_names_the_file(tmp_path, capsys, monkeypatch):
    import errno

    import lgvit.tools.export as ex

    def full_disk(model, fmt, out, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(ex, "_export_file", full_disk)
    out = tmp_path / "m.pt2"
    assert main([*_EXPORT, "--format", "pt2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"lgvit export: error: {out}: No space left on device"
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- a weights cache that is a file


def test_a_weights_dir_naming_a_file_says_so(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "weights"
    afile.write_text("not a folder")
    monkeypatch.setenv(ENV_MIRROR, "http://127.0.0.1:9")  # nothing is fetched: refused first
    sub = afile / "sub"
    for where, says in ((afile, f"{afile}: a file, not a folder"),
                        (sub, f"{sub}: {afile} is a file, not a folder")):  # fmt: skip
        monkeypatch.setenv(ENV_DIR, str(where))
        with pytest.raises(LgvitError) as e:
            lgvit.create_model(SMALL.name, pretrained=True)
        assert str(e.value).startswith(f"{ENV_DIR}={where}: ") and says in str(e.value)
        assert main(["weights", "download", SMALL.name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{ENV_DIR}={where}: " in err[0] and says in err[0], err
    assert afile.read_text() == "not a folder"
