"""Large image folders stream from files through DataLoader workers."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from lgvit.core.errors import LgvitError
from lgvit.data.datasets import FileImageSet, ImageSet, load_dataset
from lgvit.data.loader import AugmentConfig
from lgvit.data.stream import StreamingLoader, make_loader, random_resized_box


def _tree(root, n=6, size=(50, 40)):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("ant", "bee", "cat"):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), np.uint8)).save(
                    d / f"{i}.png"
                )


def test_auto_streams_only_when_too_big(tmp_path, monkeypatch):
    _tree(tmp_path / "d")
    small = load_dataset("imagefolder", str(tmp_path / "d"), img_size=16, cache_dir=tmp_path / "c")
    assert isinstance(small.train, ImageSet)  # tiny: decoded once into the cache
    monkeypatch.setattr("lgvit.data.datasets.STREAM_ABOVE_BYTES", 1000)
    big = load_dataset("imagefolder", str(tmp_path / "d"), img_size=16, cache_dir=tmp_path / "c")
    assert isinstance(big.train, FileImageSet) and len(big.train) == 18 and len(big.test) == 18
    assert big.train.classes == ["ant", "bee", "cat"]


def test_streaming_batches_reproducible_and_shaped(tmp_path):
    _tree(tmp_path / "d")
    splits = load_dataset("imagefolder", str(tmp_path / "d"), img_size=16, stream=True)
    aug = AugmentConfig(img_size=16, train_crop="random_resized_crop", rand_augment=None,
                        mixup=0.0, cutmix=0.0, label_smoothing=0.0, reprob=0.0)  # fmt: skip
    mk = lambda: make_loader(splits.train, 4, num_classes=3, train=True, aug=aug, workers=1)  # noqa: E731
    a, b = mk(), mk()
    assert isinstance(a, StreamingLoader) and len(a) == 4
    xa, ya = zip(*list(a), strict=True)
    xb, yb = zip(*list(b), strict=True)
    assert all(torch.equal(p, q) for p, q in zip(xa, xb, strict=True))
    assert all(x.shape == (4, 3, 16, 16) for x in xa)
    a.set_epoch(1)
    assert not torch.equal(next(iter(a))[0], xa[0])  # another epoch, other crops
    ev = make_loader(splits.test, 5, num_classes=3, train=False, aug=aug, workers=0)
    labels = torch.cat([y for _, y in ev])
    assert torch.equal(labels, splits.test.labels)  # eval: every image once, in order


def test_random_resized_box_in_bounds():
    rng = random.Random(0)
    for _ in range(200):
        left, top, right, bottom = random_resized_box(50, 40, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= left < right <= 50 and 0 <= top < bottom <= 40
        ratio = (right - left) / (bottom - top)
        assert 0.6 < ratio < 1.6


def test_unreadable_files_dropped_then_threshold(tmp_path):
    _tree(tmp_path / "d", n=40)
    (tmp_path / "d" / "train" / "ant" / "0.png").write_bytes(b"")
    splits = load_dataset("imagefolder", str(tmp_path / "d"), img_size=16, stream=True)
    aug = AugmentConfig(img_size=16, rand_augment=None, mixup=0.0, cutmix=0.0)
    ld = make_loader(splits.train, 8, num_classes=3, train=True, aug=aug, workers=0)
    n = sum(len(y) for _, y in ld)
    assert ld.bad == 1 and n == ld.seen - 1
    for i in range(1, 12):
        (tmp_path / "d" / "train" / "bee" / f"{i}.png").write_bytes(b"junk")
    ld = make_loader(splits.train, 8, num_classes=3, train=True, aug=aug, workers=0)
    with pytest.raises(LgvitError, match="unreadable"):
        list(ld)


def test_train_cli_streaming(tmp_path):
    _tree(tmp_path / "d")
    run = tmp_path / "r"
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", "--model", "lsa_micro_cifar", "--img-size", "16",
         "--data", "imagefolder", "--data-dir", str(tmp_path / "d"), "--epochs", "1",
         "--batch-size", "6", "--out", str(run), "--set", "stream=true", "--set", "workers=1",
         "--set", "train_crop=random_resized_crop", "--set", f"cache_dir={tmp_path / 'c'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["epoch"] == 0 and 0 <= row["test_acc1"] <= 100
