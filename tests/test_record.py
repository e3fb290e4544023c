"""The checkpoint record (issue 39): one typed record of what a checkpoint carries, for every task,
written and read in one place (``lgvit.checkpoints.record``). Its on-disk form is today's (the same
keys and JSON strings, byte for byte), a malformed value in any task's header is one line naming the
file and the key (the dense loaders once raised IndexError or TypeError), keys a header lacks take
the record's typed defaults, and a dense checkpoint written by the code before the record loads
through today's eval and predict with the same results."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from det_fixtures import write_coco_set
from seg_fixtures import write_seg_set
from test_detection import DET_TRAIN
from test_segmentation import SEG_TRAIN
from test_train import ENV

from lgvit.checkpoints.files import PAIR_ID_KEY, check_same_classes, load_metadata, load_record
from lgvit.checkpoints.record import CheckpointRecord
from lgvit.cli import main
from lgvit.core.atomic import atomic_save_safetensors
from lgvit.core.errors import LgvitError

REPO = Path(__file__).resolve().parents[1]
BEFORE_RECORD = "0414c8f"  # the last commit whose three tasks wrote their headers by hand

# Each task's header as its writer makes it, key order included: the on-disk format.
CLS_META = {
    "model": "lsa_micro_cifar", "img_size": "32", "num_classes": "3",
    "classes": '["cat", "dog", "frog"]', "mean": "[0.4914, 0.4822, 0.4465]",
    "std": "[0.2471, 0.2435, 0.2616]", "dataset": "cifar10", "model_kwargs": '{"patch_size": 4}',
}  # fmt: skip
SEG_META = {
    "task": "segmentation", "model": "lsa_micro_cifar", "img_size": "32", "num_classes": "3",
    "classes": '["background", "disc", "square"]', "mean": "[0.485, 0.456, 0.406]",
    "std": "[0.229, 0.224, 0.225]", "dataset": "segfolder", "seg_scale": "[64, 48]",
}  # fmt: skip
DET_META = {
    "task": "detection", "detector": "retinanet", "model": "lsa_micro_cifar", "img_size": "32",
    "num_classes": "2", "classes": '["disc", "square"]', "cat_ids": "[3, 7]", "dataset": "coco",
    "det_scale": "[48, 32]",
}  # fmt: skip
META = {"classification": CLS_META, "segmentation": SEG_META, "detection": DET_META}


# ------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("task", sorted(META))
def test_a_header_reads_into_typed_fields_and_writes_back_byte_for_byte(task):
    meta = META[task]
    record = CheckpointRecord.from_meta(meta, "ckpt")
    assert list(record.to_meta().items()) == list(meta.items())  # keys, order and strings
    assert CheckpointRecord.from_meta(record.to_meta(), "ckpt") == record
    assert record.task == task and record.model == "lsa_micro_cifar" and record.img_size == 32
    assert isinstance(record.classes, tuple) and all(isinstance(c, str) for c in record.classes)
    assert record.num_classes == len(record.classes)
    if task == "classification":
        assert record.mean == (0.4914, 0.4822, 0.4465) and record.model_kwargs == {"patch_size": 4}
    elif task == "segmentation":
        assert record.seg_scale == (64, 48) and record.std == (0.229, 0.224, 0.225)
    else:
        assert record.cat_ids == (3, 7) and record.det_scale == (48, 32)
        assert record.detector == "retinanet"


def test_the_classification_writer_keeps_its_header():
    """``train.checkpoint_metadata`` through the record: the dict it wrote by hand before."""
    from lgvit.run.config import TrainConfig
    from lgvit.tasks.classification.train import checkpoint_metadata

    cfg = TrainConfig(model="lsa_micro_cifar", data="cifar10", patch_size=4)
    train = SimpleNamespace(classes=["cat", "dog", "frog"])
    splits = SimpleNamespace(train=train, mean=(0.4914, 0.4822, 0.4465),
                             std=(0.2471, 0.2435, 0.2616))  # fmt: skip
    assert list(checkpoint_metadata(cfg, 32, splits).items()) == list(CLS_META.items())


def test_a_record_saved_in_a_checkpoint_loads_back(tmp_path):
    for task, meta in META.items():
        record = CheckpointRecord.from_meta(meta, task)
        atomic_save_safetensors({"w": torch.zeros(1)}, tmp_path / f"{task}.safetensors",
                                record.to_meta())  # fmt: skip
        assert load_record(tmp_path / task) == record
        assert load_record(tmp_path / task, task) == record


# ------------------------------------------------------------------------------- defaults


def test_keys_a_header_lacks_take_the_records_defaults():
    # lgvit's first classification checkpoints: no task, no model_kwargs.
    old = CheckpointRecord.from_meta({"model": "lsa_micro_cifar", "img_size": "32"}, "ckpt")
    assert old.task == "classification" and old.model_kwargs == {} and old.classes is None
    assert CheckpointRecord.from_meta({}, "x.pth") == CheckpointRecord(model_kwargs={})
    # The authors' mmseg / mmdet files carry no header: ADE20K's and COCO's, their scales.
    seg = CheckpointRecord.from_meta({}, "x.pth", "segmentation")
    assert seg.task == "segmentation" and len(seg.classes) == 150
    assert (seg.seg_scale, seg.img_size) == ((2048, 512), 512)
    det = CheckpointRecord.from_meta({"format": "pt"}, "x.safetensors", "detection")
    assert len(det.classes) == len(det.cat_ids) == 80 and det.cat_ids[-1] == 90
    assert (det.det_scale, det.img_size) == ((1333, 800), 800)
    # A detector's build size defaults to its short side.
    no_size = {k: v for k, v in DET_META.items() if k != "img_size"}
    assert CheckpointRecord.from_meta(no_size, "ckpt").img_size == 32
    # An empty crop_pct is none (a hand-edited header's).
    assert CheckpointRecord.from_meta({**CLS_META, "crop_pct": ""}, "ckpt").crop_pct is None


@pytest.mark.parametrize(("meta", "task", "was"), [
    (CLS_META, "segmentation", "classification"), (DET_META, "segmentation", "detection"),
    (SEG_META, "detection", "segmentation"), ({"model": "x"}, "detection", "classification"),
])  # fmt: skip
def test_another_tasks_checkpoint_is_refused(meta, task, was):
    with pytest.raises(LgvitError, match=f"^ckpt: a {was} checkpoint, not a {task} one$"):
        CheckpointRecord.from_meta(meta, "ckpt", task)


def test_detection_classes_without_their_category_ids_are_refused():
    no_ids = {k: v for k, v in DET_META.items() if k != "cat_ids"}
    with pytest.raises(LgvitError, match="^ckpt: metadata names classes but no cat_ids"):
        CheckpointRecord.from_meta(no_ids, "ckpt")


# ------------------------------------------------------------------------------- malformed

# Bad values of every key, whichever task's header holds them.
BAD = {
    "task": ["regression"],
    "detector": ["yolo"],
    "model": [""],
    "img_size": ["32.5", "0"],
    "num_classes": ["three", "0"],
    "classes": ['"cat,dog,frog"', "[]", '["cat", "", "frog"]', "[1, 2, 3]"],
    "cat_ids": ['"3, 7"', "[3, 3]", "[0, 7]"],
    "mean": ["[0.5, 0.5]", "[NaN, 0.5, 0.5]"],
    "std": ["[0.25, 0.25, 0.25, 0.25]", "[0, 0.25, 0.25]"],
    "dataset": [""],
    "model_kwargs": ["[]", "{"],
    "seg_scale": ["[64]", "[100000, 100000]"],
    "det_scale": ['[48, "32"]', "[48, 0]"],
    "crop_pct": ["big", "1.5"],
}
CASES = [(task, key, value) for task in sorted(META) for key, values in BAD.items()
         for value in values]  # fmt: skip
# Keys that must agree: a dense model has one output per class name, a detection's class
# index is looked up in cat_ids.
CASES += [("segmentation", "num_classes", "5"), ("detection", "num_classes", "5"),
          ("detection", "cat_ids", "[3, 7, 9]")]  # fmt: skip


def _checkpoint(path: Path, task: str, key: str, value: str) -> Path:
    # The header is read before the weights: any tensor will do.
    atomic_save_safetensors({"w": torch.zeros(1)}, path, {**META[task], key: value})
    return path


def _loader(task: str):
    if task == "segmentation":
        from lgvit.tasks.segmentation.evaluate import load_segmenter

        return load_segmenter
    if task == "detection":
        from lgvit.tasks.detection.evaluate import load_detector

        return load_detector
    from lgvit.inference import load_model

    return load_model


@pytest.mark.parametrize(("task", "key", "value"), CASES)
def test_a_malformed_value_is_one_line_naming_the_file_and_key(task, key, value, image,
                                                               tmp_path, capsys):  # fmt: skip
    """Through the CLI (which reads the task first) and through the task's own loader."""
    ckpt = _checkpoint(tmp_path / "bad.safetensors", task, key, value)
    with pytest.raises(LgvitError) as e:
        CheckpointRecord.from_meta(load_metadata(ckpt), ckpt)
    want = f"{ckpt}: metadata {key}="
    assert str(e.value).startswith(want) and "\n" not in str(e.value), str(e.value)

    with pytest.raises(LgvitError) as e:
        _loader(task)(str(ckpt), "cpu")
    assert str(e.value).startswith(want) and "\n" not in str(e.value), str(e.value)

    out = ["--out", str(tmp_path / "P")] if task != "classification" else []
    code = main(["predict", "--checkpoint", str(ckpt), image, *out])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and want in err[0], (code, err)


def test_resume_with_a_malformed_saved_header_is_one_line(tmp_path):
    ckpt = _checkpoint(tmp_path / "last.safetensors", "classification", "classes", "[]")
    with pytest.raises(LgvitError, match=f"^{ckpt}: metadata classes="):
        check_same_classes(tmp_path / "last", CLS_META)


# --------------------------------------------------- a dense checkpoint written before the record

DRIVER = """
import contextlib, io, json, sys
from lgvit.cli import main
out = []
for args in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(args)
    out.append([code, buf.getvalue()])
print(json.dumps(out))
"""


def _old_source(dest: Path) -> Path:
    git = ["git", "-C", str(REPO)]
    ok = subprocess.run([*git, "cat-file", "-e", f"{BEFORE_RECORD}^{{commit}}"],
                        capture_output=True)  # fmt: skip
    if ok.returncode != 0:
        pytest.skip(f"commit {BEFORE_RECORD} is not in this clone's history (a shallow clone?)")
    archive = dest / "old.tar"
    subprocess.run([*git, "archive", "-o", str(archive), BEFORE_RECORD, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "src"


def _run(commands: list[list[str]], cwd: Path, pythonpath: str | None = None) -> list:
    """``lgvit`` commands in one process (the old code's with ``pythonpath``): their exit
    codes and standard outputs."""
    env = {**ENV, "PYTHONPATH": pythonpath} if pythonpath else ENV
    p = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True,
                       text=True, env=env, timeout=600, cwd=cwd)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    for (code, out), cmd in zip(results, commands, strict=True):
        assert code == 0, (cmd, out[-2000:], p.stderr[-2000:])
    return [out for _, out in results]


def _header(stem: Path) -> dict[str, str]:
    return {k: v for k, v in load_metadata(stem).items() if k != PAIR_ID_KEY}


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_a_dense_checkpoint_written_before_the_record_loads_unchanged(task, tmp_path):
    """The commit before the record trains one step; its header is the one today's writer
    makes for the same run, and today's eval and predict give what that commit's gave."""
    old_src = _old_source(tmp_path)
    if task == "segmentation":
        root = write_seg_set(tmp_path / "seg", n_train=8, n_val=2)
        train = [*SEG_TRAIN, "--data-dir", str(root), "--iters", "1"]
        data = ["--data", "segfolder", "--data-dir", str(root)]
        image = sorted((root / "images" / "validation").iterdir())[0]
    else:
        root = write_coco_set(tmp_path / "coco", n_train=6, n_val=2, size=(32, 48), empty=0)
        train = [*DET_TRAIN, "--data-dir", str(root), "--detector", "retinanet", "--iters", "1"]
        data = ["--data", "coco", "--data-dir", str(root)]
        image = sorted((root / "val2017").iterdir())[0]
    ckpt = str(tmp_path / "old_run" / "last")

    def use(pred: str) -> list[list[str]]:  # eval and predict of the old run's checkpoint
        return [["eval", "--checkpoint", ckpt, *data, "--amp", "none", "-j", "0", "--json"],
                ["predict", "--checkpoint", ckpt, str(image), "--out", str(tmp_path / pred),
                 "--json"]]  # fmt: skip

    old = _run([[*train, "--out", str(tmp_path / "old_run")], *use("old_pred")], tmp_path,
               str(old_src))[1:]  # fmt: skip
    new = _run([[*train, "--out", str(tmp_path / "new_run")], *use("new_pred")], tmp_path)[1:]

    assert _header(tmp_path / "new_run" / "last") == _header(tmp_path / "old_run" / "last")
    assert set(_header(tmp_path / "old_run" / "last")) == {*META[task], "format"}
    new_eval, old_eval = json.loads(new[0]), json.loads(old[0])
    assert {k: new_eval[k] for k in old_eval} == old_eval  # eval: every metric
    assert set(new_eval) - set(old_eval) <= {"precision", "tta"}  # said since that commit
    old_pred, new_pred = json.loads(old[1]), json.loads(new[1].replace("new_pred", "old_pred"))
    assert [r.pop("precision") for r in new_pred] == ["fp32"] * len(old_pred)
    assert new_pred == old_pred
    if task == "segmentation":  # the same mask, pixel for pixel
        files = [Path(old_pred[0]["mask"]), tmp_path / "new_pred" / Path(old_pred[0]["mask"]).name]
        assert files[0].read_bytes() == files[1].read_bytes()
