"""Faults and bad input, round five: WebDataset shards. ``_info.json``'s counts are checked
against the shards as they are read, its fields' types and shapes on reading, labels are ASCII
digits, a class count is bounded by ``MAX_CLASSES``, a lone shard path finds its validation
siblings, ``repeated_aug`` is ignored with a warning (as documented), an evaluation without
declared classes accepts a wider head, and the messages say what is wrong with shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_faults_r4_run import _one_line as one_line
from test_train import FAST
from test_wds import _image, write_shard, write_split

import lgvit
from lgvit.cli import main
from lgvit.core.constants import MAX_CLASSES
from lgvit.data.loader import AugmentConfig

pytest.importorskip("webdataset")

from lgvit.data.wds import ShardLoader, _Bad, _Cursor, _parse_label, wds_splits  # noqa: E402


def labelled(split: str, labels: list, start: int = 0) -> list:
    """Samples whose ``cls`` members are ``labels`` (an int, or the raw bytes)."""
    rng = np.random.default_rng(start)
    return [(f"{split}{start + i:04d}", {"jpg": _image(rng, "JPEG"),
             "cls": label if isinstance(label, bytes) else str(label).encode()})
            for i, label in enumerate(labels)]  # fmt: skip


def shard_folder(root: Path, train: list[int], val: list[int], **info: object) -> Path:
    """Toy shards (labels ``i % 3``); with ``info`` given, an ``_info.json`` declaring the real
    counts and class names, its keys overridden (a split's keys as ``train.<key>``)."""
    root.mkdir(parents=True)
    names = {"train": write_split(root, "train", train),
             "validation": write_split(root, "validation", val)}  # fmt: skip
    if info:
        doc: dict = {"classes": ["cat", "dog", "emu"], "splits": {
            s: {"num_samples": sum(n), "filenames": names[s], "shard_lengths": n}
            for s, n in (("train", train), ("validation", val))}}  # fmt: skip
        for key, value in info.items():
            split, _, field = key.rpartition(".")
            splits = doc["splits"]
            target = splits[split] if split in splits else splits if split == "splits" else doc
            target[field] = value
        (root / "_info.json").write_text(json.dumps(doc))
    return root


def train(root: Path | str, tmp_path: Path, *extra: str) -> list[str]:
    return ["train", *FAST, "--batch-size", "8", "--data", "wds", "--data-dir", str(root),
            "--set", f"cache_dir={tmp_path / 'cache'}", "--iters", "2", "--set", "workers=1",
            "--set", "warmup_epochs=0",
            "--out", str(tmp_path / "run"), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weights 3-class classifier (no run)."""
    path = tmp_path_factory.mktemp("ckpt") / "cls.pth"
    torch.manual_seed(0)
    torch.save(lgvit.create_model("lsa_micro_cifar", num_classes=3, img_size=16).state_dict(),
               path)  # fmt: skip
    return path


def evaluate(ckpt: Path, root: Path | str, tmp_path: Path, *extra: str) -> list[str]:
    return ["eval", "--checkpoint", str(ckpt), "--model", "lsa_micro_cifar", "--img-size", "16",
            "--data", "wds", "--data-dir", str(root), "--cache-dir", str(tmp_path / "cache"),
            "-j", "1", *extra]  # fmt: skip


# ----------------------------------------- item 2: _info.json's counts against the shards


def test_shard_lengths_shorter_than_the_shards_are_refused_when_read(tmp_path, capsys):
    root = shard_folder(tmp_path / "d", [12, 12, 12], [5], **{"train.shard_lengths": [4, 4, 4],
                        "train.num_samples": 12})  # fmt: skip
    code = main(train(root, tmp_path))
    line = one_line(capsys, code, "toy-train-0", ".tar holds 12 samples but",
                    "_info.json declares 4 (splits.train.shard_lengths[")  # fmt: skip
    assert "truncated" not in line
    assert not (tmp_path / "run" / "last.safetensors").exists()


def test_an_evaluation_reads_the_whole_shard_or_says_why_not(tmp_path, capsys, ckpt):
    root = shard_folder(tmp_path / "d", [6], [5], **{"validation.shard_lengths": [3],
                        "validation.num_samples": 3})  # fmt: skip
    code = main(evaluate(ckpt, root, tmp_path))
    one_line(capsys, code, "toy-validation-00.tar holds 5 samples but", "declares 3")


def test_shard_lengths_longer_than_a_whole_shard_name_both_counts(tmp_path, capsys, ckpt):
    root = shard_folder(tmp_path / "d", [6], [5], **{"validation.shard_lengths": [8],
                        "validation.num_samples": 8})  # fmt: skip
    code = main(evaluate(ckpt, root, tmp_path))
    line = one_line(capsys, code, "toy-validation-00.tar holds 5 samples",
                    "_info.json declares 8 (splits.validation.shard_lengths[0])")  # fmt: skip
    assert "truncated" not in line


def test_num_samples_must_agree_with_the_shards(tmp_path, capsys):
    root = shard_folder(tmp_path / "d", [12, 12, 12], [5], **{"train.num_samples": 5000})
    code = main(train(root, tmp_path))
    one_line(capsys, code, "_info.json", "splits.train.num_samples", "5000", "36")
    # Without shard_lengths the shards are counted: the count must still agree.
    root = shard_folder(tmp_path / "e", [12, 12, 12], [5], **{"train.num_samples": 5000,
                        "train.shard_lengths": None})  # fmt: skip
    code = main(train(root, tmp_path))
    one_line(capsys, code, "splits.train.num_samples", "5000", "36")


# -------------------------------------------------------------- item 5: ASCII digits only


@pytest.mark.parametrize(("raw", "value"), [(b"7", 7), (b" 12\n", 12), (b"0", 0), (b"1_0", None),
                         ("٢".encode(), None), (b"-1", None), (b"+1", None), (b"1.0", None),
                         (b"", None), (b"\xff", None)])  # fmt: skip
def test_a_label_is_ascii_decimal_digits(raw, value):
    assert _parse_label(raw) == value


def test_an_underscored_label_is_a_bad_sample_not_class_ten(tmp_path, capsys):
    root = tmp_path / "d"
    root.mkdir()
    write_shard(root / "toy-train-00.tar", labelled("train", [0, 1, 2, 0, b"1_0", 1, 2, 0, 1]))
    write_split(root, "validation", [3])
    assert main(train(root, tmp_path, "--set", "max_bad_fraction=0.5")) == 0
    assert "3 classes" in capsys.readouterr().out
    sp = wds_splits(str(root), train_split=None, val_split=None, input_key=None,
                    target_key=None, cache=tmp_path / "c", max_bad_fraction=0.5)  # fmt: skip
    loader = ShardLoader(sp.train, 9, workers=0, num_classes=3, train=False,
                         max_bad_fraction=1.0, aug=AugmentConfig(img_size=8))  # fmt: skip
    assert sum(len(y) for _, y in loader) == 8 and loader.bad == 1
    assert "sample train0004: label b'1_0' is not an integer" in loader.first_bad


# ---------------------------------------------------------- item 6: the class count's bound


@pytest.mark.parametrize("label", [b"999999999", b"1" * 63, str(MAX_CLASSES).encode()])
def test_a_huge_label_is_one_line_naming_the_sample(tmp_path, capsys, ckpt, label):
    root = tmp_path / "d"
    root.mkdir()
    write_shard(root / "toy-train-00.tar", labelled("train", [0, 1, label, 2]))
    write_shard(root / "toy-validation-00.tar", labelled("validation", [0, 1, label]))
    code = main(train(root, tmp_path))
    one_line(capsys, code, "toy-train-00.tar sample train0002: label", f"{MAX_CLASSES:,}")
    code = main(evaluate(ckpt, root, tmp_path))
    one_line(capsys, code, "toy-validation-00.tar sample validation0002: label")


def test_a_declared_class_count_is_bounded(tmp_path, capsys):
    root = shard_folder(tmp_path / "d", [8], [3], classes=None, num_classes=10**9)
    code = main(train(root, tmp_path))
    one_line(capsys, code, "_info.json", "num_classes", "1000000000", f"{MAX_CLASSES:,}")


# ------------------------------------------------------------ item 7: _info.json's fields


@pytest.mark.parametrize(("override", "key"), [
    ({"train.filenames": [1, 2, 3]}, "splits.train.filenames[0]"),
    ({"train.filenames": [], "train.shard_lengths": []}, "splits.train.filenames"),
    ({"train.filenames": "toy-train-00.tar"}, "splits.train.filenames"),
    ({"train.shard_lengths": [8, True]}, "splits.train.shard_lengths"),
    ({"train.shard_lengths": [8]}, "splits.train.shard_lengths"),
    ({"train.num_samples": "16"}, "splits.train.num_samples"),
    ({"validation.num_samples": -1}, "splits.validation.num_samples"),
    ({"classes": "cat"}, "classes"),
    ({"classes": ["cat", 2, "emu"]}, "classes[1]"),
    ({"classes": None, "num_classes": 2.5}, "num_classes"),
    ({"classes": None, "num_classes": 0}, "num_classes"),
    ({"classes": ["cat", "dog"], "num_classes": 3}, "num_classes"),
    ({"splits": [1]}, "splits"),
    ({"splits.validation": [1]}, "splits.validation"),
])  # fmt: skip
def test_every_info_field_is_checked_in_one_line(tmp_path, capsys, override, key):
    root = shard_folder(tmp_path / "d", [8, 8], [3], **override)
    code = main(train(root, tmp_path))
    one_line(capsys, code, str(root / "_info.json"), key)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["classes", "class_names", "label_names"])
def test_duplicate_class_names_are_refused(tmp_path, capsys, key):
    root = shard_folder(tmp_path / "d", [8], [3], **{"classes": None, key: ["a", "a", "b"]})
    code = main(train(root, tmp_path))
    one_line(capsys, code, str(root / "_info.json"), key, "'a'", "twice")


# ------------------------------------------------------------------- item 14: the messages


def test_a_resume_after_the_shards_lost_a_class_gives_shard_advice(tmp_path, capsys):
    root = tmp_path / "d"
    root.mkdir()
    write_shard(root / "toy-train-00.tar", labelled("train", [0, 1, 2, 0, 1, 2, 0, 1]))
    write_split(root, "validation", [3])
    args = train(root, tmp_path)
    args[args.index("--iters") : args.index("--iters") + 2] = ["--epochs", "1"]
    assert main(args) == 0
    write_shard(root / "toy-train-00.tar", labelled("train", [0, 1, 0, 0, 1, 1, 0, 1]))
    capsys.readouterr()
    code = main(["train", "--out", str(tmp_path / "run"), "--resume", "auto", "--epochs", "2"])
    line = one_line(capsys, code, "3 classes then, 2 now", "largest label", "--initial-checkpoint")
    assert "folders" not in line


def test_a_truncated_shard_names_its_samples_once(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    write_split(root, "train", [24])
    write_split(root, "validation", [3])
    cut = root / "toy-train-00.tar"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    sp = wds_splits(str(root), train_split=None, val_split=None, input_key=None,
                    target_key=None, cache=tmp_path / "c", max_bad_fraction=1.0)  # fmt: skip
    sp.train.counts[0] = 24  # as _info.json declared: the shard was cut after it was listed
    sp.train.offsets[-1] = 24
    loader = ShardLoader(sp.train, 24, workers=0, num_classes=3, train=False,
                         max_bad_fraction=1.0, aug=AugmentConfig(img_size=8))  # fmt: skip
    list(loader)
    assert loader.bad > 1 and "sample sample" not in loader.first_bad
    assert "toy-train-00.tar sample #" in loader.first_bad
    # The samples after the break: one message, true for each of them (it named the first).
    cursor, lines = _Cursor(), set()
    for j in (20, 22, 23):
        with pytest.raises(_Bad) as e:
            cursor.read(str(cut), j, 24, {"cls"})
        lines.add(str(e.value))
    assert len(lines) == 1 and "truncated shard: the file breaks off after" in lines.pop()


def test_repeated_aug_is_ignored_for_shards_with_a_warning(tmp_path, capsys):
    root = shard_folder(tmp_path / "d", [8, 8], [3])
    assert main(train(root, tmp_path, "--set", "repeated_aug=3")) == 0
    err = capsys.readouterr().err
    assert "warning: repeated_aug" in err and "does not apply to --data wds" in err
    assert err.count("repeated_aug") == 1


def test_a_lone_shard_path_finds_its_validation_siblings(tmp_path, capsys):
    root = tmp_path / "d"
    root.mkdir()
    for i, n in enumerate((8, 8)):
        write_shard(root / f"ds-train-{i:04d}.tar", labelled("train", [j % 3 for j in range(n)]))
    write_shard(root / "ds-validation-0000.tar", labelled("validation", [0, 1, 2]))
    assert main(train(root / "ds-train-0001.tar", tmp_path)) == 0
    assert "8 train / 3 test images" in capsys.readouterr().out
    (root / "ds-validation-0000.tar").unlink()
    code = main(train(root / "ds-train-0001.tar", tmp_path, "--out", str(tmp_path / "r2")))
    one_line(capsys, code, "ds-validation-0001.tar", "ds-validation-*.tar")


def test_eval_without_declared_classes_accepts_a_wider_head(tmp_path, capsys, ckpt):
    root = tmp_path / "d"
    root.mkdir()
    write_shard(root / "toy-validation-00.tar", labelled("validation", [0, 1, 1, 0]))
    assert main(evaluate(ckpt, root, tmp_path, "--json")) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["count"] == 4 and res["classes"] == ["0", "1", "2"]
    # A label beyond the head is still refused.
    write_shard(root / "toy-validation-00.tar", labelled("validation", [0, 1, 3, 0]))
    code = main(evaluate(ckpt, root, tmp_path))
    one_line(capsys, code, "3-class head", "4 classes")
