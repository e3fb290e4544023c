"""Part d of benchmarks/gpu_check.py, its last item: how fast the training loader turns 224-px
JPEGs into batches on the device (``--decode-device``), beside PIL in the workers, with every
core of the machine as workers. The goal compares it with lit_s's compiled training rate.

The JPEGs are made here, ImageNet-like: 500x375 (ImageNet's most common size), quality 90,
smooth with some texture (noise would be all edges and decode slower than photographs).
"""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

IMAGES, SMOKE_IMAGES = 4096, 48
BATCH, SMOKE_BATCH = 256, 8
SIZE = (500, 375)


def _one_jpeg(args: tuple[str, int]) -> str:
    from PIL import Image

    path, seed = args
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
    arr = np.asarray(small.resize(SIZE, Image.Resampling.BICUBIC)).astype(np.int16)
    arr += rng.integers(-12, 12, arr.shape, dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    Path(path).write_bytes(buf.getvalue())
    return path


def make_jpegs(folder: Path, n: int, workers: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(str(folder / f"{i:05d}.jpg"), i) for i in range(n)]
    with ProcessPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(_one_jpeg, jobs, chunksize=64))


def _rate(paths: list[str], batch: int, device: str, decode: str | None, workers: int) -> float:
    """Images per second of one training pass after its first two batches (the workers'
    start and the decoder's first call), synchronised on the device."""
    import torch

    from lgvit.data.loader import AugmentConfig
    from lgvit.data.splits import FileImageSet
    from lgvit.data.stream import make_loader

    labels = torch.arange(len(paths)) % 10
    split = FileImageSet(paths, labels, [str(i) for i in range(10)])
    aug = AugmentConfig(img_size=224, train_crop="random_resized_crop", mixup=0, cutmix=0)
    loader = make_loader(split, batch, num_classes=10, train=True, aug=aug, seed=0,
                         device=torch.device(device), workers=workers,
                         decode_device=decode)  # fmt: skip
    seen, t0 = 0, None
    for i, (x, _) in enumerate(loader):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i == 1:
            t0 = time.perf_counter()
        elif i > 1:
            seen += x.shape[0]
    if t0 is None or not seen:
        raise RuntimeError(f"{len(paths)} images give too few batches of {batch} to time")
    return seen / (time.perf_counter() - t0)


def decode_item(device: str, smoke: bool, scratch: Path) -> dict[str, Any]:
    """Device decode and PIL-in-the-workers rates (img/s) of 224-px random-resized crops."""
    cores = os.cpu_count() or 1
    workers = 2 if smoke else cores
    paths = make_jpegs(scratch / "jpegs", SMOKE_IMAGES if smoke else IMAGES, workers)
    batch = SMOKE_BATCH if smoke else BATCH
    on = "cuda" if device.startswith("cuda") else "cpu"
    device_rate = _rate(paths, batch, device, on, workers)
    pil_rate = _rate(paths, batch, device, None, workers)
    return {"ok": True, "images": len(paths), "size": list(SIZE), "batch": batch,
            "workers": workers, "decode_device": on, "device_img_s": round(device_rate, 1),
            "pil_img_s": round(pil_rate, 1)}  # fmt: skip
