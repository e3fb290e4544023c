"""Faults and bad input, round two (issue 28), the data side: the decoded-image cache on a full
disk, under SIGTERM and after a SIGKILL (1); stale and superseded cache entries (5); images too
thin, too large or turned by their EXIF orientation (12). Tiny images, no training."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.data import decode
from lgvit.data.datasets import load_dataset, read_image_rgb
from lgvit.data.stream import _DecodeBatches
from lgvit.models import create_model
from lgvit.run.preempt import Preempted


def _png(path: Path, seed: int, size: tuple[int, int] = (8, 8)) -> Path:
    """A random RGB PNG, stored uncompressed: the same size in bytes for any seed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), np.uint8)
    Image.fromarray(arr).save(path, compress_level=0)
    return path


def _tree(root: Path, n: int = 3, size: tuple[int, int] = (8, 8)) -> Path:
    for s, split in enumerate(("train", "val")):
        for c, cls in enumerate(("a", "b")):
            for i in range(n):
                _png(root / split / cls / f"{i}.png", 100 * s + 10 * c + i, size)
    return root


def _load(root: Path, cache: Path, **kw):
    return load_dataset("imagefolder", str(root), cache_dir=str(cache), **kw)


def _cache_files(cache: Path) -> list[str]:
    folder = cache / "imagefolder"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


# ------------------------------------------------------------- 1: full disk, SIGTERM, SIGKILL


def test_too_little_free_space_is_one_line_before_decoding(tmp_path, monkeypatch):
    root, cache = _tree(tmp_path / "tree"), tmp_path / "cache"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    monkeypatch.setattr(decode, "_decode_chunk", lambda job: pytest.fail("decoded anyway"))
    with pytest.raises(LgvitError) as e:
        _load(root, cache)
    msg = str(e.value)
    assert "\n" not in msg and "no space left in" in msg and "0 MB free" in msg, msg
    assert str(cache / "imagefolder") in msg and "--cache-dir" in msg
    assert _cache_files(cache) == []


class _FullDisk:
    """A file whose writes after the first (the .npy header) fail with ENOSPC."""

    def __init__(self, f) -> None:
        self.f, self.writes = f, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(28, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_a_full_disk_while_writing_is_one_line_and_removes_the_temp_file(tmp_path, monkeypatch):
    root, cache = _tree(tmp_path / "tree"), tmp_path / "cache"
    # The memory-mapped writer this replaced died with SIGBUS here; plain writes get ENOSPC.
    monkeypatch.setattr(decode, "open", lambda *a, **k: _FullDisk(open(*a, **k)), raising=False)
    with pytest.raises(LgvitError) as e:
        _load(root, cache)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"no space left in {cache / 'imagefolder'}"), msg
    assert _cache_files(cache) == []  # no *.tmp-PID.npy left filling the disk
    monkeypatch.undo()
    assert len(_load(root, cache).train) == 6  # room again: builds


def test_temp_files_of_killed_builds_are_removed(tmp_path):
    root, cache = _tree(tmp_path / "tree"), tmp_path / "cache"
    folder = cache / "imagefolder"
    folder.mkdir(parents=True)
    dead, alive = _dead_pid(), os.getppid()  # pytest's parent: alive, not us
    stale = [f"tree-0123.tmp-{dead}.npy", f".tree-0123.npy.tmp-{dead}"]
    running = [f"tree-4567.tmp-{alive}.npy", f".tree-4567.json.tmp-{alive}"]
    for name in stale + running + ["notes.txt"]:
        (folder / name).write_bytes(b"x" * 100)
    _load(root, cache)
    left = _cache_files(cache)
    assert not set(stale) & set(left) and set(running) <= set(left) and "notes.txt" in left


_REAL_DECODE_CHUNK = decode._decode_chunk
_TEST_PID = os.getpid()  # a pool's forked workers see it too: the process that decodes


def _sigterm_on_first_chunk(job):
    """_decode_chunk that sends SIGTERM to the decoding process as it decodes the first chunk
    (a module-level function: a pool pickles it by name)."""
    if job[0] == 0:
        os.kill(_TEST_PID, signal.SIGTERM)
    return _REAL_DECODE_CHUNK(job)


@pytest.mark.parametrize("pool", [False, True])
def test_sigterm_while_decoding_stops_between_chunks(tmp_path, monkeypatch, pool):
    root, cache = _tree(tmp_path / "tree", n=12), tmp_path / "cache"  # 3 chunks of 16 images
    calls: list[int] = []

    def counted(job):
        calls.append(job[0])
        return _sigterm_on_first_chunk(job)

    if pool:  # the workers signal their parent; the pool must end when it stops
        monkeypatch.setattr(decode, "_POOL_MIN_IMAGES", 0)
        monkeypatch.setattr(decode, "_num_workers", lambda: 2)
        monkeypatch.setattr(decode, "_decode_chunk", _sigterm_on_first_chunk)
    else:
        monkeypatch.setattr(decode, "_decode_chunk", counted)
    # as training's RunControl does: SIGTERM only noted (before the fix: acted on after decoding)
    noted: list[int] = []

    def note(signum, frame) -> None:
        noted.append(signum)

    old = signal.signal(signal.SIGTERM, note)
    try:
        with pytest.raises(Preempted) as e:
            _load(root, cache)
        assert signal.getsignal(signal.SIGTERM) is note  # decoding put it back
    finally:
        signal.signal(signal.SIGTERM, old)
    msg = str(e.value)
    assert e.value.exit_code == 143 and "\n" not in msg and "SIGTERM" in msg, msg
    assert noted == [signal.SIGTERM]  # passed on: training also knows
    assert _cache_files(cache) == []
    if not pool:
        assert calls == [0]  # the chunk in hand finishes; nothing after it
    assert multiprocessing.active_children() == []  # the pool's workers are gone


# ----------------------------------------------------------------- 5: stale and superseded


def test_same_size_content_with_a_restored_mtime_is_decoded_again(tmp_path):
    root, cache = _tree(tmp_path / "tree"), tmp_path / "cache"
    first = _load(root, cache)
    old = first.train.images[0].clone()
    del first
    path = root / "train" / "a" / "0.png"
    st = path.stat()
    _png(path, 999)  # as `cp -p` or `rsync -t` would leave it: same size, same mtime
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    again = _load(root, cache)
    want = torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1)
    assert torch.equal(again.train.images[0], want) and not torch.equal(want, old)


def test_a_new_cache_entry_prunes_the_ones_it_supersedes(tmp_path):
    root, cache = _tree(tmp_path / "tree"), tmp_path / "cache"
    _load(root, cache)
    _load(root, cache, img_size=8)  # another img_size: another entry, kept
    other = _tree(tmp_path / "elsewhere" / "tree")  # the same folder name, another root: kept
    _load(other, cache)
    folder = cache / "imagefolder"
    # an entry of an older cache version of this name: never read again
    (folder / "tree-00000000000000000000.npy").write_bytes(b"old")
    (folder / "tree-00000000000000000000.json").write_text(json.dumps({"version": 2}))
    before = set(_cache_files(cache))
    assert len(before) == 8

    _png(root / "train" / "a" / "new.png", 7)
    _load(root, cache)
    after = set(_cache_files(cache))
    assert len(after) == 6 and len(after - before) == 2  # one pair gone, one new, no temps
    assert not any(name.startswith("tree-0000") for name in after)
    assert len(_load(root, cache, img_size=8).train) == 7  # that one is superseded in turn


# -------------------------------------------------------------------------------- 12: images


def _turned_jpeg(path: Path) -> Path:
    """A 16x8 JPEG (top half red, bottom blue) whose EXIF says: turn 90 degrees clockwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.zeros((8, 16, 3), np.uint8)
    arr[:4, :, 0], arr[4:, :, 2] = 255, 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(path, exif=exif, quality=95)
    return path


def test_exif_orientation_is_applied_everywhere_images_are_read(tmp_path):
    path = _turned_jpeg(tmp_path / "turned.jpg")
    with Image.open(path) as img:
        want = torch.from_numpy(np.array(ImageOps.exif_transpose(img))).permute(2, 0, 1)
    assert want.shape == (3, 16, 8)
    got = read_image_rgb(path)  # predict and viz read through this
    assert torch.equal(got, want)
    assert got[0, :, 6].float().mean() > 200 and got[2, :, 1].float().mean() > 200  # red right
    # the streaming loader's eval decode (folders too big to cache, eval of a test folder)
    batch = _DecodeBatches([str(path)], [[0]], 8, False, 1.0, "bicubic", (1, 1), (1, 1), 0)
    x, ok = batch[0]
    assert ok.all() and x[0, 0, :, 6].float().mean() > 200 and x[0, 2, :, 1].float().mean() > 200
    # the decoded cache: upright, it has the 8x16 of its PNG neighbours (stored natively)
    root = _tree(tmp_path / "tree", n=2, size=(8, 16))
    _turned_jpeg(root / "train" / "a" / "turned.jpg")
    d = _load(root, tmp_path / "cache")
    assert d.train.images.shape == (5, 3, 16, 8)
    assert torch.equal(d.train.images[2], want)  # a/0.png, a/1.png, a/turned.jpg


@pytest.mark.parametrize("size", [(5000, 1), (1, 100_000)])
def test_very_thin_images_are_refused_or_counted_as_bad(tmp_path, size):
    thin = tmp_path / "thin.png"
    Image.new("RGB", size, (1, 2, 3)).save(thin)
    with pytest.raises(LgvitError) as e:
        read_image_rgb(thin)
    msg = str(e.value)
    assert msg.startswith(f"{thin}: too thin") and f"{size[0]}x{size[1]}" in msg and "\n" not in msg
    # a data set counts it as unreadable (max_bad_fraction), in the cache and when streaming
    root = _tree(tmp_path / "tree")
    (root / "train" / "b" / "thin.png").write_bytes(thin.read_bytes())
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable image\(s\) of 7"):
        d = _load(root, tmp_path / "cache", max_bad_fraction=0.5, img_size=8)
    assert d.skipped == [str(root / "train" / "b" / "thin.png")] and len(d.train) == 6
    batch = _DecodeBatches([str(thin)], [[0]], 8, True, 1.0, "bicubic", (0.5, 1), (0.75, 1.33), 0)
    assert not batch[0][1].any()


def test_predict_refuses_a_thin_image_in_one_line(tmp_path, capsys):
    thin = tmp_path / "thin.png"
    Image.new("RGB", (5000, 1)).save(thin)
    weights = tmp_path / "m.pth"
    torch.save(create_model("lsa_micro_cifar", img_size=16).state_dict(), weights)
    args = ["--checkpoint", str(weights), "--model", "lsa_micro_cifar", "--img-size", "16"]
    rc = main(["predict", *args, str(thin)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and f"skipped: {thin}: too thin" in err[0], err


def test_an_image_over_the_decompression_bomb_limit_is_called_too_large(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    # 256 pixels: over twice the limit (Pillow's error); 144: between (Pillow only warns)
    for side in (16, 12):
        path = _png(tmp_path / f"{side}.png", 0, (side, side))
        with pytest.raises(LgvitError) as e:
            read_image_rgb(path)
        msg = str(e.value)
        assert msg.startswith(f"{path}: too large to decode ({side * side} pixels"), msg
        assert "MAX_IMAGE_PIXELS" in msg and "\n" not in msg
