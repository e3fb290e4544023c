"""Can the data path keep a GPU fed at 224 px? Decode + crop per worker, and the batched recipe.

Writes a synthetic ImageNet-style folder of JPEGs (photo-sized, 500x375 by default, smooth
content plus noise so they compress like photos), then measures on this CPU:

1. decode + RandomResizedCrop to 224 (what each DataLoader worker of the streaming path does),
   in one process: img/s per worker;
2. the streaming loader end to end with ``--workers`` processes (decode in the workers, flip in
   the main process);
3. the batched recipe on uint8 224 px batches in the main process (RandAugment
   rand-m9-mstd0.5-inc1, normalise, random erasing 0.25, mixup/cutmix): img/s on this CPU (on a
   GPU it runs on the device instead).

and prints how many decoding workers a training step at the papers' GPU rates needs. Training
throughput is taken as a third of the inference throughput the papers print (forward +
backward is about 3x a forward pass).

    python benchmarks/bench_pipeline_224.py --images 512 --workers 2
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lgvit.data.datasets import FileImageSet
from lgvit.data.loader import AugmentConfig, parse_rand_augment
from lgvit.data.stream import StreamingLoader, _DecodeBatches
from lgvit.data.transforms import (
    mean_to_fill,
    mixup_cutmix,
    normalize,
    rand_augment,
    random_erasing,
)
from lgvit.tools.measure import describe_machine

# The papers' GPU inference throughputs (img/s) of models trained with this recipe at 224 px.
PAPER_RATES = {
    "lit_ti (LIT paper, RTX 3090)": 1294,
    "lsa_tiny_224 (LSA paper, GPU not named)": 797,
}


def write_folder(root: Path, n: int, size: tuple[int, int], seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    paths = []
    for i in range(n):
        c = rng.uniform(0, 1, (3, 3))
        img = (
            c[:, 0, None, None] * 255 * (0.5 + 0.5 * np.sin(xx / rng.uniform(20, 80)))
            + c[:, 1, None, None] * 255 * (0.5 + 0.5 * np.cos(yy / rng.uniform(20, 80)))
        ) / 2 + rng.normal(0, 12, (3, h, w))
        d = root / "train" / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{i}.jpg"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8).transpose(1, 2, 0)).save(
            p, quality=90
        )
        paths.append(str(p))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--size", type=int, nargs=2, default=[500, 375], metavar=("W", "H"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_folder(Path(tmp), args.images, tuple(args.size))
        mb = sum(Path(p).stat().st_size for p in paths) / len(paths) / 1e3
        print(f"{args.images} JPEGs of {args.size[0]}x{args.size[1]}, {mb:.0f} KB each")
        a = AugmentConfig(img_size=224, train_crop="random_resized_crop")
        b = args.batch_size
        batches = [list(range(s, min(s + b, len(paths)))) for s in range(0, len(paths), b)]
        ds = _DecodeBatches(paths, batches, 224, True, a.crop_pct, a.rrc_scale, a.rrc_ratio, 0)
        ds[0]  # warm the page cache and Pillow
        t0 = time.perf_counter()
        for i in range(len(ds)):
            x, _ = ds[i]
        per_worker = len(paths) / (time.perf_counter() - t0)

        files = FileImageSet(paths, torch.arange(len(paths)) % 10, [f"c{i}" for i in range(10)])
        bare = AugmentConfig(img_size=224, train_crop="random_resized_crop", rand_augment=None,
                             reprob=0.0, mixup=0.0, cutmix=0.0, label_smoothing=0.0)  # fmt: skip
        loader = StreamingLoader(files, b, workers=args.workers, num_classes=10, train=True,
                                 aug=bare)  # fmt: skip
        for _ in loader:  # start the workers once
            break
        t0 = time.perf_counter()
        n = sum(x.shape[0] for x, _ in loader)
        streamed = n / (time.perf_counter() - t0)

        gen = torch.Generator().manual_seed(0)
        ra = parse_rand_augment("rand-m9-mstd0.5-inc1")
        y = torch.randint(0, 10, (b,))
        crops = [ds[i][0] for i in range(len(ds)) if len(ds.batches[i]) == b]
        timings = []
        for x in crops:
            t0 = time.perf_counter()
            z = rand_augment(x, gen, fill=mean_to_fill(a.mean), **ra)
            z = random_erasing(normalize(z, a.mean, a.std), gen, prob=0.25)
            mixup_cutmix(z, y, 10, gen, mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1)
            timings.append(time.perf_counter() - t0)
        recipe = b / sorted(timings)[len(timings) // 2]

    print(f"decode + RandomResizedCrop 224, one process: {per_worker:.0f} img/s per worker")
    print(f"streaming loader, {args.workers} workers, end to end: {streamed:.0f} img/s")
    print(f"batched recipe (RandAugment, erasing, mixup/cutmix) on this CPU, 2 threads: "
          f"{recipe:.0f} img/s")  # fmt: skip
    print("\n| model (paper's GPU rate) | training img/s (1/3 of inference) | decoding workers "
          "needed | CPU threads for the recipe if it ran on the CPU |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    for name, rate in PAPER_RATES.items():
        train = rate / 3
        print(f"| {name}: {rate} | {train:.0f} | {math.ceil(train / per_worker)} | "
              f"{math.ceil(2 * train / recipe)} |")  # fmt: skip


if __name__ == "__main__":
    main()
