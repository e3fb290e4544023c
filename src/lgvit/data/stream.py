"""Large image folders (ImageNet) stream from their files through DataLoader workers.

Small datasets are decoded once into a uint8 cache (``imagefolder.py``); a folder whose decoded
cache would be too large is read as it is iterated instead: workers decode each batch's files, crop
them (train: RandomResizedCrop, bicubic, torchvision's sampling; eval: resize to size/crop_pct and
center crop) and hand back uint8 batches, on which the main process runs the rest of
:class:`BatchLoader`'s recipe (flip, RandAugment, normalisation, erasing, mixup/cutmix). Both
loaders hold a :class:`BatchRecipe`: sharding, seeding and batch counts are the same, so runs
stay reproducible and resumable.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from lgvit.core.constants import DECODE_WORKERS, MAX_BAD_FRACTION
from lgvit.core.errors import LgvitError
from lgvit.data.decode import load_rgb
from lgvit.data.device_decode import EncodedBatch, device_decoder
from lgvit.data.loader import AugmentConfig, BatchLoader, BatchRecipe, RecipeLoader, _seed
from lgvit.data.segmentation import own_generator
from lgvit.data.sources import own_loader
from lgvit.data.splits import FileImageSet, ImageSet, SampleSet
from lgvit.data.transforms import random_resized_box, resize_center_crop


class _DecodeBatches(Dataset):
    """Item i: the samples of batch i decoded to uint8 ``(B, 3, S, S)`` plus a readable mask;
    ``encoded``: JPEGs left encoded for the main process, with their :class:`EncodedBatch`'s
    payload third. ``samples``: a :class:`SampleSet`, or a list of image file paths."""

    def __init__(
        self,
        samples: SampleSet | Sequence[str],
        batches: list[list[int]],
        size: int,
        train: bool,
        crop_pct: float,
        interpolation: str,
        scale: tuple[float, float],
        ratio: tuple[float, float],
        seed: int,
        first: int = 0,
        encoded: bool = False,
    ) -> None:
        if not isinstance(samples, SampleSet):  # file paths: read as a file list
            samples = FileImageSet(list(samples), torch.zeros(len(samples), dtype=torch.int64), [])
        self.samples, self.batches, self.size, self.train = samples, batches, size, train
        self.crop_pct, self.interpolation = crop_pct, interpolation
        self.scale, self.ratio, self.seed = scale, ratio, seed
        self.first = first  # index of batches[0] in the epoch (its crops' seed)
        self.encoded = encoded  # JPEGs handed over encoded (lgvit.data.device_decode)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple:
        # Seeded per batch of the epoch: workers can't reorder it, a resume can skip batches.
        rng = random.Random(self.seed * 1_000_003 + self.first + i)
        s, b = self.size, len(self.batches[i])
        out = torch.zeros((b, 3, s, s), dtype=torch.uint8)
        ok = torch.zeros(b, dtype=torch.bool)
        enc = EncodedBatch(b) if self.encoded else None
        for j, idx in enumerate(self.batches[i]):
            try:  # upright (EXIF orientation); too large or too thin images refused
                if enc is None:
                    rgb = self.samples.open(idx)
                else:  # JPEGs: the header read, the box drawn, the main process decodes
                    data = self.samples.encoded(idx)  # type: ignore[attr-defined]
                    if enc.add(j, data, lambda w, h: self._box(w, h, rng)):
                        ok[j] = True
                        continue
                    rgb = load_rgb(data)
                out[j] = self._crop(rgb, rng)
            except Exception:  # unreadable sample: masked out and counted by the loader
                continue
            ok[j] = True
        return (out, ok) if enc is None else (out, ok, enc.payload())

    def _box(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        """Train: the random-resized crop's box; eval: the whole image (center-cropped later)."""
        if not self.train:
            return 0, 0, width, height
        return random_resized_box(width, height, self.scale, self.ratio, rng)

    def _crop(self, rgb: Image.Image, rng: random.Random) -> torch.Tensor:
        """An upright RGB image's uint8 ``(3, S, S)`` crop."""
        s = self.size
        if self.train:
            rgb = rgb.resize((s, s), Image.Resampling.BICUBIC, box=self._box(*rgb.size, rng))
            return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        # the eval transform of in-memory splits and of predict, image by image
        chw = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)
        return resize_center_crop(chw[None], s, self.crop_pct, self.interpolation)[0]


class StreamingLoader(RecipeLoader):
    """A :class:`SampleSet` (image files, a Hugging Face dataset's rows) decoded and cropped
    by ``workers`` DataLoader processes, then the rest of :class:`BatchLoader`'s recipe
    (:class:`BatchRecipe`: its sharding, seeding, batches and augmentation stream) on the main
    process. Unreadable samples are left out of their batch and counted per pass (``seen``,
    ``bad``, ``first_bad``: its name; what the run reports each epoch); more than
    ``max_bad_fraction`` of the images read so far in the pass (of at least 100) is one line.
    ``decode_device``: JPEGs decoded and cropped there (:mod:`lgvit.data.device_decode`), the
    samples PIL decoded counted per pass (``decoder.cpu_decoded``). The engine's loader
    contract (:class:`lgvit.data.protocol.TrainLoader`)."""

    def __init__(
        self,
        samples: SampleSet,
        batch_size: int,
        *,
        workers: int = DECODE_WORKERS,
        max_bad_fraction: float = MAX_BAD_FRACTION,
        aug: AugmentConfig | None = None,
        decode_device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        # The workers crop (train: RandomResizedCrop; eval: resize and center crop); the recipe
        # then only flips, with no second crop.
        self.crop = aug if aug is not None else AugmentConfig()
        after_crop = dataclasses.replace(self.crop, train_crop="none")
        self.recipe = BatchRecipe(len(samples), samples.labels, batch_size, aug=after_crop,
                                  **kwargs)  # fmt: skip
        self.samples = samples
        self.labels = self.recipe.labels
        self.workers = workers
        self.max_bad_fraction = max_bad_fraction
        self.seen = self.bad = 0
        self.first_bad: str | None = None
        self.decoder = device_decoder(decode_device, self.crop, self.recipe.train)
        if self.decoder is not None and not hasattr(samples, "encoded"):
            raise LgvitError(f"--decode-device: a {type(samples).__name__} has no encoded "
                             "samples to decode (image folders, wds and hfds have)")  # fmt: skip

    def _decoded(self, batches: list[list[int]], start: int) -> DataLoader:
        """The workers' uint8 batches ``(x, readable)`` of ``batches`` (the epoch's from
        ``start``); with a device decoder, its payload third."""
        r, a = self.recipe, self.crop
        ds = _DecodeBatches(
            self.samples, batches, a.img_size, r.train, a.crop_pct, a.interpolation,
            a.rrc_scale, a.rrc_ratio, _seed(r.seed, r.epoch, r.rank, 2), first=start,
            encoded=self.decoder is not None,
        )  # fmt: skip
        return DataLoader(
            ds, batch_size=None, shuffle=False, num_workers=self.workers,
            pin_memory=r.device.type == "cuda", generator=own_generator(),
        )  # fmt: skip

    def _count_bad(self, ok: torch.Tensor, idx: list[int]) -> None:
        self.seen += len(idx)
        bad_now = (~ok).nonzero().flatten().tolist()
        if bad_now:
            self.bad += len(bad_now)
            self.first_bad = self.first_bad or self.samples.name(idx[bad_now[0]])
            if self.bad > self.max_bad_fraction * max(self.seen, 100):
                raise LgvitError(
                    f"{self.bad} of the first {self.seen} images are unreadable (more than "
                    f"{self.max_bad_fraction:.0%}), e.g. {self.first_bad}"
                )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        r = self.recipe
        idx_all = r.indices()
        batches = [idx_all[s:e].tolist() for s, e in r.batch_bounds(idx_all.numel())]
        start, gen = r.pass_start()  # mid-epoch resume: skip decoding the batches done
        batches = batches[start:]
        self.seen = self.bad = 0  # counted per pass (an epoch, an evaluation)
        self.first_bad = None
        if self.decoder is not None:
            self.decoder.cpu_decoded = 0
        for item, idx in zip(self._decoded(batches, start), batches, strict=True):
            x, ok = item[0], item[1]
            if self.decoder is not None:
                x, ok = self.decoder.finish(x, ok, item[2])
                x = r.to_device(x)  # where the recipe runs, if not decoded there
            y = self.labels[idx]
            self._count_bad(ok, idx)
            batch = self.recipe_batch(x, y, torch.as_tensor(idx), ok, gen)
            if batch is not None:
                yield batch


def make_loader(
    split: ImageSet | FileImageSet | Any,
    batch_size: int,
    *,
    workers: int = DECODE_WORKERS,
    max_bad_fraction: float = MAX_BAD_FRACTION,
    **kwargs: Any,
) -> BatchLoader | StreamingLoader | Any:
    """The loader its source brings for ``split`` (WebDataset shards: a ``ShardLoader``,
    :mod:`lgvit.data.wds`), else a :class:`BatchLoader` for a decoded split and a
    :class:`StreamingLoader` for a split read sample by sample (a file list, a Hugging Face
    dataset)."""
    loader = own_loader(split) or (StreamingLoader if not isinstance(split, ImageSet) else None)
    if loader is not None:
        return loader(
            split, batch_size, workers=workers, max_bad_fraction=max_bad_fraction, **kwargs
        )
    kwargs.pop("decode_device", None)  # decoded once into memory: nothing to decode per pass
    return BatchLoader(split.images, split.labels, batch_size, **kwargs)
