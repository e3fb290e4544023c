"""COCO-format detection data: mmdet 2.11's image filter and annotation parsing, masks from
polygons and RLE, the training loader's order, flips and resumption, the evaluation loader's
split across processes, and one-line errors for malformed files."""

from __future__ import annotations

import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from det_fixtures import DISC, SQUARE, write_coco_set
from pycocotools import mask as mask_utils

from lgvit.core.errors import LgvitError
from lgvit.data.coco import (
    DetEvalLoader,
    DetTrainLoader,
    annotations,
    load_coco_split,
    read_detection_sample,
)
from lgvit.data.segmentation import sample_rng

N_TRAIN, N_VAL, EMPTY = 24, 8, 2


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_coco_set(tmp_path_factory.mktemp("coco") / "data", N_TRAIN, N_VAL, empty=EMPTY)


@pytest.fixture(scope="module")
def train(root: Path):
    return load_coco_split(root, "train")


def _json(root: Path, split: str = "train") -> dict[str, Any]:
    return json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())


def _variant(
    tmp: Path, root: Path, edit: Callable[[dict], Any] | None = None, split: str = "train",
    copy_images: bool = False,
) -> Path:  # fmt: skip
    """A copy of ``root`` with ``split``'s JSON edited (``edit`` mutates it, or returns the
    raw text to write); images linked, or copied when the test damages one."""
    new = tmp / "variant"
    (new / "annotations").mkdir(parents=True)
    for s in ("train", "val"):
        data = _json(root, s)
        out = edit(data) if (edit and s == split) else None
        text = out if isinstance(out, str) else json.dumps(data)
        (new / "annotations" / f"instances_{s}2017.json").write_text(text)
        if copy_images:
            shutil.copytree(root / f"{s}2017", new / f"{s}2017")
        else:
            (new / f"{s}2017").symlink_to(root / f"{s}2017")
    return new


def _raises(match: str, fn: Callable[[], Any], *names: str) -> str:
    with pytest.raises(LgvitError, match=match) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    for name in names:
        assert name in msg
    return msg


# --------------------------------------------------------------------------------- splits


def test_split_categories_filter_and_order(root, train):
    assert train.cat_ids == [DISC, SQUARE] and train.classes == ("disc", "square")
    data = _json(root)
    annotated = {a["image_id"] for a in data["annotations"]}
    assert len(annotated) == N_TRAIN - EMPTY
    assert train.image_ids == sorted(annotated)  # the JSON lists them unsorted
    by_id = {im["id"]: im for im in data["images"]}
    for i, image_id in enumerate(train.image_ids):
        assert train.sizes[i] == (by_id[image_id]["height"], by_id[image_id]["width"])
        assert train.files[i] == root / "train2017" / by_id[image_id]["file_name"]
        assert train.files[i].is_file()
    assert {h > w for h, w in train.sizes} == {True, False}  # both orientations
    assert train.root == root / "train2017" and train.coco.imgs.keys() == by_id.keys()
    assert len(load_coco_split(root, "val")) == N_VAL
    assert len(load_coco_split(root, "train", train=False)) == N_TRAIN  # empties kept


def test_images_under_32_pixels_dropped_for_training(tmp_path, root):
    def add_tiny(data):
        data["images"].append({"id": 9999, "file_name": "tiny.png", "height": 31, "width": 80})
        ann = {"id": 99999, "image_id": 9999, "category_id": DISC, "iscrowd": 0}
        data["annotations"].append({**ann, "bbox": [1, 1, 20, 20], "area": 400.0})

    new = _variant(tmp_path, root, add_tiny)
    assert 9999 not in load_coco_split(new, "train").image_ids
    assert 9999 in load_coco_split(new, "train", train=False).image_ids


def test_archive_with_a_wrapper_folder(tmp_path, root):
    archive = tmp_path / "coco.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="coco2017")
    split = load_coco_split(archive, "val", cache_dir=tmp_path / "cache")
    assert len(split) == N_VAL and split.files[0].is_file()


# --------------------------------------------------------------------------------- annotations


def test_annotations_match_the_json(root, train):
    anns_by_image: dict[int, list] = {}
    for a in _json(root)["annotations"]:
        anns_by_image.setdefault(a["image_id"], []).append(a)
    crowds = 0
    for i, image_id in enumerate(train.image_ids):
        ann = annotations(train, i)
        plain = [a for a in anns_by_image[image_id] if not a["iscrowd"]]
        want = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in plain)]
        assert ann["boxes"].dtype == np.float32 and ann["labels"].dtype == np.int64
        np.testing.assert_array_equal(ann["boxes"], np.array(want, np.float32).reshape(-1, 4))
        assert ann["labels"].tolist() == [train.cat_ids.index(a["category_id"]) for a in plain]
        crowd = [a["bbox"] for a in anns_by_image[image_id] if a["iscrowd"]]
        crowds += len(crowd)
        assert ann["crowd_boxes"].shape == (len(crowd), 4)
        for (x, y, w, h), got in zip(crowd, ann["crowd_boxes"], strict=True):
            assert got.tolist() == [x, y, x + w, y + h]
            assert got.tolist() not in ann["boxes"].tolist()
    assert crowds == 1


def test_annotations_mmdet_would_skip_are_skipped(tmp_path, root, train):
    image_id, (h, w) = train.image_ids[1], train.sizes[1]
    extra = [
        dict(bbox=[5, 5, 0.5, 10], area=5.0),  # w < 1
        dict(bbox=[5, 5, 10, 0.9], area=9.0),  # h < 1
        dict(bbox=[5, 5, 10, 10], area=0.0),  # area 0
        dict(bbox=[w + 2, 5, 10, 10], area=100.0),  # outside the image
        dict(bbox=[-20, 5, 20, 10], area=200.0),  # touching it only
        dict(bbox=[5, 5, 10, 10], area=100.0, ignore=True),
        dict(bbox=[w - 5, h - 5, 10, 10], area=100.0, category_id=SQUARE),  # kept, unclipped
    ]  # fmt: skip

    def add(data):
        for k, e in enumerate(extra):
            data["annotations"].append({"id": 50000 + k, "image_id": image_id, "iscrowd": 0,
                                        "category_id": DISC, **e})  # fmt: skip

    split = load_coco_split(_variant(tmp_path, root, add), "train")
    before, after = annotations(train, 1), annotations(split, 1)
    assert after["boxes"].tolist() == before["boxes"].tolist() + [[w - 5, h - 5, w + 5, h + 5]]
    assert after["labels"].tolist() == before["labels"].tolist() + [1]


def test_masks_from_polygons_and_rle(tmp_path, root, train):
    for i in range(len(train)):
        ann = annotations(train, i, with_masks=True)
        assert ann["masks"].shape == (len(ann["boxes"]), *train.sizes[i])
        assert ann["masks"].dtype == np.uint8
        for m, box in zip(ann["masks"], ann["boxes"], strict=True):
            ys, xs = np.nonzero(m)
            got = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            assert np.abs(np.array(got) - box).max() <= 1, (i, got, box)

    # The crowd region as a plain object: its uncompressed RLE, and the same compressed.
    crowd = next(a for a in _json(root)["annotations"] if a["iscrowd"])

    def uncrowd(data):
        a = next(a for a in data["annotations"] if a["id"] == crowd["id"])
        a["iscrowd"] = 0
        rle = mask_utils.frPyObjects(a["segmentation"], *a["segmentation"]["size"])
        data["annotations"].append({**a, "id": 77777, "segmentation": {
            "counts": rle["counts"].decode(), "size": rle["size"]}})  # fmt: skip

    split = load_coco_split(_variant(tmp_path, root, uncrowd), "train")
    i = split.image_ids.index(crowd["image_id"])
    ann = annotations(split, i, with_masks=True)
    assert len(ann["crowd_boxes"]) == 0
    rle_masks = ann["masks"][-2:]
    assert rle_masks.shape == (2, *split.sizes[i])
    np.testing.assert_array_equal(rle_masks[0], rle_masks[1])
    assert rle_masks[0].sum() == crowd["area"]
    x, y, w, h = map(int, crowd["bbox"])
    assert rle_masks[0][y : y + h, x : x + w].sum() == crowd["area"]


def test_read_sample_and_size_mismatch(tmp_path, root, train):
    img, target = read_detection_sample(train, 0, with_masks=True)
    assert img.dtype == torch.uint8 and tuple(img.shape) == (3, *train.sizes[0])
    assert target["boxes"].dtype == torch.float32 and target["labels"].dtype == torch.int64
    assert target["masks"].shape[1:] == img.shape[1:]

    def wrong_size(data):  # image 1: image 0's crowd RLE would be refused as the wrong size
        im = next(im for im in data["images"] if im["id"] == train.image_ids[1])
        im["height"] += 2

    split = load_coco_split(_variant(tmp_path, root, wrong_size), "train")
    h, w = train.sizes[1]
    _raises("says", lambda: read_detection_sample(split, 1), split.files[1].name,
            f"{h}x{w}", f"{h + 2}x{w}")  # fmt: skip


# --------------------------------------------------------------------------------- loaders


def _epoch(loader: DetTrainLoader) -> list[tuple[list, list]]:
    return list(loader)


def _same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for (ia, ta), (ib, tb) in zip(a, b, strict=True):
        if len(ia) != len(ib) or any(not torch.equal(x, y) for x, y in zip(ia, ib, strict=True)):
            return False
        for x, y in zip(ta, tb, strict=True):
            if x.keys() != y.keys() or any(not torch.equal(x[k], y[k]) for k in x):
                return False
    return True


def _which(train, img: torch.Tensor) -> tuple[int, bool]:
    """The index of a yielded image and whether it was flipped."""
    for i in range(len(train)):
        raw, _ = read_detection_sample(train, i)
        if raw.shape == img.shape and torch.equal(raw, img):
            return i, False
        if raw.shape == img.shape and torch.equal(raw.flip(-1), img):
            return i, True
    raise AssertionError("an image that is in no sample")


def test_train_loader_flips_are_per_image_and_consistent(train):
    loader = DetTrainLoader(train, 4, seed=3, workers=0, with_masks=True)
    loader.set_epoch(2)
    flips = set()
    for images, targets in loader:
        for img, t in zip(images, targets, strict=True):
            i, flipped = _which(train, img)
            assert flipped == (sample_rng(3, 2, i).random() < 0.5)
            flips.add(flipped)
            _, raw = read_detection_sample(train, i, with_masks=True)
            w, b = img.shape[-1], raw["boxes"]
            if flipped:
                b = torch.stack([w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]], 1)
            assert torch.equal(t["boxes"], b) and torch.equal(t["labels"], raw["labels"])
            masks = raw["masks"].flip(-1) if flipped else raw["masks"]
            assert torch.equal(t["masks"], masks) and t["masks"].dtype == torch.uint8
            assert set(t) == {"boxes", "labels", "masks"}
    assert flips == {True, False}
    none = DetTrainLoader(train, 4, seed=3, workers=0, hflip=0.0)
    assert all(not _which(train, img)[1] for images, _ in none for img in images)


def test_train_loader_workers_resume_and_epochs(train):
    a = DetTrainLoader(train, 2, seed=1, workers=0)
    b = DetTrainLoader(train, 2, seed=1, workers=2)
    for loader in (a, b):
        loader.set_epoch(1)
    full = _epoch(a)
    assert len(full) == len(a) and _same(full, _epoch(b))
    a.set_epoch(1, 3)
    assert len(a) == len(full) and _same(_epoch(a), full[3:])
    a.set_epoch(1)  # set_epoch(e, k) is for one epoch only: the next starts at 0 again
    assert _same(_epoch(a), full)
    a.set_epoch(2)
    assert not _same(_epoch(a), full)
    assert a.aug_state() is None


def test_two_ranks_partition_global_batches_by_orientation(train):
    ranks = [DetTrainLoader(train, 3, seed=5, rank=r, world=2, workers=0) for r in (0, 1)]
    wide = sum(w > h for h, w in train.sizes)
    tall = len(train) - wide
    assert len(ranks[0]) == len(ranks[1]) == wide // 6 + tall // 6
    seen: list[int] = []
    for (i0, _), (i1, _) in zip(*ranks, strict=True):
        idx = [_which(train, img)[0] for img in i0 + i1]
        assert len(i0) == len(i1) == 3
        assert len({train.sizes[i][1] > train.sizes[i][0] for i in idx}) == 1
        seen += idx
    assert len(seen) == len(set(seen)) == 6 * len(ranks[0])


def test_unreadable_images_are_skipped(tmp_path, root):
    new = _variant(tmp_path, root, copy_images=True)
    split = load_coco_split(new, "train")
    # 1 of the 16 images an epoch reads at batch 4: above the default max_bad_fraction (5%).
    loader = DetTrainLoader(split, 4, seed=0, workers=0, max_bad_fraction=0.1)
    bad = loader.global_batches()[1][2]  # an image this epoch uses
    split.files[bad].write_bytes(b"not an image")
    with pytest.warns(UserWarning, match="skipped 1 training image"):
        sizes = [len(images) for images, _ in loader]
    assert sorted(sizes)[0] == 3 and sum(sizes) == 4 * len(loader) - 1
    assert len(loader.skipped) == 1 and split.files[bad].name in loader.skipped[0]
    loader = DetTrainLoader(split, 1, seed=0, workers=0, max_bad_fraction=0.1)  # a batch alone
    with pytest.warns(UserWarning, match="skipped 1 training image"):
        assert len(_epoch(loader)) == len(loader) - 1 and len(loader.skipped) == 1
    _raises("fewer than one global batch", lambda: DetTrainLoader(split, 50, seed=0))


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_loader_covers_every_image_once(tmp_path, root, workers):
    new = _variant(tmp_path, root, split="val", copy_images=True)
    val = load_coco_split(new, "val")
    val.files[5].write_bytes(b"")
    got = []
    for rank in (0, 1):
        loader = DetEvalLoader(val, rank=rank, world=2, workers=workers)
        items = list(loader)
        assert len(items) == len(loader) == len(range(rank, len(val), 2))
        got += items
        for img, image_id in items:
            i = val.image_ids.index(image_id)
            if i == 5:
                assert img is None and val.files[5].name in loader.skipped[0]
            else:
                assert img.dtype == torch.uint8 and tuple(img.shape) == (3, *val.sizes[i])
    assert sorted(image_id for _, image_id in got) == val.image_ids


# --------------------------------------------------------------------------------- errors


def _drop(key: str) -> Callable[[dict], None]:
    return lambda data: data.pop(key)


def _first_ann(**change: Any) -> Callable[[dict], None]:
    return lambda data: data["annotations"][0].update(change)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda data: '{"images": [', "not JSON"),
        (lambda data: "[1, 2]", "not a COCO annotation object"),
        (_drop("categories"), 'no "categories"'),
        (_drop("images"), 'no "images"'),
        (_first_ann(category_id=5), "category_id 5 is not in categories"),
        (_first_ann(image_id=1), "image_id 1 is not in images"),
        (_first_ann(bbox=[1, 2, 3]), r"bbox \[1, 2, 3\] is not 4 finite numbers"),
        (_first_ann(bbox=[1, 2, "3", 4]), "bbox .* is not 4 finite numbers"),
        (_first_ann(area=None), "area None"),
    ],
)  # fmt: skip
def test_malformed_files_are_one_line(tmp_path, root, edit, match):
    new = _variant(tmp_path, root, edit, split="val")
    _raises(match, lambda: load_coco_split(new, "val"), "instances_val2017.json")


def test_missing_files_are_one_line(tmp_path, root):
    new = _variant(tmp_path, root)
    (new / "annotations" / "instances_val2017.json").unlink()
    _raises("not found", lambda: load_coco_split(new, "val"), "instances_val2017.json")
    (new / "train2017").unlink()
    _raises("not found", lambda: load_coco_split(new, "train"), "train2017")
    _raises("no annotations/ folder", lambda: load_coco_split(new / "annotations", "train"))
    _raises("needs --data-dir", lambda: load_coco_split(None, "train"))


def test_a_missing_image_is_reported_when_read(tmp_path, root):
    def add(data):
        data["images"].append({"id": 4242, "file_name": "gone.png", "height": 64, "width": 80})

    val = load_coco_split(_variant(tmp_path, root, add, split="val"), "val")
    i = val.image_ids.index(4242)
    _raises("no such image file", lambda: read_detection_sample(val, i), "gone.png")


def test_loaders_leave_the_global_rng_alone(tmp_path):
    """Starting an iteration must not draw from torch's global RNG (drop path and dropout draw
    from it): a run resumed mid-epoch starts one more iteration than an uninterrupted one."""
    from seg_fixtures import write_seg_set

    from lgvit.data.segmentation import SegAugment, SegEvalLoader, SegTrainLoader, load_seg_split

    split = load_coco_split(write_coco_set(tmp_path / "c", n_train=8, n_val=2), "train")
    seg = load_seg_split("segfolder", write_seg_set(tmp_path / "s", n_train=8, n_val=2), "train")
    loaders = [
        DetTrainLoader(split, 2, 0, workers=0),
        DetEvalLoader(split, workers=0),
        SegTrainLoader(seg, SegAugment(crop=32, scale=(64, 48)), 2, 0, workers=0),
        SegEvalLoader(seg, (64, 48), workers=0),
    ]
    for loader in loaders:
        torch.manual_seed(0)
        expected = torch.rand(1)
        torch.manual_seed(0)
        next(iter(loader))
        assert torch.equal(torch.rand(1), expected), type(loader).__name__
