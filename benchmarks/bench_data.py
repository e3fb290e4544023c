"""Throughput of the batched DeiT training pipeline (lgvit.data.BatchLoader) on CPU.

Usage: python benchmarks/bench_data.py [--threads 2] [--n 10000] [--batch-size 64]

Prints per-op time per batch (crop/flip, RandAugment, normalize + random erasing,
mixup/cutmix) from a stage-by-stage pass, then the end-to-end img/s of iterating the loader.
Each measurement is the best of ``--repeats`` epochs, which filters out noise from other
processes on a shared machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from lgvit.data.loader import AugmentConfig, BatchLoader
from lgvit.data.transforms import (
    mean_to_fill,
    normalize,
    rand_augment,
    random_crop_flip,
    random_erasing,
)


def stage_times(loader: BatchLoader) -> dict[str, float]:
    """Seconds per epoch spent in each stage, replaying what BatchLoader does for a batch."""
    a, recipe = loader.aug, loader.recipe
    ra = recipe.rand_augment or {}
    gen = torch.Generator().manual_seed(0)
    times = dict.fromkeys(["gather", "crop/flip", "randaugment", "normalize+erasing", "mixup"], 0.0)
    idx_all = loader.indices()
    for s, e in recipe.batch_bounds(idx_all.numel()):
        t0 = time.perf_counter()
        idx = idx_all[s:e]
        x, y = loader.images[idx], loader.labels[idx]
        t1 = time.perf_counter()
        x = random_crop_flip(x, a.img_size, a.crop_padding, a.hflip, gen=gen)
        t2 = time.perf_counter()
        x = rand_augment(x, gen, fill=mean_to_fill(a.mean), **ra)
        t3 = time.perf_counter()
        x = random_erasing(normalize(x, a.mean, a.std), gen, prob=a.reprob, mode=a.remode)
        t4 = time.perf_counter()
        recipe.mix_batch(x, y, gen)  # the loader's own call: same mode and arguments
        t5 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[k] += dt
    return times


def epoch_time(loader: BatchLoader) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    for x, _ in loader:
        n += x.shape[0]
    return time.perf_counter() - t, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.n, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (args.n,), generator=g)
    loader = BatchLoader(
        images, labels, args.batch_size, num_classes=10, train=True, aug=AugmentConfig()
    )
    nb = len(loader)
    n_img = nb * args.batch_size

    # Interleave the two measurements so both see the same background load.
    best, total = None, float("inf")
    for _ in range(args.repeats):
        t = stage_times(loader)
        best = t if best is None else {k: min(best[k], t[k]) for k in t}
        total = min(total, epoch_time(loader)[0])

    print(
        f"BatchLoader train pipeline: {args.n} x 3x32x32 uint8, batch {args.batch_size}, "
        f"threads {torch.get_num_threads()}, recipe {AugmentConfig().rand_augment} + "
        "crop/flip + erasing 0.25 + mixup 0.8/cutmix 1.0 + smoothing 0.1"
    )
    print(f"{'stage':<20}{'ms/batch':>10}{'img/s':>12}")
    for k, v in best.items():
        print(f"{k:<20}{v / nb * 1e3:>10.3f}{n_img / v:>12.0f}")
    print(
        f"{'sum of stages':<20}{sum(best.values()) / nb * 1e3:>10.3f}"
        f"{n_img / sum(best.values()):>12.0f}"
    )
    print(f"{'total (loader)':<20}{total / nb * 1e3:>10.3f}{n_img / total:>12.0f}")


if __name__ == "__main__":
    main()
