"""A real-image segmentation set for CPU runs: CIFAR-10 objects pasted on textured backgrounds.

Each image is a ``H x W`` canvas of smooth coloured noise (class 0, ``background``) with 2-4
CIFAR-10 images pasted at random places and sizes (32-56 px, bilinear); every pasted square is
labelled with its CIFAR class (1..10). Training images use CIFAR's train split, validation
images its test split. Written in ADE20K's layout for ``--data segfolder``::

    OUT/images/{training,validation}/NNNNNN.jpg  OUT/annotations/.../NNNNNN.png  OUT/classes.txt

    python benchmarks/make_cifar_mosaic.py ../shared/data/cifar10-jpeg.tar.gz /tmp/cifar_mosaic \
        --train 4000 --val 500
"""

from __future__ import annotations

import argparse
import io
import tarfile
from pathlib import Path

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


def mosaic(
    rng: np.random.Generator, objects: list[tuple[np.ndarray, int]], h: int, w: int
) -> tuple[np.ndarray, np.ndarray]:
    img = canvas(rng, h, w)
    mask = np.zeros((h, w), dtype=np.uint8)
    for _ in range(int(rng.integers(2, 5))):
        obj, cls = objects[int(rng.integers(len(objects)))]
        s = int(rng.integers(32, 57))
        top, left = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
        patch = np.asarray(Image.fromarray(obj).resize((s, s), Image.Resampling.BILINEAR))
        img[top : top + s, left : left + s] = patch
        mask[top : top + s, left : left + s] = cls + 1
    return img, mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("archive", type=Path, help="cifar10-jpeg.tar.gz (image-folder layout)")
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--val", type=int, default=500)
    p.add_argument("--size", type=int, nargs=2, default=(96, 128), metavar=("H", "W"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cifar = read_cifar(args.archive)
    rng = np.random.default_rng(args.seed)
    for split, source, n in (("training", "train", args.train), ("validation", "test", args.val)):
        (args.out / "images" / split).mkdir(parents=True, exist_ok=True)
        (args.out / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img, mask = mosaic(rng, cifar[source], *args.size)
            Image.fromarray(img).save(args.out / "images" / split / f"{i:06d}.jpg", quality=95)
            Image.fromarray(mask).save(args.out / "annotations" / split / f"{i:06d}.png")
    (args.out / "classes.txt").write_text("\n".join(("background", *CLASSES)) + "\n")
    print(f"{args.out}: {args.train} training and {args.val} validation images")


if __name__ == "__main__":
    main()
