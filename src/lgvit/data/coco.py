"""COCO-format object detection / instance segmentation data, as mmdetection 2.11's
``CocoDataset`` reads it, for torchvision's RetinaNet and Mask R-CNN.

Layout (``--data coco --data-dir ROOT``; a folder, or a ``.tar.gz`` of one)::

    ROOT/annotations/instances_{train,val}2017.json   ROOT/{train,val}2017/*.jpg

Training keeps the images with at least one annotation (crowd ones count) and a short side of
32 pixels or more (mmdet's ``_filter_imgs``); evaluation keeps every image. Per image, the
annotations mmdet would skip are skipped (ignored, empty, no overlap with the image), boxes
become ``[x, y, x + w, y + h]`` and crowd boxes are kept apart (mmdet's ``gt_bboxes_ignore``).
Training flips horizontally (0.5) and resizes nothing: torchvision's detector transform resizes
and normalises on the device, so images stay uint8 here.

An annotation file is checked once, when it is loaded (``_check``): every field's type and
range, each error one line naming the file, the image or annotation id and the field. Ids are
ints; an image's ``file_name`` a relative path inside the split's folder, no two images the
same file; ``height``/``width`` positive ints (``480.0`` is refused, as every other integer
field); a ``bbox`` 4 finite numbers, ``area`` a finite number; ``iscrowd`` 0 or 1, and a
missing one is 0 (COCO's meaning of its absence), written into the parsed data so COCOeval
reads it too; ``ignore``, where present, 0/1/true/false; a ``segmentation`` polygons of an
even count of finite numbers, or an RLE of the image's size whose counts cover exactly its
pixels (pycocotools would decode a shorter one into uninitialised memory). Bad images are
counted and stop training above ``max_bad_fraction``, as classification's
(:class:`DetTrainLoader`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lgvit.core.constants import DECODE_WORKERS, MAX_BAD_FRACTION
from lgvit.core.errors import LgvitError, refuse_deep_nesting
from lgvit.data.decode import read_image_rgb
from lgvit.data.segmentation import (
    EpochLoader,
    _Items,
    _keep,
    own_generator,
    pins,
    sample_rng,
)

COCO_DATASETS = ("coco",)
# The LIT authors' mmdet configs: images resized to fit (long, short) sides 1333 x 800.
DET_SCALE = (1333, 800)
MIN_SIZE = 32  # mmdet's _filter_imgs: training images with a shorter side are dropped
_SPLITS = ("train", "val")
# COCO 2017's 80 categories (instances_*2017.json), in id order: what a detector trained on COCO
# (the authors' released checkpoints) means by its classes 0..79.
COCO_CLASSES = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)
COCO_CAT_IDS = (
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
    21,
    22,
    23,
    24,
    25,
    27,
    28,
    31,
    32,
    33,
    34,
    35,
    36,
    37,
    38,
    39,
    40,
    41,
    42,
    43,
    44,
    46,
    47,
    48,
    49,
    50,
    51,
    52,
    53,
    54,
    55,
    56,
    57,
    58,
    59,
    60,
    61,
    62,
    63,
    64,
    65,
    67,
    70,
    72,
    73,
    74,
    75,
    76,
    77,
    78,
    79,
    80,
    81,
    82,
    84,
    85,
    86,
    87,
    88,
    89,
    90,
)


@dataclass
class CocoSplit:
    """One split: the kept images (sorted by id), their files and sizes, the categories."""

    root: Path
    ann_file: Path
    coco: Any  # pycocotools.coco.COCO, for COCOeval
    image_ids: list[int]
    files: list[Path]
    sizes: list[tuple[int, int]]  # (height, width), from the JSON
    cat_ids: list[int]  # label i <-> cat_ids[i]
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.image_ids)


# --------------------------------------------------------------------------------- files


def _coco_root(data_dir: str | os.PathLike, cache_dir: str | os.PathLike | None) -> Path:
    """The folder holding ``annotations/`` (an archive extracted once, a wrapper looked into)."""
    from lgvit.data.segmentation import dataset_root

    layout = ("annotations/instances_train2017.json, train2017/, "
              "annotations/instances_val2017.json and val2017/, COCO's layout")  # fmt: skip
    return dataset_root(data_dir, cache_dir, "annotations", layout)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LgvitError(f"{path}: not found (COCO's instances_<split>2017.json)")
    try:
        with open(path, "rb") as f, refuse_deep_nesting(str(path), "JSON"):
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise LgvitError(f"{path}: not JSON (line {e.lineno}, column {e.colno})") from None
    except (UnicodeDecodeError, OSError) as e:
        raise LgvitError(f"{path}: not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise LgvitError(f"{path}: a JSON {type(data).__name__}, not a COCO annotation object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise LgvitError(f'{path}: no "{key}" list (not a COCO instances file)')
    return data


# Exact types (JSON's), not isinstance: a bool is an int to isinstance. Checked per field of
# every annotation, so kept cheap.
def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _int(x: Any) -> bool:
    return type(x) is int


def _short(x: Any) -> str:
    """A field's value in a message: its repr, cut (a message is one line)."""
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _ids(path: Path, items: list[Any], what: str, keys: tuple[str, ...]) -> set[int]:
    """The ids of ``images`` or ``categories``; each needs ``keys``, ids are unique ints."""
    ids: set[int] = set()
    for k, item in enumerate(items):
        if not isinstance(item, dict) or not _int(item.get("id")):
            raise LgvitError(f'{path}: {what}[{k}] has no integer "id"')
        missing = [key for key in keys if key not in item]
        if missing:
            raise LgvitError(f'{path}: {what} id {item["id"]} has no "{missing[0]}"')
        if item["id"] in ids:
            raise LgvitError(f"{path}: {what} id {item['id']} appears twice")
        ids.add(item["id"])
    return ids


def _check_file_name(where: str, name: Any) -> str:
    """A relative path inside the split's image folder; returns it normalised (for duplicates)."""
    if not isinstance(name, str) or not name.strip():
        raise LgvitError(f"{where}: file_name {_short(name)} is not a non-empty string")
    parts = name.replace("\\", "/").split("/")
    if name[0] in "/\\" or os.path.splitdrive(name)[0] or ".." in parts or "\0" in name:
        raise LgvitError(f"{where}: file_name {_short(name)} is not a path inside the image folder")
    return os.path.normpath(name.replace("\\", "/"))


def _check_images(path: Path, images: list[Any]) -> dict[int, tuple[int, int]]:
    """Each image's (height, width): positive ints (COCO's; 480.0 is refused rather than
    guessed at, as every other integer field), its file one of its own."""
    _ids(path, images, "images", ("file_name", "height", "width"))
    sizes: dict[int, tuple[int, int]] = {}
    owner: dict[str, int] = {}
    for img in images:
        where = f"{path}: image id {img['id']}"
        h, w = img["height"], img["width"]
        if not (_int(h) and _int(w) and h > 0 and w > 0):
            raise LgvitError(f"{where}: height/width {_short(h)}/{_short(w)} are not positive "
                             "integers")  # fmt: skip
        name = _check_file_name(where, img["file_name"])
        if owner.setdefault(name, img["id"]) != img["id"]:
            raise LgvitError(f"{where}: file_name {img['file_name']!r} is image id "
                             f"{owner[name]}'s too")  # fmt: skip
        sizes[img["id"]] = (h, w)
    return sizes


def _compressed_total(counts: str) -> int | None:
    """The pixels a compressed RLE string covers, or None when it is not one. The format is
    pycocotools': 6 bits a character from '0' (5 of value, 1 "more"), a number's last
    character's 0x10 bit its sign, and each count after the third a difference to the count
    two before. A count that does not fit would overrun or leave uninitialised pycocotools'
    mask buffer, so it is checked here rather than left to the decoder."""
    values: list[int] = []
    x = k = 0
    for ch in counts:
        c = ord(ch) - 48
        if not 0 <= c < 64:
            return None
        x |= (c & 0x1F) << (5 * k)
        k += 1
        if c & 0x20:
            continue
        if c & 0x10:
            x -= 1 << (5 * k)
        if len(values) > 2:
            x += values[-2]
        if x < 0:
            return None
        values.append(x)
        x = k = 0
    return None if k else sum(values)


def _segmentation_problem(segm: Any, h: int, w: int) -> str | None:
    """What is wrong with a ``segmentation``, or None: polygons (lists of an even count of
    finite numbers) or an RLE of the image's size whose counts cover exactly h * w pixels
    (pycocotools decodes a shorter one into uninitialised memory, different at each decode,
    and writes past the mask for a longer one)."""
    if isinstance(segm, list):
        for j, poly in enumerate(segm):
            try:  # sum() is the fast check: a string or a list inside fails, NaN/inf stay
                finite = isinstance(poly, list) and math.isfinite(sum(poly))
            except (TypeError, OverflowError):
                finite = False
            if not finite or len(poly) % 2:
                return f"segmentation polygon {j} is not an even count of finite numbers"
        return None
    if not (isinstance(segm, dict) and "counts" in segm and "size" in segm):
        return (f"segmentation {_short(segm)} is neither a list of polygons nor an RLE "
                '{"counts", "size"}')  # fmt: skip
    size, counts = segm["size"], segm["counts"]
    if not (isinstance(size, list) and len(size) == 2 and all(map(_int, size))
            and size == [h, w]):  # fmt: skip
        return f"RLE size {_short(size)} is not the image's [{h}, {w}]"
    if isinstance(counts, str):
        total = _compressed_total(counts)
        if total is None:
            return f"RLE counts {_short(counts)} are not a compressed RLE"
    elif isinstance(counts, list) and all(type(c) is int for c in counts):
        if min(counts, default=0) < 0:
            return "RLE counts hold a negative count"
        total = sum(counts)
    else:
        return "RLE counts are neither a string nor a list of integers"
    if total != h * w:
        return f"RLE counts cover {total} pixels, the image has {h}x{w} = {h * w}"
    return None


def _annotation_problem(
    ann: dict[str, Any], sizes: dict[int, tuple[int, int]], cat_ids: set[int]
) -> str | None:
    """What is wrong with one annotation, or None (its message is built only then: COCO's
    train2017 has 860k annotations)."""
    for key, known, what in (("image_id", sizes, "images"),
                             ("category_id", cat_ids, "categories")):  # fmt: skip
        if not _int(ann.get(key)) or ann[key] not in known:
            return f"{key} {_short(ann.get(key))} is not in {what}"
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(type(v) in (int, float) for v in box)
            and math.isfinite(sum(box))):  # fmt: skip
        return f"bbox {_short(box)} is not 4 finite numbers [x, y, w, h]"
    if not _number(ann.get("area")):
        return f"area {_short(ann.get('area'))} is not a finite number"
    # Absent means not a crowd (COCO's meaning); filled in so that COCOeval, which reads it
    # with int(), sees it too. Anything but 0/1 is refused: "0" is a crowd in training (a
    # non-empty string) and not one in COCOeval (int("0")).
    crowd = ann.setdefault("iscrowd", 0)
    if not (_int(crowd) and crowd in (0, 1)):
        return f"iscrowd {_short(crowd)} is not 0 or 1"
    if "ignore" in ann and not (ann["ignore"] in (0, 1) and isinstance(ann["ignore"], int)):
        return f"ignore {_short(ann['ignore'])} is not 0, 1, true or false"
    if "segmentation" in ann:
        return _segmentation_problem(ann["segmentation"], *sizes[ann["image_id"]])
    return None


def _check(path: Path, data: dict[str, Any]) -> None:
    """The one validation pass over a file, before anything reads it: every field's type and
    range (images, categories, annotations: ids, references, boxes, areas, ``iscrowd``,
    segmentations' structure), each error one line naming the file, the id and the field. A
    missing ``iscrowd`` is set to 0 in ``data``."""
    sizes = _check_images(path, data["images"])
    cat_ids = _ids(path, data["categories"], "categories", ("name",))
    if not cat_ids:
        raise LgvitError(f'{path}: "categories" is empty')
    for cat in data["categories"]:
        if not isinstance(cat["name"], str) or not cat["name"].strip():
            raise LgvitError(f"{path}: category id {cat['id']}: name {_short(cat['name'])} is "
                             "not a non-empty string")  # fmt: skip
    seen: set[int] = set()
    for k, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or not _int(ann.get("id")):
            raise LgvitError(f'{path}: annotations[{k}] has no integer "id"')
        if ann["id"] in seen:  # pycocotools indexes by id: COCOeval would score one twice
            raise LgvitError(f"{path}: annotation id {ann['id']} appears twice")
        seen.add(ann["id"])
        problem = _annotation_problem(ann, sizes, cat_ids)
        if problem:
            image = ann.get("image_id")
            image = f" (image id {image})" if _int(image) and image in sizes else ""
            raise LgvitError(f"{path}: annotation id {ann['id']}{image}: {problem}")


def require_masks(split: CocoSplit) -> None:
    """Every annotation has a ``segmentation`` (Mask R-CNN trains on them, COCOeval's segm
    reads every one); boxes-only files are fine for RetinaNet."""
    for ann in split.coco.dataset["annotations"]:
        if "segmentation" not in ann:
            raise LgvitError(
                f"{split.ann_file}: annotation id {ann['id']} (image id {ann['image_id']}) has "
                'no "segmentation" (Mask R-CNN needs one for every annotation)'
            )


def _index(data: dict[str, Any]) -> Any:
    """A pycocotools COCO object over the parsed file (it prints while indexing: silenced)."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = data
        coco.createIndex()
    return coco


def require_pycocotools() -> None:
    """COCO's annotations and COCOeval are pycocotools' (``pip install "lgvit[coco]"``)."""
    import importlib.util

    if importlib.util.find_spec("pycocotools") is None:
        raise LgvitError("COCO data and COCOeval need pycocotools: pip install pycocotools")


def load_coco_split(
    data_dir: str | os.PathLike | None, split: str, cache_dir: str | os.PathLike | None = None,
    *, train: bool | None = None,
) -> CocoSplit:  # fmt: skip
    """The ``train`` or ``val`` split. ``train`` (default: ``split == "train"``) keeps only the
    images mmdet trains on: at least one annotation and a short side of ``MIN_SIZE`` or more."""
    if split not in _SPLITS:
        raise LgvitError(f"COCO split {split!r}: expected one of {', '.join(_SPLITS)}")
    if data_dir is None:
        raise LgvitError("--data coco needs --data-dir (nothing is downloaded)")
    require_pycocotools()
    train = split == "train" if train is None else train
    root = _coco_root(data_dir, cache_dir)
    ann_file = root / "annotations" / f"instances_{split}2017.json"
    img_dir = root / f"{split}2017"
    data = _read_json(ann_file)
    _check(ann_file, data)
    if not img_dir.is_dir():
        raise LgvitError(f"{img_dir}: not found (the images of {ann_file.name})")
    coco = _index(data)
    with_ann = {a["image_id"] for a in data["annotations"]}  # crowd ones count, as in mmdet
    ids = []
    for i in sorted(coco.imgs):
        h, w = coco.imgs[i]["height"], coco.imgs[i]["width"]
        if not train or (i in with_ann and min(h, w) >= MIN_SIZE):
            ids.append(i)
    if not ids:
        kept = f"annotated and at least {MIN_SIZE} pixels a side" if train else "listed"
        raise LgvitError(f"{ann_file}: no images {kept}")
    cat_ids = sorted(coco.cats)
    return CocoSplit(
        root=img_dir, ann_file=ann_file, coco=coco, image_ids=ids,
        files=[img_dir / coco.imgs[i]["file_name"] for i in ids],
        sizes=[(int(coco.imgs[i]["height"]), int(coco.imgs[i]["width"])) for i in ids],
        cat_ids=cat_ids, classes=tuple(str(coco.cats[c]["name"]) for c in cat_ids),
    )  # fmt: skip


# --------------------------------------------------------------------------------- samples


def _decode_mask(split: CocoSplit, index: int, ann: dict[str, Any]) -> np.ndarray:
    """mmdet's ``_poly2mask``: polygons (merged), uncompressed or compressed RLE, as
    ``(H, W)`` uint8 at the JSON's image size; polygons of fewer than 3 points are dropped."""
    from pycocotools import mask as mask_utils

    h, w = split.sizes[index]
    segm = ann.get("segmentation")
    where = f"{split.ann_file}: annotation id {ann['id']} (image id {split.image_ids[index]})"
    try:
        if isinstance(segm, list):
            polys = [p for p in segm if isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0]
            if not polys:
                return np.zeros((h, w), dtype=np.uint8)
            rle = mask_utils.merge(mask_utils.frPyObjects(polys, h, w))
        elif isinstance(segm, dict) and isinstance(segm.get("counts"), list):
            rle = mask_utils.frPyObjects(segm, h, w)
        elif isinstance(segm, dict):
            rle = segm
        else:
            raise TypeError(type(segm).__name__)
        with warnings.catch_warnings():  # pycocotools' numpy 2 DeprecationWarning, per mask
            warnings.simplefilter("ignore", DeprecationWarning)
            m = mask_utils.decode(rle)
    except Exception as e:  # noqa: BLE001 -- pycocotools raises many types on bad input
        raise LgvitError(f"{where}: segmentation is not readable ({type(e).__name__})") from None
    if m.shape != (h, w):
        raise LgvitError(f"{where}: segmentation is {m.shape[0]}x{m.shape[1]}, image is {h}x{w}")
    return np.ascontiguousarray(m, dtype=np.uint8)


def annotations(split: CocoSplit, index: int, with_masks: bool = False) -> dict[str, Any]:
    """mmdet 2.11's ``CocoDataset._parse_ann_info`` for image ``index``: ``boxes`` float32
    ``(N, 4)`` xyxy, ``labels`` int64 ``(N,)`` 0-based, ``crowd_boxes`` float32 ``(M, 4)`` and,
    with ``with_masks``, ``masks`` uint8 ``(N, H, W)`` (numpy arrays)."""
    h, w = split.sizes[index]
    label = {c: i for i, c in enumerate(split.cat_ids)}
    boxes, labels, crowd, masks = [], [], [], []
    for ann in split.coco.imgToAnns.get(split.image_ids[index], []):
        if ann.get("ignore", False):
            continue
        x, y, bw, bh = ann["bbox"]
        inter_w = max(0, min(x + bw, w) - max(x, 0))
        inter_h = max(0, min(y + bh, h) - max(y, 0))
        if inter_w * inter_h == 0 or ann["area"] <= 0 or bw < 1 or bh < 1:
            continue
        if ann["category_id"] not in label:
            continue
        box = [x, y, x + bw, y + bh]
        if ann.get("iscrowd", False):
            crowd.append(box)
            continue
        boxes.append(box)
        labels.append(label[ann["category_id"]])
        if with_masks:
            masks.append(_decode_mask(split, index, ann))
    out = {
        "boxes": np.array(boxes, dtype=np.float32).reshape(-1, 4),
        "labels": np.array(labels, dtype=np.int64),
        "crowd_boxes": np.array(crowd, dtype=np.float32).reshape(-1, 4),
    }
    if with_masks:
        out["masks"] = np.stack(masks) if masks else np.zeros((0, h, w), dtype=np.uint8)
    return out


def _read_image(split: CocoSplit, index: int) -> torch.Tensor:
    """The image as uint8 ``(3, H, W)``; LgvitError when unreadable or not the JSON's size."""
    img = read_image_rgb(split.files[index])
    h, w = split.sizes[index]
    if tuple(img.shape[-2:]) != (h, w):
        raise LgvitError(
            f"{split.files[index]}: image is {img.shape[-2]}x{img.shape[-1]} but "
            f"{split.ann_file.name} says {h}x{w} (image id {split.image_ids[index]})"
        )
    return img


def read_detection_sample(
    split: CocoSplit, index: int, with_masks: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Image uint8 ``(3, H, W)`` and its :func:`annotations` as tensors."""
    img = _read_image(split, index)
    ann = annotations(split, index, with_masks)
    return img, {k: torch.from_numpy(v) for k, v in ann.items()}


# --------------------------------------------------------------------------------- loaders


class _TrainSet(torch.utils.data.Dataset):
    def __init__(self, split: CocoSplit, seed: int, with_masks: bool, hflip: float) -> None:
        self.split, self.seed, self.with_masks, self.hflip = split, seed, with_masks, hflip
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> Any:
        try:
            img, ann = read_detection_sample(self.split, i, self.with_masks)
        except LgvitError as e:  # kept by the main process, as one line
            return str(e)
        h, w = img.shape[-2:]
        boxes = ann["boxes"]
        # mmdet's Resize clips boxes to the image (bbox_clip_border); no resizing here.
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        target = {"boxes": boxes, "labels": ann["labels"]}
        if self.with_masks:
            target["masks"] = ann["masks"]
        if sample_rng(self.seed, self.epoch, i).random() < self.hflip:
            img = img.flip(-1)
            target["boxes"] = torch.stack(
                [w - boxes[:, 2], boxes[:, 1], w - boxes[:, 0], boxes[:, 3]], dim=1
            )
            if self.with_masks:
                target["masks"] = target["masks"].flip(-1)
        return img.contiguous(), {k: v.contiguous() for k, v in target.items()}


def missing_files(
    split: CocoSplit, max_bad_fraction: float, what: str = "training"
) -> tuple[list[int], list[str]]:  # fmt: skip
    """The images whose files are missing (one directory listing per folder, not a stat per
    file: COCO's train2017 has 118k; a name not listed is looked up, for case-insensitive file
    systems), and a line saying so when there are any. More than ``max_bad_fraction`` of
    them, or all: one line, as classification's unreadable images."""
    listed: dict[Path, set[str]] = {}
    missing = []
    for i, f in enumerate(split.files):
        if f.parent not in listed:
            try:
                listed[f.parent] = set(os.listdir(f.parent))
            except OSError:
                listed[f.parent] = set()
        if f.name not in listed[f.parent] and not f.exists():  # exists(): a case-blind disk
            missing.append(i)
    if not missing:
        return [], []
    n, total = len(missing), len(split)
    shown = ", ".join(str(split.files[i]) for i in missing[:3])
    if n == total:
        raise LgvitError(f"none of the {total} {what} images of {split.ann_file} exists, e.g. "
                         f"{shown}")  # fmt: skip
    if n / total > max_bad_fraction:
        raise LgvitError(
            f"{n} of the {total} {what} images of {split.ann_file} are missing ({n / total:.1%} "
            f"> max_bad_fraction {max_bad_fraction:.1%}), e.g. {shown}"
        )
    note = f"{n} of the {total} {what} images are missing ({n / total:.1%}), e.g. {shown}"
    return missing, [note]


class DetTrainLoader(EpochLoader):
    """Batches ``(images: list of uint8 (3, H, W), targets: list of {"boxes", "labels"[,
    "masks"]})`` of one process's share, in the engine's loader contract: every sample depends
    only on (seed, epoch, image), so ``set_epoch(epoch, batch)`` continues an epoch exactly.

    Order (mmdet's GroupSampler idea): landscape (w > h) and other images are shuffled apart,
    cut into global batches of ``batch_size * world`` inside a group, and the batches shuffled;
    rank r takes its ``batch_size`` slice of each. A group's leftover images that do not fill a
    global batch are dropped for the epoch (another draw next epoch).

    Bad images are counted, reported and stop the run above ``max_bad_fraction``, as
    classification's: missing files when the loader is made (left out; ``notes`` says so), an
    image that cannot be used when it is read (undecodable, not the JSON's size, a mask that
    does not decode) left out of its batch, its message kept in ``skipped`` (this epoch's), a
    batch with none left skipped; more than ``max_bad_fraction`` of the images read so far
    (of at least 100, as classification's streaming loader) or of the whole epoch, or every
    image of it, is one line. An epoch that skipped some warns with the count. Pinned for a
    CUDA ``device``.
    """

    def __init__(
        self, split: CocoSplit, batch_size: int, seed: int, rank: int = 0, world: int = 1,
        workers: int = DECODE_WORKERS, with_masks: bool = False, hflip: float = 0.5,
        max_bad_fraction: float = MAX_BAD_FRACTION, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        self.set = _TrainSet(split, seed, with_masks, hflip)
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.workers, self.max_bad_fraction = workers, max_bad_fraction
        self.pin = pins(device)
        missing, self.notes = missing_files(split, max_bad_fraction)
        gone = set(missing)
        kept = [(i, hw) for i, hw in enumerate(split.sizes) if i not in gone]
        wide = [i for i, (h, w) in kept if w > h]
        other = [i for i, (h, w) in kept if w <= h]
        self.groups = [g for g in (other, wide) if g]
        per = batch_size * world
        self.steps = sum(len(g) // per for g in self.groups)
        if self.steps == 0:
            raise LgvitError(
                f"{len(kept)} training images are fewer than one global batch of one "
                f"orientation ({batch_size} x {world}); lower --batch-size"
            )
        self.epoch, self.start = 0, 0
        self.skipped: list[str] = []

    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches (image indices), all processes' shares in rank order."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        per = self.batch_size * self.world
        batches = []
        for group in self.groups:
            order = [group[k] for k in torch.randperm(len(group), generator=g).tolist()]
            batches += [order[s : s + per] for s in range(0, len(order) - per + 1, per)]
        return [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]

    def __iter__(self) -> Iterator[tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]]:
        b, r = self.batch_size, self.rank
        batches = [gb[r * b : (r + 1) * b] for gb in self.global_batches()[self.start :]]
        self.skipped, seen = [], 0
        for items in self._items(batches):
            good = []
            for item in items:
                if isinstance(item, str):
                    self.skipped.append(item)
                else:
                    good.append(item)
            seen += len(items)
            self._check_bad(seen, end=False)
            if good:
                yield [i[0] for i in good], [i[1] for i in good]
        self._check_bad(seen, end=True)

    def _check_bad(self, seen: int, end: bool) -> None:
        """Stop (one line) above ``max_bad_fraction``: during the epoch once 100 images are
        read (a few bad ones first must not stop a large set), at its end of all it read."""
        bad = len(self.skipped)
        if not bad:
            return
        epoch = f"epoch {self.epoch + 1}"
        if bad > self.max_bad_fraction * (seen if end else max(seen, 100)) or (end and bad == seen):
            raise LgvitError(
                f"{bad} of the {seen} training images read in {epoch} could not be used "
                f"(more than max_bad_fraction {self.max_bad_fraction:.1%}), e.g. "
                f"{self.skipped[0]}"
            )
        if end:
            warnings.warn(
                f"{epoch}: skipped {bad} training image(s) of {seen} that could not be used "
                f"({bad / seen:.1%}), e.g. {self.skipped[0]}",
                stacklevel=2,
            )


class DetEvalLoader:
    """One image at a time, whole: ``(image uint8 (3, H, W), image_id)``; process ``rank``
    takes every ``world``-th image. An unreadable image is ``(None, image_id)`` (its message
    kept in ``skipped``, the pass's): the caller counts it and names it. With
    ``max_bad_fraction`` (a training run's), missing files are counted first, as the training
    loader's, and ``notes`` says so (they stay in: COCOeval scores every image). Pinned for
    a CUDA ``device``."""

    def __init__(
        self, split: CocoSplit, rank: int = 0, world: int = 1, workers: int = DECODE_WORKERS,
        max_bad_fraction: float | None = None, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        self.split, self.rank, self.world, self.workers = split, rank, world, workers
        self.pin = pins(device)
        self.indices = list(range(rank, len(split), world))
        self.skipped: list[str] = []
        self.notes: list[str] = []
        if max_bad_fraction is not None:
            self.notes = missing_files(split, max_bad_fraction, "validation")[1]

    def __len__(self) -> int:
        return len(self.indices)

    def _item(self, i: int) -> tuple[Any, int]:
        try:
            return _read_image(self.split, i), self.split.image_ids[i]
        except LgvitError as e:
            return str(e), self.split.image_ids[i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, int]]:
        loader = torch.utils.data.DataLoader(
            _Items(self._item, self.indices), batch_size=1, num_workers=self.workers,
            collate_fn=_keep, pin_memory=self.pin, generator=own_generator(),
        )  # fmt: skip
        self.skipped = []
        for items in loader:
            img, image_id = items[0]
            if isinstance(img, str):
                self.skipped.append(img)
                img = None
            yield img, image_id
