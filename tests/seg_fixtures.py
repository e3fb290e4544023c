"""Synthetic segmentation sets in ADE20K's layout, written by the tests: discs and squares on
textured backgrounds, with their masks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("background", "disc", "square")


def _scene(rng: np.random.Generator, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    # Background: low-frequency coloured noise; label 0.
    base = rng.integers(40, 120, size=3)
    noise = rng.normal(0, 18, size=(h // 4 + 1, w // 4 + 1, 3)).repeat(4, 0).repeat(4, 1)
    img = np.clip(base + noise[:h, :w], 0, 255)
    mask = np.zeros((h, w), dtype=np.uint8)
    yy, xx = np.mgrid[:h, :w]
    for _ in range(rng.integers(1, 4)):
        kind = int(rng.integers(1, 3))
        r = int(rng.integers(min(h, w) // 8, min(h, w) // 3))
        cy, cx = int(rng.integers(r, h - r)), int(rng.integers(r, w - r))
        if kind == 1:
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            colour = (220, 60 + rng.integers(0, 40), 40)  # warm discs
        else:
            inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
            colour = (40, 90 + rng.integers(0, 40), 230)  # cool squares
        img[inside] = np.clip(np.array(colour) + rng.normal(0, 12, size=(inside.sum(), 3)), 0, 255)
        mask[inside] = kind
    return img.astype(np.uint8), mask


def write_seg_set(
    root: Path, n_train: int = 24, n_val: int = 8, size: tuple[int, int] = (48, 64),
    ade: bool = False, seed: int = 0,
) -> Path:  # fmt: skip
    """``root/images/{training,validation}/*.jpg`` (PNG when ``ade`` is False, lossless) and
    ``root/annotations/...png``. ``ade``: labels 1..3 with 0 "other" (ADE20K's convention),
    else 0..2 and ``classes.txt``."""
    rng = np.random.default_rng(seed)
    for split, n in (("training", n_train), ("validation", n_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            h = size[0] + int(rng.integers(0, 9))
            w = size[1] + int(rng.integers(0, 9))
            img, mask = _scene(rng, h, w)
            name = f"{split}_{i:04d}"
            suffix = ".jpg" if ade else ".png"
            Image.fromarray(img).save(root / "images" / split / f"{name}{suffix}")
            Image.fromarray(mask + 1 if ade else mask).save(
                root / "annotations" / split / f"{name}.png"
            )
    if not ade:
        (root / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    return root
