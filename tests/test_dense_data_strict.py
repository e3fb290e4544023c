"""Dense data you can trust (issue 36): every field of a COCO file checked once at load time,
bad images counted, reported and stopping a detection run above ``max_bad_fraction``,
unreadable evaluation images named, and segfolder's class list and masks read strictly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from det_fixtures import write_coco_set
from PIL import Image
from pycocotools import mask as mask_utils

from lgvit.core.errors import LgvitError
from lgvit.data.coco import DetEvalLoader, DetTrainLoader, annotations, load_coco_split

DET_TRAIN = [
    "train", "--task", "detection", "--model", "lsa_micro_cifar", "--data", "coco",
    "--amp", "none", "--workers", "0", "--set", "drop_path=0", "--set", "det_scale=[48,32]",
    "--set", "warmup_iters=1", "--epochs", "1", "--batch-size", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 12 training images (10 annotated: the last 2 empty), 4 validation; 32x48 (every third
    # 48x32); image 0 of each split holds the training split's crowd RLE.
    return write_coco_set(tmp_path_factory.mktemp("coco") / "data", 12, 4, size=(32, 48))


def _ann_file(root: Path, split: str) -> Path:
    return root / "annotations" / f"instances_{split}2017.json"


def _variant(
    tmp: Path, root: Path, edit: Callable[[dict], Any] | None = None, split: str = "train",
    copy_images: bool = False,
) -> Path:  # fmt: skip
    """A copy of ``root`` with ``split``'s JSON edited in place by ``edit`` (or replaced by
    the text it returns); images linked, or copied when a test changes one."""
    new = tmp / "variant"
    (new / "annotations").mkdir(parents=True)
    for s in ("train", "val"):
        data = json.loads(_ann_file(root, s).read_text())
        out = edit(data) if (edit and s == split) else None
        _ann_file(new, s).write_text(out if isinstance(out, str) else json.dumps(data))
        if copy_images:
            shutil.copytree(root / f"{s}2017", new / f"{s}2017")
        else:
            (new / f"{s}2017").symlink_to(root / f"{s}2017")
    return new


def _one_line(match: str, fn: Callable[[], Any], *names: str) -> str:
    with pytest.raises(LgvitError, match=match) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg, msg
    return msg


def _ann(data: dict, k: int = 0) -> dict:
    """The k-th plain (not crowd) annotation."""
    return [a for a in data["annotations"] if not a["iscrowd"]][k]


def _crowd(data: dict) -> dict:
    return next(a for a in data["annotations"] if a["iscrowd"])


def _cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from lgvit.cli import main

    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err


# --------------------------------------------------------------------------- load-time checks


def _set(get: Callable[[dict], dict], **change: Any) -> Callable[[dict], None]:
    return lambda data: get(data).update(change)


def _one_category(**change: Any) -> Callable[[dict], None]:
    """A category with id 1 (which ``True`` equals), and ``change`` to an annotation."""

    def edit(data: dict) -> None:
        data["categories"].append({"id": 1, "name": "one"})
        _ann(data).update(change)

    return edit


def _image(data: dict) -> dict:
    return min(data["images"], key=lambda im: im["id"])  # the one holding the crowd RLE


def _second_image(data: dict) -> dict:
    return sorted(data["images"], key=lambda im: im["id"])[1]


@pytest.mark.parametrize(
    "edit, match",
    [
        # masks: the RLE's counts must cover the image exactly, its size be the image's
        (_set(_crowd, segmentation={"counts": [5, 10], "size": [32, 48]}),
         r"RLE counts cover 15 pixels, the image has 32x48 = 1536"),
        (_set(_crowd, segmentation={"counts": [1536, -4, 4], "size": [32, 48]}),
         "RLE counts hold a negative count"),
        (_set(_crowd, segmentation={"counts": [1536.0], "size": [32, 48]}),
         "RLE counts are neither a string nor a list of integers"),
        (_set(_crowd, segmentation={"counts": "garbage RLE!", "size": [32, 48]}),
         "RLE counts 'garbage RLE!' are not a compressed RLE"),
        (_set(_crowd, segmentation={"counts": "52", "size": [32, 48]}), "cover 7 pixels"),
        (_set(_crowd, segmentation={"counts": [1536], "size": [48, 32]}),
         r"RLE size \[48, 32\] is not the image's \[32, 48\]"),
        (_set(_crowd, segmentation={"counts": [1536], "size": [32.0, 48]}), "RLE size"),
        (_set(_crowd, segmentation={"counts": [1536]}), "neither a list of polygons nor an RLE"),
        (_set(_crowd, segmentation="polygon"), "neither a list of polygons nor an RLE"),
        (_set(_ann, segmentation=[[1, 2, 3, float("nan"), 5, 6]]), "polygon 0 is not an even"),
        (_set(_ann, segmentation=[[1, 2, 3, 4, 5, 6], [1, 2, float("inf"), 4, 5, 6]]),
         "polygon 1 is not an even count of finite numbers"),
        (_set(_ann, segmentation=[[1, 2, 3, 4, 5, 6, 7]]), "polygon 0 is not an even"),
        (_set(_ann, segmentation=[[1, 2, "3", 4, 5, 6]]), "polygon 0 is not an even"),
        (_set(_ann, segmentation=[[[1, 2], [3, 4], [5, 6]]]), "polygon 0 is not an even"),
        # iscrowd: 0 or 1 (a string "0" is a crowd in training and not one in COCOeval)
        (_set(_ann, iscrowd="0"), r"iscrowd '0' is not 0 or 1"),
        (_set(_ann, iscrowd="no"), r"iscrowd 'no' is not 0 or 1"),
        (_set(_ann, iscrowd=True), r"iscrowd True is not 0 or 1"),
        (_set(_ann, iscrowd=2), r"iscrowd 2 is not 0 or 1"),
        (_set(_ann, iscrowd=None), r"iscrowd None is not 0 or 1"),
        (_set(_ann, ignore="false"), r"ignore 'false' is not 0, 1, true or false"),
        # the other fields' types
        (_one_category(category_id=True), r"category_id True is not in categories"),  # == 1
        (_set(_ann, id=True), r'annotations\[\d+\] has no integer "id"'),
        (lambda d: d["annotations"].append(dict(_ann(d, 1), id=_ann(d)["id"])),
         r"annotation id \d+ appears twice"),
        (_set(_image, file_name=5), r"image id \d+: file_name 5 is not a non-empty string"),
        (_set(_image, file_name=["a.png"]), r"file_name \['a.png'\] is not a non-empty string"),
        (_set(_image, file_name=""), r"file_name '' is not a non-empty string"),
        (_set(_image, file_name="/etc/passwd"), "is not a path inside the image folder"),
        (_set(_image, file_name="../val2017/x.png"), "is not a path inside the image folder"),
        (_set(_image, file_name="a/../../x.png"), "is not a path inside the image folder"),
        (lambda d: _second_image(d).update(file_name="./" + _image(d)["file_name"]),
         r"file_name '\./\d+\.png' is image id \d+'s too"),
        (_set(_image, height=32.0), r"height/width 32.0/48 are not positive integers"),
        (_set(_second_image, width=0), r"height/width \d+/0 are not positive integers"),
        (_set(_second_image, height="32"), r"height/width '32'/\d+ are not positive integers"),
        (_set(_image, id=False), r'images\[\d+\] has no integer "id"'),
        (lambda d: d["categories"][0].update(name=3), r"category id 3: name 3 is not a non-emp"),
        # deep nesting: json's RecursionError
        (lambda d: "[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
    ],
)  # fmt: skip
def test_every_field_is_checked_at_load_time(tmp_path, root, edit, match):
    new = _variant(tmp_path, root, edit)
    _one_line(match, lambda: load_coco_split(new, "train"), "instances_train2017.json")


def test_the_messages_name_the_annotation_and_its_image(tmp_path, root):
    a = _ann(json.loads(_ann_file(root, "train").read_text()))
    new = _variant(tmp_path, root, _set(_ann, iscrowd="0"))
    _one_line("iscrowd", lambda: load_coco_split(new, "train"),
              f"annotation id {a['id']} (image id {a['image_id']})")  # fmt: skip


def test_compressed_rle_counts_are_read_as_pycocotools_does(tmp_path, root):
    """A compressed RLE (pycocotools' own string) and the same mask's uncompressed counts pass
    the checks and decode to the mask; the string cut short is refused."""
    from det_fixtures import rle_counts

    m = np.zeros((32, 48), dtype=np.uint8)
    m[3:20, 5:40] = 1
    m[25:, :7] = 1
    compressed = mask_utils.encode(np.asfortranarray(m))["counts"].decode()
    a = _ann(json.loads(_ann_file(root, "train").read_text()))

    def edit(data):
        for im in data["images"]:  # the image in landscape, as the mask
            if im["id"] == a["image_id"]:
                assert (im["height"], im["width"]) == (32, 48)
        b = _ann(data)
        b.update(bbox=[5.0, 3.0, 35.0, 17.0], area=float(m.sum()),
                 segmentation={"counts": compressed, "size": [32, 48]})  # fmt: skip
        data["annotations"].append(
            dict(b, id=99999, segmentation={"counts": rle_counts(m), "size": [32, 48]})
        )

    split = load_coco_split(_variant(tmp_path / "a", root, edit), "train")
    masks = annotations(split, split.image_ids.index(a["image_id"]), with_masks=True)["masks"]
    np.testing.assert_array_equal(masks[0], m)
    np.testing.assert_array_equal(masks[-1], m)
    short = _set(_ann, segmentation={"counts": compressed[:-2], "size": [32, 48]})
    new = _variant(tmp_path / "b", root, short)
    _one_line("RLE counts", lambda: load_coco_split(new, "train"))


def test_a_missing_iscrowd_is_not_a_crowd_and_cocoeval_reads_it(tmp_path, root):
    """Hand-made files often leave ``iscrowd`` out: it is 0, in training and in COCOeval
    (which read it with ``int(ann["iscrowd"])`` and raised KeyError)."""
    from lgvit.tasks.detection.evaluate import coco_evaluate

    def drop(data):
        for a in data["annotations"]:
            del a["iscrowd"]

    val = load_coco_split(_variant(tmp_path, root, drop, split="val"), "val")
    assert all(a["iscrowd"] == 0 for a in val.coco.dataset["annotations"])
    image_id = val.image_ids[0]
    gt = val.coco.imgToAnns[image_id][0]
    dets = [{"image_id": image_id, "category_id": gt["category_id"], "bbox": gt["bbox"],
             "score": 0.9}]  # fmt: skip
    res = coco_evaluate(val.coco, dets, "bbox", val.image_ids)
    assert 0 < res["bbox_AP"] <= 100
    assert len(annotations(val, 0)["boxes"]) == len(val.coco.imgToAnns[image_id])


def test_maskrcnn_needs_a_segmentation_for_every_annotation(tmp_path, root, capsys):
    from lgvit.data.coco import require_masks

    def drop(data):
        del _ann(data, 2)["segmentation"]

    new = _variant(tmp_path, root, drop)
    split = load_coco_split(new, "train")  # boxes only are fine for RetinaNet
    _one_line('no "segmentation"', lambda: require_masks(split), "instances_train2017.json")
    code, err = _cli([*DET_TRAIN, "--data-dir", str(new), "--detector", "maskrcnn", "--out",
                      str(tmp_path / "run")], capsys)  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and 'no "segmentation"' in lines[0], err


def test_missing_files_are_counted_when_the_loader_is_made(tmp_path, root):
    def rename(k):
        def edit(data):
            for im in sorted(data["images"], key=lambda im: im["id"])[:k]:
                im["file_name"] = f"gone_{im['id']}.png"

        return edit

    split = load_coco_split(_variant(tmp_path / "a", root, rename(1)), "train")
    loader = DetTrainLoader(split, 1, seed=0, workers=0, max_bad_fraction=0.2)
    assert len(loader) == len(split) - 1 and "gone_" in loader.notes[0]
    assert loader.notes[0].startswith(f"1 of the {len(split)} training images are missing")
    _one_line("max_bad_fraction 5.0%", lambda: DetTrainLoader(split, 1, seed=0), "gone_")
    split = load_coco_split(_variant(tmp_path / "b", root, rename(100)), "train")
    _one_line("none of the 10 training images", lambda: DetTrainLoader(
        split, 1, seed=0, max_bad_fraction=1.0), "gone_")  # fmt: skip
    val = load_coco_split(_variant(tmp_path / "c", root, rename(1), split="val"), "val")
    assert DetEvalLoader(val, workers=0).notes == []  # lgvit eval: counted when read
    assert "gone_" in DetEvalLoader(val, workers=0, max_bad_fraction=0.5).notes[0]


def test_a_file_listed_in_another_case_is_not_missing(root, monkeypatch):
    """A case-insensitive disk lists IMG.PNG for a file_name img.png that opens: not missing."""
    import os

    split = load_coco_split(root, "train")
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: [n.upper() for n in listdir(p)])
    assert DetTrainLoader(split, 1, seed=0, workers=0).notes == []


def test_eval_loader_keeps_each_pass_s_messages(tmp_path, root):
    new = _variant(tmp_path, root, split="val", copy_images=True)
    val = load_coco_split(new, "val")
    val.files[1].write_bytes(b"")
    loader = DetEvalLoader(val, workers=0)
    for _ in range(2):  # a training run evaluates with the same loader every epoch
        assert sum(img is None for img, _ in loader) == 1
        assert len(loader.skipped) == 1 and val.files[1].name in loader.skipped[0]


# --------------------------------------------------------------------------- training runs


def test_detection_training_with_every_image_missing_stops_in_one_line(tmp_path, root, capsys):
    """Every file_name pointing at a missing file: one line and exit 2, not a run that
    'succeeds' with loss 0, 0 img/s and AP 0."""

    def gone(data):
        for im in data["images"]:
            im["file_name"] = f"missing/{im['file_name']}"

    new = _variant(tmp_path, root, gone)
    code, err = _cli([*DET_TRAIN, "--data-dir", str(new), "--detector", "retinanet", "--out",
                      str(tmp_path / "run")], capsys)  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "none of the 10 training images" in lines[0] and "missing/" in lines[0]


def _resize_images(data: dict, ids: set[int]) -> None:
    """The JSON says 2 pixels more height than the files have (images without an RLE)."""
    for im in data["images"]:
        if im["id"] in ids:
            im["height"] += 2


def _plain_ids(root: Path) -> list[int]:
    """Training image ids, annotated, without the crowd RLE, in id order."""
    data = json.loads(_ann_file(root, "train").read_text())
    crowd = {a["image_id"] for a in data["annotations"] if a["iscrowd"]}
    annotated = {a["image_id"] for a in data["annotations"]}
    return sorted(annotated - crowd)


def test_detection_training_with_every_image_unusable_stops_in_one_line(tmp_path, root, capsys):
    """Files that exist but that the JSON's sizes disagree with (the crowd RLE's image: not
    an image) are found when read: every one of them bad is one line and exit 2, also with
    max_bad_fraction 1."""
    ids = set(_plain_ids(root))
    new = _variant(tmp_path, root, lambda d: _resize_images(d, ids), copy_images=True)
    crowd = load_coco_split(root, "train").files[0]  # the lowest id holds the crowd RLE
    (new / "train2017" / crowd.name).write_bytes(b"not an image")
    code, err = _cli([*DET_TRAIN, "--data-dir", str(new), "--detector", "retinanet", "--out",
                      str(tmp_path / "run"), "--set", "max_bad_fraction=1"], capsys)  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "training images read in epoch 1 could not be used" in lines[0] and "says" in lines[0]


def test_a_few_bad_training_images_are_counted_and_reported(tmp_path, capsys):
    """One missing file (found when the loader is made: train.log says so) and one image of
    another size than the JSON's (found when read: a warning and ``skipped_images`` in
    metrics.jsonl), below max_bad_fraction: the run goes on and says what it left out. The
    validation image of another size too: the epoch's evaluation names it."""
    root = write_coco_set(tmp_path / "small", 5, 1, size=(32, 48), empty=0)  # 3 steps
    ids = _plain_ids(root)

    def edit(data):
        _resize_images(data, {ids[0]})
        next(im for im in data["images"] if im["id"] == ids[1])["file_name"] = "gone.png"

    new = _variant(tmp_path, root, edit)
    val = json.loads(_ann_file(new, "val").read_text())
    _resize_images(val, {val["images"][0]["id"]})
    _ann_file(new, "val").write_text(json.dumps(val))
    run = tmp_path / "run"
    code, err = _cli([*DET_TRAIN, "--data-dir", str(new), "--detector", "retinanet", "--out",
                      str(run), "--set", "max_bad_fraction=0.3"], capsys)  # fmt: skip
    assert code == 0, err
    log = (run / "train.log").read_text()
    assert "1 of the 5 training images are missing (20.0%), e.g." in log and "gone.png" in log
    assert "epoch 1: skipped 1 training image(s) of 4 that could not be used (25.0%)" in err
    hist = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert hist[0]["skipped_images"] == 1
    assert "eval: 1 unreadable validation image(s) counted as without detections, e.g." in err
    assert "instances_val2017.json says 34x48" in err


# --------------------------------------------------------------------------- evaluation


class _NoDetections(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # where the device is read from

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        empty = torch.zeros(0)
        return [{"boxes": torch.zeros(0, 4), "labels": empty.long(), "scores": empty}
                for _ in images]  # fmt: skip


def test_unreadable_eval_images_are_named_with_the_reason(tmp_path, root):
    """An eval image whose file is not the JSON's size: the result names it and says why."""
    from lgvit.core.runtime import Dist
    from lgvit.tasks.detection.evaluate import evaluate_detection

    def edit(data):
        _second_image(data)["width"] += 3

    val = load_coco_split(_variant(tmp_path, root, edit, split="val"), "val")
    res = evaluate_detection(_NoDetections(), DetEvalLoader(val, workers=0), val, 0,
                             Dist(device=torch.device("cpu")), None)  # fmt: skip
    assert res["unreadable"] == 1 and len(res["unreadable_examples"]) == 1
    assert val.files[1].name in res["unreadable_examples"][0]
    assert "instances_val2017.json says" in res["unreadable_examples"][0]


# --------------------------------------------------------------------------- segfolder


def _seg_root(tmp_path: Path) -> Path:
    from seg_fixtures import write_seg_set

    return write_seg_set(tmp_path / "seg", n_train=2, n_val=1)


def test_classes_txt_with_a_bom_and_not_utf8(tmp_path):
    from seg_fixtures import CLASSES

    from lgvit.data.segmentation import load_seg_split

    root = _seg_root(tmp_path)
    classes = root / "classes.txt"
    classes.write_bytes(b"\xef\xbb\xbf" + "\n".join(CLASSES).encode())
    assert load_seg_split("segfolder", root, "train").classes == tuple(CLASSES)
    for bom in (b"", b"\xef\xbb\xbf"):  # the offset in the file, BOM or not
        text = bom + "\n".join(CLASSES).encode()
        classes.write_bytes(text + b"\ncaf\xe9\n")
        offset = len(text) + 4
        _one_line(f"not UTF-8 text \\(byte 0xe9 at offset {offset}, line {len(CLASSES) + 1}\\)",
                  lambda: load_seg_split("segfolder", root, "train"), str(classes))  # fmt: skip


def test_negative_labels_in_a_32_bit_mask_are_one_line(tmp_path):
    from lgvit.data.segmentation import load_seg_split, read_pair

    root = _seg_root(tmp_path)
    split = load_seg_split("segfolder", root, "train")
    mask = np.asarray(Image.open(split.masks[0])).astype(np.int32)
    mask[0, 0] = -1
    # PNG has no signed 32-bit mode; PIL reads a mask by its content, whatever its suffix.
    Image.fromarray(mask).save(split.masks[0], format="TIFF")  # int32: mode "I"
    _one_line("label -1 is out of range", lambda: read_pair(split, 0), split.masks[0])
