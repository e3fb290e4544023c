"""WebDataset shards (``--data wds``): every sample once per epoch over ranks and workers, exact
mid-epoch resume, bad data as one line each, and training and evaluation through the command
line (one rank, two ranks, two simulated nodes), on small shards built here."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_train import ENV, FAST, metrics

from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.data.loader import AugmentConfig

pytest.importorskip("webdataset")

from lgvit.data.wds import ShardLoader, wds_split, wds_splits  # noqa: E402

TRAIN_SIZES, VAL_SIZES = [7, 9, 4, 11, 6], [5, 6]  # counts that divide by nothing useful
CLASSES = 3


def _image(rng: np.random.Generator, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def toy_samples(split: str, shard: int, count: int, start: int) -> list:
    rng = np.random.default_rng(start)
    fmt = ("jpg", "JPEG") if shard % 2 == 0 else ("png", "PNG")  # the first key present wins
    return [(f"{split}{start + i:04d}", {fmt[0]: _image(rng, fmt[1]),
             "cls": str((start + i) % CLASSES).encode()}) for i in range(count)]  # fmt: skip


def write_split(root: Path, split: str, sizes: list[int], prefix: str = "toy") -> list[str]:
    names, start = [], 0
    for s, count in enumerate(sizes):
        names.append(f"{prefix}-{split}-{s:02d}.tar")
        write_shard(root / names[-1], toy_samples(split, s, count, start))
        start += count
    return names


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """``plain/``: shards only; ``info/``: the same with timm's ``_info.json`` (class names)."""
    root = tmp_path_factory.mktemp("wds")
    for folder in ("plain", "info"):
        (root / folder).mkdir()
        splits = {s: write_split(root / folder, s, n)
                  for s, n in (("train", TRAIN_SIZES), ("validation", VAL_SIZES))}  # fmt: skip
    info = {"name": "toy", "classes": ["cat", "dog", "emu"], "splits": {
        s: {"name": s, "num_samples": sum(n), "filenames": splits[s], "shard_lengths": n}
        for s, n in (("train", TRAIN_SIZES), ("validation", VAL_SIZES))}}  # fmt: skip
    (root / "info" / "_info.json").write_text(json.dumps(info))
    return root


def splits_of(data_dir: Path | str, cache: Path, **kw):
    args = dict(train_split=None, val_split=None, input_key=None, target_key=None)
    return wds_splits(str(data_dir), cache=cache, max_bad_fraction=0.05, **{**args, **kw})


def visits(split, batch: int, *, train: bool, world: int, workers: int, epoch: int = 0,
           seed: int = 0) -> list[list[int]]:  # fmt: skip
    """The canonical indices each rank's batches hold, in the order yielded."""
    out = []
    for rank in range(world):
        aug = AugmentConfig(img_size=8, mixup=0, cutmix=0)
        loader = ShardLoader(split, batch, workers=workers, num_classes=CLASSES, train=train,
                             seed=seed, rank=rank, world_size=world, with_index=not train,
                             aug=aug, shuffle=8)  # fmt: skip
        loader.set_epoch(epoch)
        seen: list[int] = []
        if train:  # what reaches the recipe: the batch's indices
            loader.recipe.train_batch = lambda x, y, gen, idx, seen=seen: seen.extend(idx.tolist())
            for _ in loader:
                pass
        else:
            for _, _, idx in loader:
                seen.extend(idx.tolist())
        assert len(loader) == -(-len(seen) // batch) or train
        out.append(seen)
    return out


# ------------------------------------------------------------------------------ the split


def test_every_sample_once_over_two_ranks_and_two_workers(shards, tmp_path):
    sp = splits_of(shards / "plain", tmp_path)
    n = sum(TRAIN_SIZES)
    assert len(sp.train) == n and sp.train.counts == TRAIN_SIZES
    # Eval: the ranks partition the split exactly, in its order.
    ranks = visits(sp.train, 4, train=False, world=2, workers=2)
    assert sorted(ranks[0] + ranks[1]) == list(range(n)) and ranks[0] == sorted(ranks[0])
    # Train: fewer than W repeats (the last range wraps) and fewer than B dropped per rank.
    for epoch in (0, 1):
        ranks = visits(sp.train, 4, train=True, world=2, workers=2, epoch=epoch)
        counts = Counter(ranks[0] + ranks[1])
        assert len(set(ranks[0]) & set(ranks[1])) < 2  # only a wrapped sample can repeat
        assert sum(c - 1 for c in counts.values()) < 2 and max(counts.values()) <= 2
        assert n - len(counts) < 2 * 4 and len(ranks[0]) == len(ranks[1]) == 4 * (19 // 4)
    # Seeded: the same seed gives the same order for any worker count; epochs and seeds differ.
    again = visits(sp.train, 4, train=True, world=2, workers=0, epoch=1)
    assert again == ranks
    assert visits(sp.train, 4, train=True, world=2, workers=2, epoch=0) != ranks
    assert visits(sp.train, 4, train=True, world=2, workers=1, epoch=1, seed=1) != ranks


def test_counts_and_classes_from_info_json_or_a_cached_header_scan(shards, tmp_path):
    sp = splits_of(shards / "info" / "_info.json", tmp_path / "a")
    assert sp.train.classes == ["cat", "dog", "emu"] == sp.test.classes
    assert not (tmp_path / "a").exists()  # _info.json had counts and names: nothing scanned
    assert sp.test.counts == VAL_SIZES and sp.test.name(5) == "toy-validation-01.tar/validation0005"
    plain = splits_of(shards / "plain", tmp_path / "b")
    assert plain.train.classes == ["0", "1", "2"]  # the largest label + 1, scanned
    assert len(list((tmp_path / "b" / "wds").iterdir())) == 2  # train and validation, cached
    pattern = str(shards / "plain" / "toy-train-{00..04}.tar")
    brace = splits_of(pattern, tmp_path / "b")
    assert brace.train.paths == plain.train.paths and brace.test.paths == plain.test.paths
    one = wds_split(str(shards / "plain"), split=None, input_key=None, target_key=None,
                    cache=tmp_path / "b")  # fmt: skip
    assert one.split == "validation" and len(one) == sum(VAL_SIZES)
    (tmp_path / "v").mkdir()  # shards whose validation split is called "val"
    write_split(tmp_path / "v", "train", [4])
    write_split(tmp_path / "v", "val", [3])
    assert splits_of(tmp_path / "v", tmp_path / "b").test.paths == [str(tmp_path / "v" /
                                                                     "toy-val-00.tar")]  # fmt: skip


def test_mid_epoch_resume_continues_bit_for_bit(shards, tmp_path):
    sp = splits_of(shards / "plain", tmp_path)
    aug = AugmentConfig(img_size=16, train_crop="random_resized_crop", reprob=0.25)

    def loader() -> ShardLoader:
        return ShardLoader(sp.train, 4, workers=2, num_classes=CLASSES, train=True, seed=3,
                           aug=aug, shuffle=8)  # fmt: skip

    full, states = loader(), []
    full.set_epoch(2)
    batches = []
    for x, y in full:
        batches.append((x, y))
        states.append(full.aug_state())
    resumed = loader()
    resumed.set_epoch(2, 3, states[2])  # after three batches
    rest = list(resumed)
    assert len(rest) == len(batches) - 3 > 0
    for (x, y), (x2, y2) in zip(batches[3:], rest, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


# ------------------------------------------------------------------------------ bad data


def _bad_folder(root: Path, case: str) -> tuple[Path, str]:
    """A folder whose train split has one bad sample of the kind ``case``."""
    root.mkdir()
    write_split(root, "validation", [3])
    good = toy_samples("train", 0, 6, 0)
    key, members = good[2]
    if case == "undecodable":
        members["jpg"] = b"not an image"
    elif case == "no label":
        del members["cls"]
    elif case == "label range":
        members["cls"] = b"7"
    write_shard(root / "toy-train-00.tar", good)
    expected = {"undecodable": "undecodable image", "no label": "no 'cls' label",
                "label range": "label 7 is outside [0, 3)"}  # fmt: skip
    return root, f"toy-train-00.tar sample train0002: {expected[case]}"


@pytest.mark.parametrize("case", ["undecodable", "no label", "label range"])
def test_a_bad_sample_is_counted_and_named(shards, tmp_path, case):
    root, line = _bad_folder(tmp_path / "d", case)
    sp = splits_of(root, tmp_path / "c")
    sp.train.classes = ["a", "b", "c"]
    kw = dict(num_classes=CLASSES, train=True, aug=AugmentConfig(img_size=8, mixup=0, cutmix=0))
    tolerant = ShardLoader(sp.train, 2, workers=0, max_bad_fraction=0.05, **kw)
    assert sum(len(y) for _, y in tolerant) == 5  # its batch is one smaller; 1 of 100 is fine
    assert tolerant.bad == 1 and line in tolerant.first_bad
    strict = ShardLoader(sp.train, 2, workers=0, max_bad_fraction=0.0, **kw)
    with pytest.raises(LgvitError, match=r"1 of the first \d+ samples of the 'train' shards "
                       "are bad") as e:  # fmt: skip
        list(strict)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_shard_counts_its_missing_samples_and_the_epoch_goes_on(shards, tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    for name in os.listdir(shards / "info"):
        (root / name).write_bytes((shards / "info" / name).read_bytes())
    cut = root / "toy-train-03.tar"  # 11 samples; about half of it left
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    sp = splits_of(root, tmp_path / "c")
    loader = ShardLoader(sp.train, 37, workers=2, num_classes=CLASSES, train=False,
                         max_bad_fraction=1.0, aug=AugmentConfig(img_size=8))  # fmt: skip
    got = sum(len(y) for _, y in loader)
    assert 0 < loader.bad < 11 and got == 37 - loader.bad and loader.seen == 37
    assert "toy-train-03.tar" in loader.first_bad and "truncated shard" in loader.first_bad


def test_missing_shards_keys_and_package_are_one_line(shards, tmp_path, monkeypatch):
    root = tmp_path / "m"
    root.mkdir()
    info = json.loads((shards / "info" / "_info.json").read_text())
    (root / "_info.json").write_text(json.dumps(info))
    with pytest.raises(LgvitError, match=r"shard .*toy-train-00.tar of the 'train' split does "
                       "not exist"):  # fmt: skip
        splits_of(root, tmp_path / "c")
    with pytest.raises(LgvitError, match=r"shard .*toy-train-05.tar \(of .*\) does not exist"):
        splits_of(str(shards / "plain" / "toy-train-{00..05}.tar"), tmp_path / "c")
    with pytest.raises(LgvitError, match="has no split 'test' with filenames"):
        splits_of(shards / "info", tmp_path / "c", val_split="test")
    sp = splits_of(shards / "plain", tmp_path / "c", input_key="webp")
    strict = ShardLoader(sp.train, 4, workers=0, num_classes=CLASSES, train=True,
                         max_bad_fraction=0.0, aug=AugmentConfig(img_size=8))  # fmt: skip
    with pytest.raises(LgvitError, match=r"sample train\d+: no image \(webp; --input-key\)"):
        list(strict)
    monkeypatch.setitem(sys.modules, "webdataset", None)
    with pytest.raises(LgvitError, match=r"--data wds needs the webdataset package: pip "
                       r"install 'lgvit\[wds\]'"):  # fmt: skip
        splits_of(shards / "plain", tmp_path / "c")


# ------------------------------------------------------------------------------ the command line


def test_train_and_eval_through_the_cli(shards, tmp_path, capsys):
    run = tmp_path / "run"
    data = ["--data", "wds", "--set", f"cache_dir={tmp_path / 'cache'}"]
    assert main(["train", *FAST, "--batch-size", "8", *data, "--data-dir",
                 str(shards / "info" / "_info.json"), "--epochs", "1", "--out", str(run),
                 "--set", "workers=2"]) == 0  # fmt: skip
    assert "37 train / 11 test images, 3 classes" in capsys.readouterr().out
    assert len(metrics(run)) == 1
    pattern = str(shards / "info" / "toy-train-{00..04}.tar")  # no info: found by the pattern
    assert main(["train", *FAST, "--batch-size", "8", *data, "--data-dir", pattern,
                 "--iters", "2", "--out", str(tmp_path / "brace")]) == 0  # fmt: skip
    capsys.readouterr()
    pred = tmp_path / "p.csv"
    data = ["--data", "wds", "--cache-dir", str(tmp_path / "cache")]
    assert main(["eval", "--checkpoint", str(run / "last.safetensors"), *data, "--data-dir",
                 str(shards / "info"), "--predictions", str(pred), "--json"]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["images"] == res["count"] == 11 and res["classes"] == ["cat", "dog", "emu"]
    names = [line.split(",")[0] for line in pred.read_text().splitlines()[1:]]
    assert sorted(names) == sorted(f"toy-validation-{s:02d}.tar/validation{i:04d}"
                                   for s, i in [(0, i) for i in range(5)] + [(1, i)
                                                for i in range(5, 11)])  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Records the samples each rank hands the recipe, by name, then runs the command line.
LAUNCHER = """
import os, sys
from lgvit.data import wds
from lgvit.cli import main
plain = wds.ShardLoader.__iter__
def recording(self):
    out = os.path.join(os.environ["KEYS_DIR"], f"rank{self.recipe.rank}-{self.split.split}")
    train_batch = self.recipe.train_batch
    def record(x, y, gen, idx):
        with open(out, "a") as f:
            f.writelines(self.split.name(i) + "\\n" for i in idx.tolist())
        return train_batch(x, y, gen, idx)
    self.recipe.train_batch = record
    return plain(self)
wds.ShardLoader.__iter__ = recording
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("nodes", [1, 2])
def test_two_ranks_read_disjoint_samples(shards, tmp_path, nodes):
    """Two processes on one node, or two single-process nodes (two torchrun launches joined by
    a c10d rendezvous on 127.0.0.1): each rank's samples of the epoch, disjoint."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    env = {**ENV, "KEYS_DIR": str(tmp_path)}
    args = [str(launcher), "train", *FAST, "--batch-size", "8", "--data", "wds", "--data-dir",
            str(shards / "plain"), "--set", f"cache_dir={tmp_path / 'cache'}", "--epochs", "1",
            "--set", "workers=1", "--out", str(tmp_path / "run")]  # fmt: skip
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        procs = [subprocess.Popen([*run, "--standalone", "--nproc_per_node", "2", *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)]  # fmt: skip
    else:
        rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "wds"]  # fmt: skip
        procs = [subprocess.Popen([*run, *rdzv, "--node-rank", str(i), *args], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    assert "2 process(es)" in "".join(out for out, _ in outs)
    keys = [(tmp_path / f"rank{r}-train").read_text().split() for r in range(2)]
    assert len(keys[0]) == len(keys[1]) == 16  # ceil(37 / 2) = 19 each, 3 dropped
    assert set(keys[0]).isdisjoint(keys[1]) and len(set(keys[0] + keys[1])) == 32
