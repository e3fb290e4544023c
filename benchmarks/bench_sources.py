"""Images per second from WebDataset shards, a Hugging Face dataset and a folder of the same JPEGs:
lgvit's training loaders against timm's (``create_dataset`` + ``create_loader``), in one run,
with the resident memory of each loader's processes over the epoch.

Writes once, into ``--root`` (reused while its parameters match), ``--images`` JPEGs of
ImageNet-like sizes (500x375 and 375x500, quality 90: CIFAR-10 images upscaled with a little
grain when ``../shared/data/cifar10-jpeg.tar.gz`` is there, else smooth random images), 10
classes, plus a small validation split, as

* ``folder/``: ``train/<class>/*.jpg`` and ``val/<class>/*.jpg``;
* ``wds/``: shards ``train-NNNNNN.tar`` (``NNNNNN.jpg`` + ``NNNNNN.cls``) with timm's
  ``_info.json``;
* ``hfds/``: parquet files ``train-0000X-of-0000Y.parquet`` (an ``Image`` and a ``ClassLabel``
  column), the hub's layout, which both timm's ``hfds/`` reader (``datasets.load_dataset``, its
  arrow copy in ``hf_cache/``) and lgvit's (its copy in ``lgvit_hf_cache/``) read offline.

The same training pipeline on both sides: RandomResizedCrop (scale 0.08-1, bicubic), horizontal
flip, normalised float batches (``--recipe basic``); and with RandAugment and random erasing
(lgvit's DeiT values) on both (``--recipe deit``; the default ``both`` prints both tables).
Mixup/CutMix are left out: timm applies them in its training loop, not in
the loader. lgvit folders are read streamed (``stream=True``), as ImageNet is; timm's loader uses
its prefetcher on the CPU (uint8 from the workers, normalised in the main process, as lgvit).

Each loader is built fresh for each epoch and its workers end with it. The rate counts the
images after the first batch over the time since it arrived (workers' start and the pipeline's
fill left out on both sides); each source and recipe is measured lgvit, timm, lgvit, timm, ...
for ``--rounds`` after a warm-up pass of each, and the table gives the MEDIAN epoch rate. Memory
is the proportional set size (PSS: shared pages split between processes; RSS where the kernel
has no smaps_rollup) of the main process plus its DataLoader workers, sampled through the epoch:
its peak above the main process's alone before the epoch (what the loader adds; the imports of
both libraries are in that baseline), and its growth (the second half's peak less the first
half's), which stays near zero when the memory does not grow with the dataset. timm's shard
reader buffers up to 8192 samples per worker (``WDS_SHUFFLE_SIZE``): with fewer images than that
its buffer is smaller than on ImageNet.

The run (4000 images, 3 rounds, both recipes) took about 13 minutes on 2 idle cores (AMD EPYC,
measured), less with more; the first run also writes the files, about a minute. Run it on an
otherwise idle machine:

    python benchmarks/bench_sources.py

``--smoke``: tiny images and counts, one round (the test's mode; its speeds mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import shutil
import statistics
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Nothing is downloaded: the Hugging Face dataset is local files (set before datasets loads).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from lgvit.data.recipe import DEIT_RECIPE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CIFAR_JPEG = REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"
SOURCES = ("folder", "wds", "hfds")
SIZES = ((500, 375), (375, 500))  # ImageNet's commonest landscape and portrait sizes
CIFAR_CLASSES = "airplane automobile bird cat deer dog frog horse ship truck".split()
NUM_CLASSES = len(CIFAR_CLASSES)  # the random images have as many
GRAIN = 8.0  # noise sigma on upscaled CIFAR: its JPEGs then weigh ~55 KB, nearer photos'
CACHES = ("hf_cache", "lgvit_cache", "lgvit_hf_cache")  # timm's arrow copy; lgvit's scans, copy
SMOKE = dict(images=40, val=10, per_shard=10, hf_shards=2, batch_size=8, img_size=32,
             rounds=1, warmup_batches=1, sizes=((64, 48), (48, 64)))  # fmt: skip


@dataclass(frozen=True)
class Fixture:
    """What the files in ``--root`` were made with: a folder is reused only when it matches."""

    images: int
    val: int
    per_shard: int
    hf_shards: int
    sizes: tuple[tuple[int, int], ...]
    origin: str  # "cifar10" or "random"


# ---------------------------------------------------------------------------- the fixture


def _cifar_images(train: int, val: int) -> tuple[list[Image.Image], list[Image.Image]]:
    """``train`` / ``val`` CIFAR-10 images from the shared archive, round-robin over classes."""
    want = {"train": train, "test": val}
    got: dict[str, list[list[Image.Image]]] = {k: [[] for _ in range(NUM_CLASSES)] for k in want}
    with tarfile.open(CIFAR_JPEG) as tar:
        for m in tar:
            parts = m.name.split("/")  # cifar10/<split>/<class>/NNNN.jpg
            if not m.isfile() or len(parts) != 4 or parts[1] not in want:
                continue
            c = CIFAR_CLASSES.index(parts[2])
            if len(got[parts[1]][c]) < -(-want[parts[1]] // NUM_CLASSES):
                data = tar.extractfile(m).read()
                got[parts[1]][c].append(Image.open(io.BytesIO(data)).convert("RGB"))
    out = []
    for k, n in want.items():
        flat = [im for row in zip(*got[k], strict=False) for im in row]  # class 0, 1, ..., 9, 0..
        out.append(flat[:n])
    return out[0], out[1]


def _photo(src: Image.Image | None, size: tuple[int, int], rng: np.random.Generator) -> bytes:
    """A JPEG (quality 90) of ``size``: ``src`` upscaled with grain, or smooth random content."""
    w, h = size
    if src is not None:
        a = np.asarray(src.resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
        a = a + rng.normal(0, GRAIN, a.shape)
    else:
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        c = rng.uniform(0, 255, (2, 3))
        a = (c[0] * (0.5 + 0.5 * np.sin(xx / rng.uniform(20, 80)))[..., None]
             + c[1] * (0.5 + 0.5 * np.cos(yy / rng.uniform(20, 80)))[..., None]) / 2  # fmt: skip
        a = a + rng.normal(0, GRAIN, a.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write_folder(out: Path, split: str, jpegs: list[bytes], classes: list[str]) -> list[Path]:
    paths = []
    for i, data in enumerate(jpegs):
        p = out / split / classes[i % NUM_CLASSES] / f"{i:06d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        paths.append(p)
    return paths


def _write_shards(out: Path, split: str, paths: list[Path], per_shard: int) -> dict[str, Any]:
    """``split``'s shards with webdataset's writer; their entry of timm's ``_info.json``."""
    import webdataset as wds

    names, lengths = [], []
    for s in range(0, len(paths), per_shard):
        names.append(f"{split}-{s // per_shard:06d}.tar")
        with wds.TarWriter(str(out / names[-1])) as sink:
            for i in range(s, min(s + per_shard, len(paths))):
                sink.write(
                    {"__key__": f"{i:06d}", "jpg": paths[i].read_bytes(), "cls": i % NUM_CLASSES}
                )
        lengths.append(min(per_shard, len(paths) - s))
    return {"name": split, "num_samples": len(paths), "filenames": names,
            "shard_lengths": lengths}  # fmt: skip


def _write_parquet(
    out: Path, split: str, paths: list[Path], shards: int, classes: list[str]
) -> None:
    """``split`` as the hub's parquet files: an ``image`` (bytes) and a ``label`` column."""
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": p.read_bytes(), "path": None} for p in paths],
         "label": [i % NUM_CLASSES for i in range(len(paths))]},
        features=features,
    )  # fmt: skip
    shards = min(shards, len(paths))
    for i in range(shards):
        name = f"{split}-{i:05d}-of-{shards:05d}.parquet"
        ds.shard(shards, i, contiguous=True).to_parquet(str(out / name))


def make_fixture(root: Path, spec: Fixture, log: Callable[[str], None] = print) -> None:
    """The three forms of the same JPEGs in ``root`` (kept when made with ``spec``)."""
    marker = root / "fixture.json"
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(asdict(spec))):
        log(f"reusing the images in {root}")
        return
    log(f"writing {spec.images} + {spec.val} images ({spec.origin}) to {root} ...")
    for name in (*SOURCES, *CACHES, "fixture.json"):
        p = root / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    if spec.origin == "cifar10":
        srcs = _cifar_images(spec.images, spec.val)
        classes = CIFAR_CLASSES
    else:
        srcs = ([None] * spec.images, [None] * spec.val)
        classes = [f"class{c}" for c in range(NUM_CLASSES)]
    info: dict[str, Any] = {"name": "bench_sources", "num_classes": NUM_CLASSES,
                            "classes": classes, "splits": {}}  # fmt: skip
    for (split, wds_split), images in zip((("train", "train"), ("val", "validation")), srcs,
                                          strict=True):  # fmt: skip
        jpegs = [_photo(im, spec.sizes[i % 2], rng) for i, im in enumerate(images)]
        paths = _write_folder(root / "folder", split, jpegs, classes)
        (root / "wds").mkdir(parents=True, exist_ok=True)
        info["splits"][wds_split] = _write_shards(root / "wds", wds_split, paths, spec.per_shard)
        (root / "hfds").mkdir(parents=True, exist_ok=True)
        shards = spec.hf_shards if split == "train" else 1
        _write_parquet(root / "hfds", wds_split, paths, shards, classes)
    (root / "wds" / "_info.json").write_text(json.dumps(info, indent=1))
    marker.write_text(json.dumps(asdict(spec)))  # last: a run cut short rebuilds next time


# ---------------------------------------------------------------------------- the loaders


@dataclass(frozen=True)
class Setup:
    """What both sides share: where the files are, the batches and the recipe."""

    root: Path
    batch_size: int
    workers: int
    img_size: int
    deit: bool


def lgvit_loader(source: str, s: Setup, epoch: int) -> Iterable:
    """lgvit's training loader of ``source``'s train split (``load_dataset`` + ``make_loader``)."""
    from lgvit.data.datasets import load_dataset
    from lgvit.data.loader import AugmentConfig
    from lgvit.data.stream import make_loader

    name, data_dir = {"folder": ("imagefolder", "folder")}.get(source, (source, source))
    splits = load_dataset(name, str(s.root / data_dir), img_size=s.img_size, stream=True,
                          cache_dir=str(s.root / "lgvit_cache"))  # fmt: skip
    recipe: dict[str, Any] = dict(rand_augment=None, reprob=0.0)
    if s.deit:
        recipe = {k: DEIT_RECIPE[k] for k in ("rand_augment", "reprob", "remode")}
    aug = AugmentConfig(img_size=s.img_size, train_crop="random_resized_crop", hflip=True,
                        mixup=0.0, cutmix=0.0, label_smoothing=0.0, **recipe)  # fmt: skip
    loader = make_loader(splits.train, s.batch_size, train=True, workers=s.workers,
                         num_classes=len(splits.train.classes), aug=aug, seed=0)  # fmt: skip
    loader.set_epoch(epoch)
    return loader


def _timm_posterize_as_before_pillow_13() -> bool:
    """Pillow 13 refuses ``posterize`` with 0 bits, which timm's RandAugment asks for when a
    magnitude drawn with ``mstd`` reaches 10 (its workers then die mid-epoch); Pillow before 13
    made that image black. timm's posterize is given that behaviour back; True if it was."""
    from PIL import ImageOps
    from timm.data import auto_augment

    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
        return False
    except ValueError:
        pass
    original = auto_augment.posterize

    def posterize(img: Image.Image, bits_to_keep: int, **kw: Any) -> Image.Image:
        return Image.new(img.mode, img.size) if bits_to_keep <= 0 else original(img, bits_to_keep)

    for name, op in auto_augment.NAME_TO_OP.items():  # the ops hold the function, not its name
        if op is original:
            auto_augment.NAME_TO_OP[name] = posterize
    return True


def timm_loader(source: str, s: Setup, epoch: int) -> Iterable:
    """timm's training loader of the same files (``create_dataset`` + ``create_loader``)."""
    from timm.data import create_dataset, create_loader

    if source == "folder":
        ds = create_dataset("", root=str(s.root / "folder"), split="train", is_training=True)
    elif source == "wds":
        ds = create_dataset("wds/bench_sources", root=str(s.root / "wds"), split="train",
                            is_training=True, batch_size=s.batch_size)  # fmt: skip
    else:  # datasets.load_dataset(path, cache_dir=root): its arrow cache is made once
        ds = create_dataset(f"hfds/{s.root / 'hfds'}", root=str(s.root / "hf_cache"),
                            split="train", is_training=True)  # fmt: skip
    deit = dict(auto_augment=DEIT_RECIPE["rand_augment"], re_prob=DEIT_RECIPE["reprob"],
                re_mode=DEIT_RECIPE["remode"]) if s.deit else {}  # fmt: skip
    loader = create_loader(
        ds, input_size=(3, s.img_size, s.img_size), batch_size=s.batch_size, is_training=True,
        scale=(0.08, 1.0), interpolation="bicubic", hflip=0.5, color_jitter=None,
        num_workers=s.workers, device=torch.device("cpu"), use_prefetcher=True,
        persistent_workers=False, **deit,
    )  # fmt: skip
    if hasattr(ds, "set_epoch"):
        ds.set_epoch(epoch)
    return loader


LOADERS: dict[str, Callable[[str, Setup, int], Iterable]] = {
    "lgvit": lgvit_loader, "timm": timm_loader,
}  # fmt: skip


# ---------------------------------------------------------------------------- measuring


def _memory_mb(pid: int) -> float:
    """Process ``pid``'s PSS (RSS where there is no smaps_rollup), MB; 0 once it has ended."""
    for name, field in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    return 0.0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                kids += map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split())
    return kids


class MemorySampler:
    """The memory of this process and its children (the DataLoader workers), sampled as batches
    arrive (at most every ``interval`` seconds: while the workers are alive, which a thread's
    last sample might not see); the ``baseline`` is this process's alone, before the epoch."""

    def __init__(self, interval: float) -> None:
        self.interval, self.samples = interval, []
        self.baseline = _memory_mb(os.getpid())
        self._last = -float("inf")

    def sample(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last >= self.interval:
            me = os.getpid()
            self.samples.append(sum(_memory_mb(p) for p in (me, *_children(me))))
            self._last = now

    def peak_and_growth(self) -> tuple[float, float]:
        """The peak above the baseline, and the second half's peak less the first half's."""
        half = max(len(self.samples) // 2, 1)
        first, second = self.samples[:half], self.samples[half:] or self.samples[-1:]
        return max(self.samples) - self.baseline, max(second) - max(first)


@dataclass
class Epoch:
    rate: float  # images per second after the first batch
    peak_mb: float  # above the main process's before the epoch
    growth_mb: float


def _images(batch: Any) -> int:
    return int((batch[0] if isinstance(batch, (tuple, list)) else batch).shape[0])


def time_epoch(loader: Iterable, interval: float) -> Epoch:
    """One pass of ``loader``: its rate after the first batch and its memory over the pass."""
    mem = MemorySampler(interval)
    it: Iterator = iter(loader)  # a generator on both sides: the workers start at next()
    n = _images(next(it))
    mem.sample(force=True)
    t0, count = time.perf_counter(), 0
    for batch in it:
        count += _images(batch)
        mem.sample()
    dt = time.perf_counter() - t0
    if count == 0:
        raise SystemExit(f"{type(loader).__name__} gave one batch of {n}: use more --images")
    del it
    gc.collect()  # the epoch's workers and buffers go before the next loader starts
    return Epoch(count / dt, *mem.peak_and_growth())


def warm_up(loader: Iterable, batches: int) -> None:
    """A few batches (imports, page cache, timm's arrow cache on its first use)."""
    for i, _ in enumerate(loader):
        if i + 1 >= batches:
            break
    gc.collect()


def measure(source: str, s: Setup, rounds: int, warmup_batches: int, interval: float
            ) -> dict[str, list[Epoch]]:  # fmt: skip
    """``rounds`` epochs of each side, alternating, after a warm-up of each."""
    for make in LOADERS.values():
        warm_up(make(source, s, 0), warmup_batches)
    out: dict[str, list[Epoch]] = {side: [] for side in LOADERS}
    for r in range(rounds):
        for side, make in LOADERS.items():
            out[side].append(time_epoch(make(source, s, r + 1), interval))
    return out


# ---------------------------------------------------------------------------- the table


def machine_header(workers: int) -> str:
    """The CPU's model name and bf16 flags (lscpu), torch's threads, the workers."""
    model, flags = "unknown CPU", ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                flags = " ".join(f for f in value.split() if "bf16" in f)
    return (f"CPU: {model} (bf16 flags: {flags or 'none'}), {os.cpu_count()} cores; torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; {workers} DataLoader "
            "workers per loader")  # fmt: skip


def table_rows(results: dict[str, dict[str, list[Epoch]]]) -> list[str]:
    head = ("source", "lgvit img/s", "timm img/s", "ratio", "lgvit peak MB", "timm peak MB",
            "lgvit growth MB", "timm growth MB")  # fmt: skip
    rows = [" | ".join(head), " | ".join("---" for _ in head)]
    for source, sides in results.items():
        rate = {k: statistics.median(e.rate for e in v) for k, v in sides.items()}
        peak = {k: max(e.peak_mb for e in v) for k, v in sides.items()}
        grow = {k: max(e.growth_mb for e in v) for k, v in sides.items()}
        rows.append(" | ".join([
            source, f"{rate['lgvit']:.1f}", f"{rate['timm']:.1f}",
            f"{rate['lgvit'] / rate['timm']:.2f}", f"{peak['lgvit']:.0f}", f"{peak['timm']:.0f}",
            f"{grow['lgvit']:+.0f}", f"{grow['timm']:+.0f}",
        ]))  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/lgvit_bench_sources"))
    ap.add_argument("--images", type=int, default=4000, help="training images (default 4000)")
    ap.add_argument("--val", type=int, default=200, help="validation images (default 200)")
    ap.add_argument("--per-shard", type=int, default=500, help="samples per shard")
    ap.add_argument("--hf-shards", type=int, default=4, help="parquet files of the train split")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=128, help="the papers' per-GPU batch")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-batches", type=int, default=3)
    ap.add_argument("--recipe", choices=("basic", "deit", "both"), default="both")
    ap.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    ap.add_argument("--interval", type=float, default=0.25, help="memory sampling, seconds")
    ap.add_argument(
        "--random-images",
        action="store_true",
        help="smooth random images even where CIFAR-10's JPEGs are at hand",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round (for tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.interval = 0.05
    else:
        args.sizes = SIZES
    return args


def fixture_spec(args: argparse.Namespace) -> Fixture:
    """The fixture ``args`` ask for (CIFAR-10's images where the shared archive is)."""
    origin = "cifar10" if CIFAR_JPEG.is_file() and not args.random_images else "random"
    return Fixture(args.images, args.val, args.per_shard, args.hf_shards,
                   tuple(map(tuple, args.sizes)), origin)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # lgvit's hfds reader converts parquet into datasets' default cache: kept with the fixture
    # (unless the user named a cache), as timm's copy is.
    os.environ.setdefault("HF_DATASETS_CACHE", str(args.root / "lgvit_hf_cache"))
    for mod, extra in (("webdataset", "lgvit[wds]"), ("datasets", "lgvit[hfds]"), ("timm", "timm")):
        try:
            __import__(mod)
        except ImportError:
            raise SystemExit(
                f"bench_sources needs the {mod} package: pip install '{extra}'"
            ) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.recipe != "basic" and _timm_posterize_as_before_pillow_13():
        print("note: Pillow >= 13 refuses posterize to 0 bits; timm's RandAugment asks for it, "
              "so its posterize makes such an image black, as Pillow < 13 did")  # fmt: skip
    spec = fixture_spec(args)
    args.root.mkdir(parents=True, exist_ok=True)
    make_fixture(args.root, spec)
    print(machine_header(args.workers))
    recipes = ("basic", "deit") if args.recipe == "both" else (args.recipe,)
    for recipe in recipes:
        s = Setup(args.root, args.batch_size, args.workers, args.img_size, recipe == "deit")
        what = "RandomResizedCrop + flip" + (
            f" + RandAugment {DEIT_RECIPE['rand_augment']} + erasing {DEIT_RECIPE['reprob']}"
            if s.deit else "")  # fmt: skip
        print(f"\n{recipe} recipe ({what}), {args.img_size} px, batch {args.batch_size}, "
              f"{args.images} images of {spec.origin} origin; median of {args.rounds} "
              "epoch(s) each, alternating lgvit and timm; memory: MB above the main process's "
              "before the epoch")  # fmt: skip
        results = {src: measure(src, s, args.rounds, args.warmup_batches, args.interval)
                   for src in args.sources}  # fmt: skip
        print("\n".join(table_rows(results)), flush=True)


if __name__ == "__main__":
    main()
