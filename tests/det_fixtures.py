"""Synthetic detection sets in COCO's layout, written by the tests: warm discs and cool squares
on textured backgrounds, with boxes, polygons, one crowd RLE and a few empty images."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

# Category ids deliberately not contiguous (as COCO's 1..90 for 80 classes).
CATEGORIES = ({"id": 3, "name": "disc"}, {"id": 7, "name": "square"})
DISC, SQUARE = 3, 7


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    base = rng.integers(40, 120, size=3)
    noise = rng.normal(0, 18, size=(h // 4 + 1, w // 4 + 1, 3)).repeat(4, 0).repeat(4, 1)
    return np.clip(base + noise[:h, :w], 0, 255)


def _place(rng: np.random.Generator, h: int, w: int, taken: list[list[int]]) -> list[int] | None:
    """A free [cx, cy, r] (no overlap with ``taken``), or None after a few tries."""
    short = min(h, w)
    for _ in range(20):
        r = int(rng.integers(short // 6, short // 3 + 1))
        cx, cy = int(rng.integers(r, w - r + 1)), int(rng.integers(r, h - r + 1))
        if all(abs(cx - x) >= r + q + 2 or abs(cy - y) >= r + q + 2 for x, y, q in taken):
            return [cx, cy, r]
    return None


def _object(img: np.ndarray, rng: np.random.Generator, kind: int, cx: int, cy: int, r: int):
    """Paint one object; its annotation fields (bbox, area, polygon)."""
    h, w = img.shape[:2]
    yy, xx = np.mgrid[:h, :w] + 0.5  # pixel centres
    if kind == DISC:
        t = np.arange(16) * 2 * math.pi / 16
        poly = np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1).ravel()
        inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        colour = (220, 60 + rng.integers(0, 40), 40)
        area = 0.5 * 16 * r * r * math.sin(2 * math.pi / 16)
    else:
        poly = np.array([cx - r, cy - r, cx + r, cy - r, cx + r, cy + r, cx - r, cy + r])
        inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
        colour = (40, 90 + rng.integers(0, 40), 230)
        area = float(4 * r * r)
    img[inside] = np.clip(np.array(colour) + rng.normal(0, 12, size=(inside.sum(), 3)), 0, 255)
    bbox = [float(cx - r), float(cy - r), float(2 * r), float(2 * r)]
    return {"bbox": bbox, "area": area, "segmentation": [[round(float(v), 2) for v in poly]]}


def rle_counts(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE of a binary mask: column-major runs, starting with zeros."""
    flat = mask.astype(np.uint8).ravel(order="F")
    change = np.flatnonzero(np.diff(flat)) + 1
    edges = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(edges).tolist()
    return [0, *counts] if flat[0] else counts


def _crowd(img: np.ndarray, rng: np.random.Generator, taken: list[list[int]]) -> dict | None:
    """A crowd of small warm dots in a free corner, as one iscrowd=1 RLE annotation."""
    h, w = img.shape[:2]
    s = min(h, w) // 4
    for y0, x0 in ((0, 0), (0, w - s), (h - s, 0), (h - s, w - s)):
        if all(x0 + s <= x - q or x0 >= x + q or y0 + s <= y - q or y0 >= y + q
               for x, y, q in taken):  # fmt: skip
            mask = np.zeros((h, w), dtype=np.uint8)
            yy, xx = np.mgrid[y0 : y0 + s, x0 : x0 + s]
            dots = ((yy % 4) < 2) & ((xx % 4) < 2)
            mask[y0 : y0 + s, x0 : x0 + s] = dots
            img[mask.astype(bool)] = (210, 80, 50) + rng.normal(0, 8, size=(int(mask.sum()), 3))
            return {
                "bbox": [float(x0), float(y0), float(s), float(s)], "area": float(mask.sum()),
                "iscrowd": 1, "segmentation": {"counts": rle_counts(mask), "size": [h, w]},
                "category_id": DISC,
            }  # fmt: skip
    return None


def write_coco_set(
    root: Path, n_train: int = 24, n_val: int = 8, size: tuple[int, int] = (64, 80),
    seed: int = 0, *, with_crowd: bool = True, empty: int = 2, jpeg: bool = False,
) -> Path:  # fmt: skip
    """``root/annotations/instances_{train,val}2017.json`` and ``root/{train,val}2017/``.

    Images are ``size`` (H, W), every third one turned (W, H); 1-3 objects each, the last
    ``empty`` training images none, the first training image also a crowd region (with
    ``with_crowd``). Image ids are not indices and the JSON lists images unsorted. PNG (lossless)
    unless ``jpeg``."""
    rng = np.random.default_rng(seed)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    ann_id = 1
    for split, n, first in (("train", n_train, 100), ("val", n_val, 500)):
        (root / f"{split}2017").mkdir(parents=True, exist_ok=True)
        images, anns = [], []
        for i in range(n):
            h, w = (size[1], size[0]) if i % 3 == 2 else size
            image_id = first + 3 * i
            name = f"{image_id:012d}.{'jpg' if jpeg else 'png'}"
            img = _background(rng, h, w)
            taken: list[list[int]] = []
            objects = []
            if not (split == "train" and i >= n - empty):
                for _ in range(int(rng.integers(1, 4))):
                    spot = _place(rng, h, w, taken)
                    if spot is not None:
                        kind = DISC if rng.random() < 0.5 else SQUARE
                        taken.append(spot)
                        objects.append({**_object(img, rng, kind, *spot), "category_id": kind,
                                        "iscrowd": 0})  # fmt: skip
                if split == "train" and i == 0 and with_crowd:
                    crowd = _crowd(img, rng, taken)
                    if crowd is not None:
                        objects.append(crowd)
            for obj in objects:
                anns.append({"id": ann_id, "image_id": image_id, **obj})
                ann_id += 1
            pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
            pil.save(root / f"{split}2017" / name, **({"quality": 95} if jpeg else {}))
            images.append({"id": image_id, "file_name": name, "height": h, "width": w})
        order = rng.permutation(len(images))
        data = {
            "info": {"description": "lgvit synthetic detection set"},
            "images": [images[k] for k in order], "annotations": anns,
            "categories": [dict(c, supercategory="shape") for c in CATEGORIES],
        }  # fmt: skip
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(data))
    return root
