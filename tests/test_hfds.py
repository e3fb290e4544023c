"""Hugging Face datasets on disk (``--data hfds``): the rows read as written (saved with
``save_to_disk``, parquet and arrow files named by split), sharded over ranks, training and
evaluation through the command line (one rank, two ranks), and bad data as one line each, on
small datasets built here."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_train import ENV, FAST, metrics

from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.data.decode import load_rgb
from lgvit.data.loader import AugmentConfig
from lgvit.data.stream import StreamingLoader

datasets = pytest.importorskip("datasets")

from lgvit.data.hfds import hfds_split, hfds_splits  # noqa: E402

CLASSES = ["cat", "dog", "emu"]
N_TRAIN, N_VAL = 40, 12


TURNED = 5  # this row's JPEG is stored sideways (32x24), upright by its EXIF (24x32)


def _encoded(i: int) -> bytes:
    """Row i's image: noise, JPEG on even rows and PNG on odd ones, of two sizes."""
    rng = np.random.default_rng(i)
    size = (24, 32) if i % 3 else (32, 20)
    img, buf = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)), io.BytesIO()
    if i == TURNED:
        exif = Image.Exif()
        exif[0x0112] = 6  # EXIF orientation: turned by 90 degrees
        img.save(buf, "JPEG", exif=exif)
    else:
        img.save(buf, "JPEG" if i % 2 == 0 else "PNG")
    return buf.getvalue()


def toy(n: int, start: int = 0, labels: list | None = None, label_feature=None):
    label = label_feature or datasets.ClassLabel(names=CLASSES)
    features = datasets.Features({"image": datasets.Image(), "label": label})
    labels = labels if labels is not None else [(start + i) % 3 for i in range(n)]
    rows = {"image": [{"bytes": _encoded(start + i), "path": None} for i in range(n)],
            "label": labels}  # fmt: skip
    return datasets.Dataset.from_dict(rows, features=features)


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory):
    """datasets' cache (where parquet is converted) in the test's folder, not the user's."""
    cache = tmp_path_factory.mktemp("hf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, Path]:
    """The same train (40 rows) and validation (12 rows) splits saved with ``save_to_disk``,
    as the hub's parquet files (``data/train-0000x-of-00002.parquet``) and as arrow files
    (the validation split's named ``val``)."""
    root = tmp_path_factory.mktemp("hfds")
    train, val = toy(N_TRAIN), toy(N_VAL, start=1000)
    datasets.DatasetDict(train=train, validation=val).save_to_disk(str(root / "saved"))
    (root / "parquet" / "data").mkdir(parents=True)
    for i in range(2):
        part = train.shard(2, i, contiguous=True)
        part.to_parquet(str(root / "parquet" / "data" / f"train-{i:05d}-of-00002.parquet"))
    val.to_parquet(str(root / "parquet" / "data" / "validation-00000-of-00001.parquet"))
    (root / "arrow").mkdir()
    for split, name in (("train", "train"), ("validation", "val")):
        arrow = next((root / "saved" / split).glob("*.arrow"))
        shutil.copy(arrow, root / "arrow" / f"{name}-00000-of-00001.arrow")
    return {form: root / form for form in ("saved", "parquet", "arrow")}


def splits_of(data_dir: Path | str, **kw):
    args = dict(train_split=None, val_split=None, input_key=None, target_key=None,
                max_bad_fraction=0.05)  # fmt: skip
    return hfds_splits(str(data_dir), **{**args, **kw})


# ------------------------------------------------------------------------------ the split


@pytest.mark.parametrize("form", ["saved", "parquet", "arrow"])
def test_the_rows_read_are_the_rows_written(forms, form):
    sp = splits_of(forms[form])
    assert sp.name == "hfds" and sp.skipped == [] and sp.train.classes == CLASSES
    for split, n, start in ((sp.train, N_TRAIN, 0), (sp.test, N_VAL, 1000)):
        assert len(split) == n and split.classes == CLASSES
        assert split.labels.dtype == torch.int64
        assert split.labels.tolist() == [(start + i) % 3 for i in range(n)]
        for i in range(n):  # lgvit's decode of the bytes written, pixel for pixel
            want = np.asarray(load_rgb(_encoded(start + i)))
            assert np.array_equal(np.asarray(split.open(i)), want), (form, split.split, i)
    assert sp.test.name(3) == "validation[3]"
    # decoded by lgvit, not by datasets' PIL path: upright by EXIF, decompression bombs refused
    with Image.open(io.BytesIO(_encoded(TURNED))) as stored:
        assert stored.size == (32, 24) and sp.train.open(TURNED).size == (24, 32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Image, "MAX_IMAGE_PIXELS", 100)
        with pytest.raises(Exception, match="decompression bomb"):
            sp.train.open(0)
    # the workers get the split by pickle: the memory-mapped table travels as its file paths
    written = sum(len(_encoded(i)) for i in range(N_TRAIN))
    assert len(pickle.dumps(sp.train)) < written / 10


def test_arrow_files_in_the_ipc_file_format_are_read_too(forms, tmp_path):
    pa = pytest.importorskip("pyarrow")
    for split in ("train", "validation"):
        table = datasets.Dataset.from_file(str(next((forms["saved"] / split).glob("*.arrow"))))
        with pa.ipc.new_file(str(tmp_path / f"{split}-00000-of-00001.arrow"),
                             table.data.schema) as out:  # fmt: skip
            out.write_table(table.data.table)
    sp = splits_of(tmp_path)
    assert (len(sp.train), len(sp.test), sp.test.classes) == (N_TRAIN, N_VAL, CLASSES)
    want = np.asarray(load_rgb(_encoded(1000 + 7)))
    assert np.array_equal(np.asarray(sp.test.open(7)), want)


def test_classes_from_the_largest_label_without_a_class_label_feature(tmp_path):
    plain = datasets.Value("int64")
    datasets.DatasetDict(train=toy(6, labels=[0, 4, 1, 4, 2, 0], label_feature=plain),
                         validation=toy(3, labels=[4, 0, 1], label_feature=plain)
                         ).save_to_disk(str(tmp_path / "d"))  # fmt: skip
    sp = splits_of(tmp_path / "d")
    assert sp.train.classes == sp.test.classes == ["0", "1", "2", "3", "4"]
    assert sp.test.labels.tolist() == [4, 0, 1]


def test_val_or_test_is_the_evaluation_split_when_there_is_no_validation(tmp_path):
    datasets.DatasetDict(train=toy(4), test=toy(3, start=50)).save_to_disk(str(tmp_path / "d"))
    with pytest.warns(UserWarning, match=r"no 'validation' split: evaluating on 'test'"):
        sp = splits_of(tmp_path / "d")
    assert len(sp.test) == 3 and sp.test.name(0) == "test[0]"


@pytest.mark.parametrize("train", [True, False])
def test_two_ranks_read_disjoint_rows_that_cover_the_split(forms, train):
    split = splits_of(forms["parquet"]).train
    seen = []
    for rank in range(2):
        loader = StreamingLoader(split, 8, workers=2 * rank, num_classes=3, train=train,
                                 rank=rank, world_size=2, with_index=not train,
                                 aug=AugmentConfig(img_size=16, mixup=0, cutmix=0))  # fmt: skip
        loader.set_epoch(1)
        names: list[str] = []
        if train:  # what reaches the recipe: the batch's rows
            loader.recipe.train_batch = lambda x, y, g, idx, out=names: out.extend(
                split.name(i) for i in idx.tolist()
            )
            list(loader)
        else:
            for x, y, idx in loader:
                assert x.shape[1:] == (3, 16, 16) and y.tolist() == split.labels[idx].tolist()
                names.extend(split.name(i) for i in idx.tolist())
        assert loader.bad == 0
        seen.append(names)
    assert len(seen[0]) == len(seen[1]) == (16 if train else 20)  # train: whole batches only
    assert set(seen[0]).isdisjoint(seen[1])
    assert len(set(seen[0] + seen[1])) == len(seen[0]) + len(seen[1])
    if not train:
        assert set(seen[0] + seen[1]) == {f"train[{i}]" for i in range(N_TRAIN)}


# ------------------------------------------------------------------------------ bad data


def test_an_undecodable_image_is_counted_and_named(tmp_path):
    bad = toy(10).to_dict()
    bad["image"][3] = {"bytes": b"not an image", "path": None}
    features = toy(1).features
    datasets.DatasetDict(train=datasets.Dataset.from_dict(bad, features=features),
                         validation=toy(2)).save_to_disk(str(tmp_path / "d"))  # fmt: skip
    split = splits_of(tmp_path / "d").train
    assert len(split) == 10  # read when decoded, by the loader
    kw = dict(num_classes=3, train=False, aug=AugmentConfig(img_size=16))
    tolerant = StreamingLoader(split, 4, workers=0, max_bad_fraction=0.05, **kw)
    assert sum(len(y) for _, y in tolerant) == 9 and tolerant.bad == 1
    assert tolerant.first_bad == "train[3]"
    strict = StreamingLoader(split, 4, workers=0, max_bad_fraction=0.0, **kw)
    with pytest.raises(LgvitError, match=r"1 of the first \d+ images are unreadable .*, e\.g\. "
                       r"train\[3\]$"):  # fmt: skip
        list(strict)


@pytest.mark.parametrize("case", ["no label", "out of range"])
def test_rows_without_a_usable_label_are_left_out_and_counted(tmp_path, case):
    labels = [0, 1, 2] * 3 + [0]
    labels[6] = None if case == "no label" else 7
    plain = toy(10, labels=labels, label_feature=datasets.Value("int64"))
    train = plain.cast(toy(1).features)  # ClassLabel of 3: casting lets the 7 through
    datasets.DatasetDict(train=train, validation=toy(3)).save_to_disk(str(tmp_path / "d"))
    why = "train[6]: no label" if case == "no label" else "train[6]: label 7 outside 0..2"
    sp = splits_of(tmp_path / "d", max_bad_fraction=0.2)
    assert sp.skipped == [why] and len(sp.train) == 9
    assert [sp.train.name(i) for i in range(9)] == [f"train[{r}]" for r in range(10) if r != 6]
    assert sp.train.labels.tolist() == [v for r, v in enumerate(labels) if r != 6]
    with pytest.raises(LgvitError) as e:
        splits_of(tmp_path / "d", max_bad_fraction=0.05)
    assert str(e.value) == (f"hfds {tmp_path / 'd'}: 1 of 10 rows of split train have no usable "
                            f"label (10.0% > max_bad_fraction 5.0%), e.g. {why}")  # fmt: skip
    with pytest.warns(
        UserWarning,
        match=r"1 of 10 rows of split train have no usable label, left out, e\.g\. train\[6\]",
    ):
        assert len(hfds_split(str(tmp_path / "d"), split="train", input_key=None,
                              target_key=None)) == 9  # fmt: skip


def test_missing_columns_splits_sources_and_package_are_one_line(forms, tmp_path, monkeypatch):
    saved = forms["saved"]
    cases = [
        (dict(input_key="img"), f"hfds {saved}: no column 'img' in split train (columns: "
                                "image, label)"),
        (dict(target_key="cls"), f"hfds {saved}: no column 'cls' in split train (columns: "
                                 "image, label)"),
        (dict(input_key="label"), f"hfds {saved}: column 'label' of split train holds int64, "
                                  "not images (--input-key)"),
        (dict(val_split="test"), f"hfds {saved}: no split 'test' (splits: train, validation)"),
        (dict(train_split="training"), f"hfds {saved}: no split 'training' (splits: train, "
                                       "validation)"),
    ]  # fmt: skip
    for kw, line in cases:
        with pytest.raises(LgvitError) as e:
            splits_of(saved, **kw)
        assert str(e.value) == line
    datasets.DatasetDict(train=toy(3)).save_to_disk(str(tmp_path / "only"))
    with pytest.raises(LgvitError, match=r"no split 'validation' \(nor 'val' or 'test'; splits: "
                       r"train\)$"):  # fmt: skip
        splits_of(tmp_path / "only")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no data here")
    for where in (tmp_path / "notes", tmp_path / "empty", tmp_path / "nowhere"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(LgvitError) as e:
            splits_of(where)
        assert str(e.value) == (f"hfds {where} is neither a dataset saved with save_to_disk nor "
                                "a folder of parquet or arrow files named by split "
                                "(train-*.parquet, validation-*.parquet)")  # fmt: skip
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(LgvitError, match=r"^--data hfds needs the datasets package: pip install "
                       r"'lgvit\[hfds\]'$"):  # fmt: skip
        splits_of(saved)


# ------------------------------------------------------------------------------ the command line


def test_train_and_eval_through_the_cli(forms, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *FAST, "--batch-size", "8", "--data", "hfds", "--data-dir",
                 str(forms["saved"]), "--epochs", "1", "--out", str(run),
                 "--set", "workers=2"]) == 0  # fmt: skip
    assert "40 train / 12 test images, 3 classes" in capsys.readouterr().out
    pred = tmp_path / "p.csv"
    assert main(["eval", "--checkpoint", str(run / "last.safetensors"), "--data", "hfds",
                 "--data-dir", str(forms["parquet"]), "--predictions", str(pred), "--json",
                 "--amp", "auto"]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["images"] == res["count"] == N_VAL and res["classes"] == CLASSES
    assert res["acc1"] == pytest.approx(metrics(run)[-1]["test_acc1"], abs=1e-3)
    names = [line.split(",")[0] for line in pred.read_text().splitlines()[1:]]
    assert sorted(names) == sorted(f"validation[{i}]" for i in range(N_VAL))


# Records the rows each rank hands the recipe, by name, then runs the command line.
LAUNCHER = """
import os, sys
from lgvit.data.stream import StreamingLoader
from lgvit.cli import main
plain = StreamingLoader.__iter__
def recording(self):
    if self.recipe.train:
        out = os.path.join(os.environ["ROWS_DIR"], f"rank{self.recipe.rank}")
        train_batch = self.recipe.train_batch
        def record(x, y, gen, idx):
            with open(out, "a") as f:
                f.writelines(self.samples.name(i) + "\\n" for i in idx.tolist())
            return train_batch(x, y, gen, idx)
        self.recipe.train_batch = record
    return plain(self)
StreamingLoader.__iter__ = recording
sys.exit(main(sys.argv[1:]))
"""


def test_two_ranks_train_on_disjoint_rows(forms, tmp_path, hf_cache):
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    env = {**ENV, "ROWS_DIR": str(tmp_path), "HF_DATASETS_CACHE": str(hf_cache)}
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(launcher), "train", *FAST, "--batch-size", "8", "--data", "hfds", "--data-dir",
         str(forms["parquet"]), "--epochs", "1", "--set", "workers=1",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 process(es)" in p.stdout
    rows = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    assert len(rows[0]) == len(rows[1]) == 16  # 20 each, in whole batches of 8
    assert set(rows[0]).isdisjoint(rows[1]) and len(set(rows[0] + rows[1])) == 32
    assert all(r.startswith("train[") for r in rows[0] + rows[1])
