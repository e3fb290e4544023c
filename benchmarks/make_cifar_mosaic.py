"""A real-image segmentation or detection set for CPU runs: CIFAR-10 objects pasted on textured
backgrounds.

Each image is a ``H x W`` canvas of smooth coloured noise (class 0, ``background``) with 2-4
CIFAR-10 images pasted at random places and sizes (32-56 px, bilinear); every pasted square is
labelled with its CIFAR class (1..10). Training images use CIFAR's train split, validation
images its test split. Written in ADE20K's layout for ``--data segfolder``::

    OUT/images/{training,validation}/NNNNNN.jpg  OUT/annotations/.../NNNNNN.png  OUT/classes.txt

    python benchmarks/make_cifar_mosaic.py PATH/cifar10-jpeg.tar.gz /tmp/cifar_mosaic \
        --train 4000 --val 500

With ``--coco``, the same images (same drawing, same seed) in COCO's detection layout instead::

    OUT/annotations/instances_{train,val}2017.json  OUT/{train,val}2017/NNNNNN.jpg

    python benchmarks/make_cifar_mosaic.py PATH/cifar10-jpeg.tar.gz /tmp/cifar_coco --coco

Categories 1..10 are the CIFAR classes; image ``id`` is the file's number + 1 (COCO ids start at
1). One annotation per pasted object still visible: its mask is the pixels of its paste not
covered by later pastes (compressed RLE), ``bbox`` that mask's ``[x, y, w, h]``, ``area`` its
pixel count, ``iscrowd`` 0; an object with less than a quarter of its square visible is dropped.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")  # fmt: skip


def read_cifar(archive: Path) -> dict[str, list[tuple[np.ndarray, int]]]:
    """{'train': [(32x32x3 uint8, class)], 'test': [...]} from the image-folder tarball."""
    out: dict[str, list[tuple[np.ndarray, int]]] = {"train": [], "test": []}
    with tarfile.open(archive) as tar:
        for m in tar:
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) < 4 or parts[-3] not in out:
                continue
            data = tar.extractfile(m).read()
            img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            out[parts[-3]].append((img, CLASSES.index(parts[-2])))
    return out


def canvas(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    base = rng.integers(30, 200, size=3)
    coarse = rng.normal(0, 25, size=(h // 8 + 2, w // 8 + 2, 3))
    noise = (
        np.asarray(
            Image.fromarray(np.clip(coarse + 128, 0, 255).astype(np.uint8)).resize(
                (w + 16, h + 16), Image.Resampling.BICUBIC
            )
        )[:h, :w].astype(np.float64)
        - 128
    )
    return np.clip(base + noise, 0, 255).astype(np.uint8)


class Paste(NamedTuple):
    """One pasted CIFAR image: its class (0..9) and its ``s x s`` square at ``(top, left)``."""

    cls: int
    top: int
    left: int
    s: int


def mosaic(
    rng: np.random.Generator, objects: list[tuple[np.ndarray, int]], h: int, w: int
) -> tuple[np.ndarray, np.ndarray, list[Paste]]:
    """Image, semantic mask (class + 1, 0 background) and the pastes in drawing order."""
    img = canvas(rng, h, w)
    mask = np.zeros((h, w), dtype=np.uint8)
    pastes: list[Paste] = []
    for _ in range(int(rng.integers(2, 5))):
        obj, cls = objects[int(rng.integers(len(objects)))]
        s = int(rng.integers(32, 57))
        top, left = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
        patch = np.asarray(Image.fromarray(obj).resize((s, s), Image.Resampling.BILINEAR))
        img[top : top + s, left : left + s] = patch
        mask[top : top + s, left : left + s] = cls + 1
        pastes.append(Paste(cls, top, left, s))
    return img, mask, pastes


MIN_VISIBLE = 0.25  # an object with less of its square showing is mostly hidden: no annotation


def instances(pastes: list[Paste], h: int, w: int) -> list[tuple[int, np.ndarray]]:
    """``(class, visible mask)`` of each paste not mostly covered by later ones."""
    owner = np.full((h, w), -1, dtype=np.int16)  # which paste is on top at each pixel
    for k, p in enumerate(pastes):
        owner[p.top : p.top + p.s, p.left : p.left + p.s] = k
    out = []
    for k, p in enumerate(pastes):
        visible = owner == k
        if visible.sum() >= MIN_VISIBLE * p.s * p.s:
            out.append((p.cls, visible.astype(np.uint8)))
    return out


def coco_annotation(mask: np.ndarray, cls: int, image_id: int, ann_id: int) -> dict:
    """One COCO instance: compressed RLE of ``mask``, its tight ``[x, y, w, h]`` and area."""
    from pycocotools import mask as mask_utils  # only the --coco path needs it

    rows, cols = np.nonzero(mask)
    x0, y0 = int(cols.min()), int(rows.min())
    rle = mask_utils.encode(np.asfortranarray(mask))
    rle["counts"] = rle["counts"].decode("ascii")  # bytes -> str for json
    return {
        "id": ann_id, "image_id": image_id, "category_id": cls + 1, "iscrowd": 0,
        "bbox": [x0, y0, int(cols.max()) - x0 + 1, int(rows.max()) - y0 + 1],
        "area": int(mask.sum()), "segmentation": rle,
    }  # fmt: skip


def write_coco(
    out: Path, split: str, rng: np.random.Generator, objects: list[tuple[np.ndarray, int]],
    n: int, h: int, w: int,
) -> int:  # fmt: skip
    """``n`` mosaics as ``out/{split}/NNNNNN.jpg`` and ``out/annotations/instances_{split}.json``;
    returns the number of annotations."""
    (out / split).mkdir(parents=True, exist_ok=True)
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    images, anns = [], []
    for i in range(n):
        img, _, pastes = mosaic(rng, objects, h, w)
        name = f"{i:06d}.jpg"
        Image.fromarray(img).save(out / split / name, quality=95)
        images.append({"id": i + 1, "file_name": name, "height": h, "width": w})
        for cls, visible in instances(pastes, h, w):
            anns.append(coco_annotation(visible, cls, i + 1, len(anns) + 1))  # ids from 1
    categories = [{"id": c + 1, "name": name, "supercategory": "cifar10"}
                  for c, name in enumerate(CLASSES)]  # fmt: skip
    coco = {"images": images, "annotations": anns, "categories": categories}
    (out / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return len(anns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("archive", type=Path, help="cifar10-jpeg.tar.gz (image-folder layout)")
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--val", type=int, default=500)
    p.add_argument("--size", type=int, nargs=2, default=(96, 128), metavar=("H", "W"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coco", action="store_true", help="write COCO detection layout instead")
    args = p.parse_args()
    cifar = read_cifar(args.archive)
    rng = np.random.default_rng(args.seed)
    if args.coco:
        for split, source, n in (("train2017", "train", args.train), ("val2017", "test", args.val)):
            k = write_coco(args.out, split, rng, cifar[source], n, *args.size)
            print(f"{args.out}/{split}: {n} images, {k} annotations")
        return
    for split, source, n in (("training", "train", args.train), ("validation", "test", args.val)):
        (args.out / "images" / split).mkdir(parents=True, exist_ok=True)
        (args.out / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img, mask, _ = mosaic(rng, cifar[source], *args.size)
            Image.fromarray(img).save(args.out / "images" / split / f"{i:06d}.jpg", quality=95)
            Image.fromarray(mask).save(args.out / "annotations" / split / f"{i:06d}.png")
    (args.out / "classes.txt").write_text("\n".join(("background", *CLASSES)) + "\n")
    print(f"{args.out}: {args.train} training and {args.val} validation images")


if __name__ == "__main__":
    main()
