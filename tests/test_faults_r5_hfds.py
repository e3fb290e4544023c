"""Faults and bad input, round five: Hugging Face datasets on disk (``--data hfds``). Every
integer label type reads as written (a non-integer one is one line), a label that would size the
head past ``MAX_CLASSES`` is refused naming its row, splits whose ``ClassLabel`` names differ are
refused (training and ``lgvit eval``), and a folder holding one saved ``Dataset`` is the split
``lgvit eval`` reads, and one line for ``lgvit train``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_hfds import CLASSES, hf_cache, splits_of, toy  # noqa: F401 (hf_cache: autouse)
from test_train import FAST

from lgvit.cli import main
from lgvit.core.constants import MAX_CLASSES
from lgvit.core.errors import LgvitError

datasets = pytest.importorskip("datasets")

from datasets.table import InMemoryTable  # noqa: E402

INT_TYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    """No progress bars on stderr, where the tests read the command's error line."""
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def _save(folder: Path, train, validation) -> Path:
    datasets.DatasetDict(train=train, validation=validation).save_to_disk(str(folder))
    return folder


def with_labels(n: int, labels: list, dtype: str, start: int = 0):
    """``toy(n)`` whose label column is ``labels`` as that arrow type, built by pyarrow (the
    ``datasets`` writer cannot take a uint64 above the int64 range)."""
    pa = pytest.importorskip("pyarrow")
    table = toy(n, start=start, labels=[0] * n, label_feature=datasets.Value(dtype)).data.table
    column = pa.array(labels, getattr(pa, dtype)())
    return datasets.Dataset(InMemoryTable(table.set_column(1, "label", column)))


def _train(data_dir: Path, out: Path, *extra: str) -> int:
    return main(["train", *FAST, "--batch-size", "4", "--data", "hfds", "--data-dir",
                 str(data_dir), "--epochs", "1", "--out", str(out), "--set", "workers=0",
                 *extra])  # fmt: skip


def _eval(checkpoint: Path, data_dir: Path, *extra: str) -> int:
    return main(["eval", "--checkpoint", str(checkpoint), "--data", "hfds", "--data-dir",
                 str(data_dir), "--batch-size", "4", "-j", "0", *extra])  # fmt: skip


def _error(capsys: pytest.CaptureFixture, cmd: str) -> str:
    """The command's one error line (and that it is the only thing on stderr)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lgvit {cmd}: error: "), err
    return err[0].removeprefix(f"lgvit {cmd}: error: ")


# ------------------------------------------------------------------------ item 8: label types


@pytest.mark.parametrize("dtype", [*INT_TYPES, "ClassLabel"])
def test_every_integer_label_type_reads_as_written(tmp_path, dtype):
    feature = datasets.ClassLabel(names=CLASSES) if dtype == "ClassLabel" else datasets.Value(dtype)
    train = toy(6, labels=[0, 2, None, 1, 2, 0], label_feature=feature)
    d = _save(tmp_path / "d", train, toy(3, start=50, labels=[2, 1, 0], label_feature=feature))
    sp = splits_of(d, max_bad_fraction=0.5)
    assert sp.skipped == ["train[2]: no label"]
    assert sp.train.labels.dtype == torch.int64 and sp.train.labels.tolist() == [0, 2, 1, 2, 0]
    assert [sp.train.name(i) for i in range(5)] == [f"train[{r}]" for r in (0, 1, 3, 4, 5)]
    assert sp.test.labels.tolist() == [2, 1, 0]
    assert sp.train.classes == (CLASSES if dtype == "ClassLabel" else ["0", "1", "2"])


@pytest.mark.parametrize("dtype", ["int8", "uint64"])
def test_extreme_labels_of_a_type_are_named_exactly(tmp_path, dtype):
    """The type's extremes left out as what they are (not wrapped, not saturated)."""
    extreme = -128 if dtype == "int8" else 2**64 - 1
    train = toy(6, labels=[0, 1, 2, 0, 1, 2], label_feature=datasets.Value(dtype))
    val = with_labels(4, [2, extreme, 1, 0], dtype, start=50)
    sp = splits_of(_save(tmp_path / "d", train, val), max_bad_fraction=0.5)
    assert sp.skipped == [f"validation[1]: label {extreme} outside 0..2"]
    assert sp.test.labels.tolist() == [2, 1, 0]


def test_uint8_labels_train_and_evaluate_through_the_cli(tmp_path, capsys):
    u8 = datasets.Value("uint8")
    train = toy(8, labels=[i % 3 for i in range(8)], label_feature=u8)
    d = _save(tmp_path / "d", train, toy(4, start=50, labels=[2, 1, 0, 2], label_feature=u8))
    assert _train(d, tmp_path / "run") == 0
    assert "8 train / 4 test images, 3 classes" in capsys.readouterr().out
    assert _eval(tmp_path / "run" / "last.safetensors", d) == 0
    assert "(4 test images)" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["string", "float32", "float64", "bool"])
def test_a_non_integer_label_column_is_one_line_naming_it_and_its_type(tmp_path, capsys, dtype):
    value = {"string": "cat", "float32": 1.0, "float64": 1.5, "bool": True}[dtype]
    feature = datasets.Value(dtype)
    d = _save(tmp_path / "d", toy(4, labels=[value] * 4, label_feature=feature),
              toy(2, labels=[value] * 2, label_feature=feature))  # fmt: skip
    assert _train(d, tmp_path / "run") == 2
    assert _error(capsys, "train") == (f"hfds {d}: column 'label' of split train holds "
                                       f"{dtype}, not integer labels (--target-key)")  # fmt: skip
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ item 6: MAX_CLASSES


def _plain(n: int, labels: list, start: int = 0):
    return toy(n, start=start, labels=labels, label_feature=datasets.Value("int64"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run trained on ClassLabel [cat, dog, fox] (its checkpoint records those names)."""
    root = tmp_path_factory.mktemp("trained")
    names = datasets.ClassLabel(names=["cat", "dog", "fox"])
    d = _save(root / "d", toy(8, label_feature=names), toy(4, start=50, label_feature=names))
    assert _train(d, root / "run") == 0
    return root / "run" / "last.safetensors"


@pytest.mark.parametrize("label", [MAX_CLASSES, 10**12], ids=["max", "1e12"])
def test_a_label_past_max_classes_is_refused_naming_its_row(tmp_path, capsys, label):
    """Without a ClassLabel the head is sized by the largest label: 0..MAX_CLASSES - 1 is the
    most (before: a head of label + 1 classes, killed by memory at 10**12)."""
    d = _save(tmp_path / "d", _plain(6, [0, 1, 2, label, 1, 2]), _plain(3, [2, 1, 0], 50))
    assert _train(d, tmp_path / "run") == 2
    assert _error(capsys, "train") == (
        f"hfds {d}: label {label} of train[3] would make {label + 1} classes, more than "
        f"MAX_CLASSES ({MAX_CLASSES}; without a ClassLabel the classes are 0..the largest label)"
    )
    assert not (tmp_path / "run").exists()


def test_the_largest_labels_allowed_and_the_extremes_refused(tmp_path):
    top = MAX_CLASSES - 1
    sp = splits_of(_save(tmp_path / "ok", _plain(3, [0, top, 1]), _plain(2, [top, 0], 50)))
    assert len(sp.train.classes) == MAX_CLASSES and sp.test.labels.tolist() == [top, 0]
    huge = _save(tmp_path / "u64", with_labels(3, [0, 2**64 - 1, 1], "uint64"), _plain(2, [0, 1]))
    with pytest.raises(LgvitError, match=rf"^hfds {huge}: label {2**64 - 1} of train\[1\] would "
                       rf"make {2**64} classes, more than MAX_CLASSES"):  # fmt: skip
        splits_of(huge)
    declared = datasets.ClassLabel(num_classes=MAX_CLASSES + 1)
    wide = _save(tmp_path / "wide", toy(2, label_feature=declared), toy(2, label_feature=declared))
    with pytest.raises(LgvitError) as e:
        splits_of(wide)
    assert str(e.value) == (f"hfds {wide}: column 'label' of split train declares "
                            f"{MAX_CLASSES + 1} classes (ClassLabel), more than MAX_CLASSES "
                            f"({MAX_CLASSES})")  # fmt: skip


def test_eval_refuses_a_label_past_max_classes_naming_its_row(tmp_path, capsys, checkpoint):
    d = _save(tmp_path / "d", _plain(3, [0, 1, 2]), _plain(4, [2, 1, 10**12, 0], 50))
    assert _eval(checkpoint, d) == 2
    assert _error(capsys, "eval").startswith(
        f"hfds {d}: label {10**12} of validation[2] would make {10**12 + 1} classes"
    )


# ------------------------------------------------------------------------ item 3: class order


def _named(n: int, names: list[str], start: int = 0):
    return toy(n, start=start, label_feature=datasets.ClassLabel(names=names))


def test_splits_whose_class_labels_differ_are_refused(tmp_path, capsys):
    """Label 0 is cat in one split and fox in the other: trained, the top-1 would cross them
    (as imagefolder refuses train/ and val/ with different class folders)."""
    d = _save(tmp_path / "d", _named(6, ["cat", "dog", "fox"]), _named(3, ["fox", "dog", "cat"]))
    assert _train(d, tmp_path / "run") == 2
    assert _error(capsys, "train") == (
        f"hfds {d}: the ClassLabel classes of splits train and validation differ: train "
        "[cat, dog, fox], validation [fox, dog, cat]"
    )
    assert not (tmp_path / "run").exists()
    files = tmp_path / "parquet"  # the hub's form: each file's features in its metadata
    files.mkdir()
    for split, names in (("train", ["cat", "dog", "fox"]), ("validation", ["fox", "dog", "cat"])):
        _named(3, names).to_parquet(str(files / f"{split}-00000-of-00001.parquet"))
    with pytest.raises(LgvitError, match=r"differ: train \[cat, dog, fox\], validation \[fox, "
                       r"dog, cat\]$"):  # fmt: skip
        splits_of(files)
    many = [f"c{i:02d}" for i in range(30)]
    other = many[:17] + ["zebra"] + many[18:]
    d = _save(tmp_path / "many", _named(4, many), _named(2, other))
    with pytest.raises(LgvitError) as e:
        splits_of(d)
    assert str(e.value) == (f"hfds {d}: the ClassLabel classes of splits train and validation "
                            "differ: class 17 is 'c17' in train and 'zebra' in validation (30 "
                            "classes in each)")  # fmt: skip
    d = _save(tmp_path / "fewer", _named(4, many), _named(2, many[:25]))
    with pytest.raises(LgvitError, match=r"differ: class 25 is 'c25' in train and absent in "
                       r"validation \(30 and 25 classes\)$"):  # fmt: skip
        splits_of(d)
    # a split without a ClassLabel has numbered labels: read as the other split's classes
    d = _save(tmp_path / "plain", _named(6, ["cat", "dog", "fox"]), _plain(3, [2, 1, 0]))
    assert splits_of(d).test.classes == ["cat", "dog", "fox"]


def test_eval_refuses_data_whose_class_order_is_not_the_checkpoints(tmp_path, capsys, checkpoint):
    d = _save(tmp_path / "d", _named(3, ["cat", "dog", "fox"]), _named(3, ["fox", "dog", "cat"]))
    assert _eval(checkpoint, d) == 2
    assert _error(capsys, "eval") == (
        f"{checkpoint} was trained on classes [cat, dog, fox] but hfds has [fox, dog, cat]; pass "
        "--any-classes to evaluate anyway (class i of the data is then class i of the model)"
    )
    assert _eval(checkpoint, d, "--any-classes") == 0
    assert "(3 test images)" in capsys.readouterr().out


# ------------------------------------------------------------------------ item 14: one Dataset


@pytest.fixture
def one_split(tmp_path) -> Path:
    """A DatasetDict saved with save_to_disk: its ``validation`` folder holds one Dataset."""
    return _save(tmp_path / "saved", _named(6, ["cat", "dog", "fox"]),
                 _named(3, ["cat", "dog", "fox"], start=50)) / "validation"  # fmt: skip


def test_eval_reads_a_folder_holding_one_saved_dataset(tmp_path, capsys, checkpoint, one_split):
    pred = tmp_path / "p.csv"
    for extra in ([], ["--split", "validation"]):
        assert _eval(checkpoint, one_split, "--predictions", str(pred), *extra) == 0
        assert "(3 test images)" in capsys.readouterr().out
        rows = [line.split(",")[0] for line in pred.read_text().splitlines()[1:]]
        assert sorted(rows) == [f"validation[{i}]" for i in range(3)]  # the folder's name
    assert _eval(checkpoint, one_split, "--split", "test") == 2
    assert _error(capsys, "eval") == (
        f"hfds {one_split} holds one saved Dataset (split 'validation'), the split evaluated: "
        "--split 'test' names another (leave --split out)"
    )
    # a Dataset that records its split (load_dataset(..., split=...)) goes by that name
    rows = _named(2, ["cat", "dog", "fox"])
    named = datasets.Dataset.from_dict(rows.to_dict(), features=rows.features, split="test")
    named.save_to_disk(str(tmp_path / "mine"))
    assert _eval(checkpoint, tmp_path / "mine", "--predictions", str(pred)) == 0
    assert pred.read_text().splitlines()[1].startswith("test[")


def test_train_on_a_folder_holding_one_saved_dataset_says_what_to_give(tmp_path, capsys,
                                                                      one_split):  # fmt: skip
    assert _train(one_split, tmp_path / "run") == 2
    assert _error(capsys, "train") == (
        f"hfds {one_split} holds one saved Dataset (split 'validation'), not a DatasetDict with "
        f"train and validation splits: give --data-dir {one_split.parent}, the DatasetDict it "
        "is a split of"
    )
    toy(4).save_to_disk(str(tmp_path / "alone"))
    assert _train(tmp_path / "alone", tmp_path / "run", "--val-split", "alone") == 2
    assert _error(capsys, "train") == (
        f"hfds {tmp_path / 'alone'} holds one saved Dataset (split 'alone'), not a DatasetDict "
        "with train and validation splits: save both as one (DatasetDict(train=..., "
        "validation=...).save_to_disk) and give its folder"
    )
    assert not (tmp_path / "run").exists()


# ------------------------------------------- item 14: eval with classes from the largest label


def test_eval_without_a_class_label_accepts_a_wider_head(tmp_path, capsys):
    """Without a ClassLabel the split's classes are 0..its largest label: a bound from below, so
    a validation split that lacks the top class is no mismatch for a wider head (before: "has a
    3-class head but hfds has 2 classes"); a label beyond the head is still refused."""
    d = _save(tmp_path / "d", _plain(6, [0, 1, 2, 0, 1, 2]), _plain(3, [1, 0, 1], 50))
    assert _train(d, tmp_path / "run") == 0
    capsys.readouterr()
    ckpt = tmp_path / "run" / "last.safetensors"
    assert _eval(ckpt, d, "--json") == 0
    res = json.loads(capsys.readouterr().out)
    assert res["count"] == 3 and res["classes"] == ["0", "1", "2"]
    beyond = _save(tmp_path / "e", _plain(3, [0, 1, 2]), _plain(3, [1, 3, 0], 50))
    assert _eval(ckpt, beyond) == 2
    assert "3-class head" in _error(capsys, "eval")
