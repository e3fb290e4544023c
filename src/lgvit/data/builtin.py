"""Datasets that need no files: scikit-learn's bundled digits, and seeded synthetic images."""

from __future__ import annotations

import numpy as np
import torch

from lgvit.core.errors import LgvitError
from lgvit.data.splits import DatasetSplits, ImageSet

__all__ = ["DIGITS_TEST", "load_digits", "load_synthetic"]

DIGITS_TEST = 300  # of 1,797: 1,497 train / 300 test


def _digits_split(labels: np.ndarray, n_test: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split with a fixed seed (0): each class gives its share of ``n_test``
    (largest-remainder rounding, so the total is exact), picked by a seeded permutation."""
    rng = np.random.default_rng(0)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * n_test / len(labels)
    take = np.floor(quota).astype(int)
    order = np.argsort(-(quota - take), kind="stable")
    take[order[: n_test - take.sum()]] += 1
    test = np.concatenate(
        [
            rng.permutation(np.flatnonzero(labels == c))[:k]
            for c, k in zip(classes, take, strict=True)
        ]
    )
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[test] = True
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def load_digits(size: int) -> DatasetSplits:
    """scikit-learn's 8x8 digits (1,797 real images, no download) resized to ``size``."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as e:
        raise LgvitError(  # scikit-learn ships the digits; the demo extra installs it
            'the digits dataset needs scikit-learn: pip install "lgvit[demo]"'
        ) from e
    bunch = sklearn_digits()
    raw = np.asarray(bunch.images, dtype=np.float64)  # (1797, 8, 8), values 0..16
    labels = np.asarray(bunch.target, dtype=np.int64)
    x = torch.from_numpy(np.rint(raw * (255.0 / 16.0)).astype(np.float32)).unsqueeze(1)
    if size != x.shape[-1]:
        x = torch.nn.functional.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False
        )
    images = x.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    train_idx, test_idx = _digits_split(labels, DIGITS_TEST)
    classes = [str(i) for i in range(10)]
    train_np = images[torch.from_numpy(train_idx)].numpy()
    # float64 numpy reductions are deterministic (torch's depend on the thread count).
    mean = float(train_np.mean(dtype=np.float64) / 255.0)
    std = float(train_np.std(dtype=np.float64) / 255.0)

    def subset(idx: np.ndarray) -> ImageSet:
        t = torch.from_numpy(idx)
        return ImageSet(images[t].contiguous(), torch.from_numpy(labels[idx]), list(classes))

    return DatasetSplits(
        train=subset(train_idx),
        test=subset(test_idx),
        name="digits",
        mean=(mean, mean, mean),
        std=(std, std, std),
        skipped=[],
    )


def load_synthetic(size: int, sizes: tuple[int, int], num_classes: int, seed: int) -> DatasetSplits:
    """Seeded random ``size`` x ``size`` images and labels: ``sizes`` = (train, test) counts."""
    n_train, n_test = sizes
    if n_train < 1 or n_test < 1:
        raise LgvitError(f"synthetic_size must be two positive counts, got {sizes}")
    if num_classes < 1:
        raise LgvitError(f"num_classes must be positive, got {num_classes}")
    gen = torch.Generator().manual_seed(seed)
    classes = [str(i) for i in range(num_classes)]

    def make(n: int) -> ImageSet:
        images = torch.randint(0, 256, (n, 3, size, size), generator=gen, dtype=torch.uint8)
        labels = torch.randint(0, num_classes, (n,), generator=gen, dtype=torch.int64)
        return ImageSet(images, labels, list(classes))

    return DatasetSplits(
        train=make(n_train),
        test=make(n_test),
        name="synthetic",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        skipped=[],
    )
