"""Semantic segmentation data: ADE20K's layout (and the same layout for your own data), and the
pipelines of LIT's Semantic FPN configs (mmsegmentation 0.13's ``ade20k.py``).

Layouts (``--data-dir`` a folder, or a ``.tar.gz`` of one; a lone wrapper folder is looked
through)::

    ade20k:     images/{training,validation}/NAME.jpg   annotations/{training,validation}/NAME.png
    segfolder:  the same (or train/val for the split names), plus classes.txt (one name per line)

A mask is a single-channel PNG of the image's size, its label per pixel of the image file's
pixels as stored: image and mask are both read as stored, an EXIF orientation tag on either
ignored (torchvision's references read both so; ADE20K's files carry none), so a pair is
aligned whatever tags its files carry, and ``lgvit predict`` writes its mask in that frame.
ADE20K's label 0 ("other") is ignored and
1..150 become 0..149 (mmseg's ``reduce_zero_label``); a ``segfolder`` mask holds 0..n-1 and 255
for pixels to ignore. A mask of another size, or with a label outside the classes (a negative
one too), is one line naming the file. ``classes.txt`` is UTF-8 (a byte-order mark is dropped).

Training (per image, deterministic in (seed, epoch, image), so a resumed run sees the same
crops): rescale to ``scale`` (2048x512: the long side at most 2048 r, the short at most 512 r)
times r ~ U(0.5, 2.0), random crop ``crop`` (at most 75% one class, ten tries), horizontal flip
(0.5), photometric distortion, pad to ``crop`` (image 0, mask 255). Evaluation: the whole image
rescaled to the same scale (r = 1); the prediction is resized back to the mask's size. Images
stay uint8 until the device normalises them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from lgvit.core.constants import DECODE_WORKERS
from lgvit.core.errors import LgvitError
from lgvit.data.decode import TURNED_ORIENTATIONS, exif_orientation, read_image_rgb

SEG_DATASETS = ("ade20k", "segfolder")
IGNORE = 255  # the label of pixels not scored

# The LIT authors' mmseg config for ADE20K: the (long, short) test scale and the training crop.
SEG_SCALE = (2048, 512)
SEG_CROP = 512

# ADE20K SceneParsing's 150 classes (objectInfo150), in label order 1..150.
ADE20K_CLASSES = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane",
    "grass", "cabinet", "sidewalk", "person", "earth", "door", "table", "mountain", "plant",
    "curtain", "chair", "car", "water", "painting", "sofa", "shelf", "house", "sea", "mirror",
    "rug", "field", "armchair", "seat", "fence", "desk", "rock", "wardrobe", "lamp", "bathtub",
    "railing", "cushion", "base", "box", "column", "signboard", "chest of drawers", "counter",
    "sand", "sink", "skyscraper", "fireplace", "refrigerator", "grandstand", "path", "stairs",
    "runway", "case", "pool table", "pillow", "screen door", "stairway", "river", "bridge",
    "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill", "bench",
    "countertop", "stove", "palm", "kitchen island", "computer", "swivel chair", "boat", "bar",
    "arcade machine", "hovel", "bus", "towel", "light", "truck", "tower", "chandelier",
    "awning", "streetlight", "booth", "television receiver", "airplane", "dirt track",
    "apparel", "pole", "land", "bannister", "escalator", "ottoman", "bottle", "buffet",
    "poster", "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer",
    "plaything", "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag",
    "minibike", "cradle", "oven", "ball", "food", "step", "tank", "trade name", "microwave",
    "pot", "animal", "bicycle", "lake", "dishwasher", "screen", "blanket", "sculpture", "hood",
    "sconce", "vase", "traffic light", "tray", "ashcan", "fan", "pier", "crt screen", "plate",
    "monitor", "bulletin board", "shower", "radiator", "glass", "clock", "flag",
)  # fmt: skip

_SPLIT_NAMES = {"train": ("training", "train"), "val": ("validation", "val", "test")}
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


@dataclass
class SegSplit:
    """One split: image files, their mask files, the class names, the label convention."""

    images: list[str]
    masks: list[str]
    classes: tuple[str, ...]
    reduce_zero_label: bool

    def __len__(self) -> int:
        return len(self.images)


# --------------------------------------------------------------------------------- files


def dataset_root(
    data_dir: str | os.PathLike, cache_dir: str | os.PathLike | None, marker: str, layout: str
) -> Path:
    """The folder holding ``marker/``: ``data_dir`` itself, a ``.tar.gz`` of it (extracted
    once into the cache), or a lone wrapper folder in either, looked through."""
    from lgvit.data.archives import default_cache_dir
    from lgvit.data.imagefolder import _folder_or_archive

    root = _folder_or_archive(Path(data_dir), Path(cache_dir or default_cache_dir()))
    if (root / marker).is_dir():
        return root
    subdirs = [e for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]
    if len(subdirs) == 1 and (Path(subdirs[0].path) / marker).is_dir():
        return Path(subdirs[0].path)
    raise LgvitError(f"{data_dir}: no {marker}/ folder (expected {layout})")


def _root(data_dir: str | os.PathLike, cache_dir: str | os.PathLike | None) -> Path:
    layout = "images/{training,validation}/ and annotations/{training,validation}/, ADE20K's layout"
    return dataset_root(data_dir, cache_dir, "images", layout)


def _split_dir(parent: Path, split: str) -> Path:
    for name in _SPLIT_NAMES[split]:
        if (parent / name).is_dir():
            return parent / name
    raise LgvitError(f"{parent}: no {' or '.join(n + '/' for n in _SPLIT_NAMES[split])} folder")


def read_class_list(path: Path) -> tuple[str, ...]:
    """``classes.txt``: one class name per line (blank lines ignored), at most 255 classes;
    UTF-8, with or without a byte-order mark (an editor's BOM is not part of the first name)."""
    from lgvit.data.imagefolder import read_text_lines

    if not path.is_file():
        raise LgvitError(f"{path}: not found (segfolder needs one class name per line)")
    names = tuple(line for line in read_text_lines(path) if line)
    if not names or len(names) > IGNORE:
        raise LgvitError(f"{path}: {len(names)} class names; 1 to {IGNORE} are possible")
    if len(set(names)) != len(names):
        raise LgvitError(f"{path}: a class name appears twice")
    return names


def load_seg_split(
    data: str, data_dir: str | os.PathLike | None, split: str, cache_dir: str | None = None
) -> SegSplit:
    """The ``train`` or ``val`` split of an ``ade20k`` / ``segfolder`` dataset."""
    if data not in SEG_DATASETS:
        raise LgvitError(f"--data {data}: not a segmentation dataset ({', '.join(SEG_DATASETS)})")
    if data_dir is None:
        raise LgvitError(f"--data {data} needs --data-dir (nothing is downloaded)")
    root = _root(data_dir, cache_dir)
    if data == "ade20k":
        classes, reduce = ADE20K_CLASSES, True
    else:
        classes, reduce = read_class_list(root / "classes.txt"), False
    img_dir = _split_dir(root / "images", split)
    mask_dir = root / "annotations" / img_dir.name
    names = sorted(
        f for f in os.listdir(img_dir)
        if not f.startswith(".") and os.path.splitext(f)[1].lower() in _IMAGE_SUFFIXES
    )  # fmt: skip
    if not names:
        raise LgvitError(f"{img_dir}: no images")
    images, masks = [], []
    for f in names:
        mask = mask_dir / (os.path.splitext(f)[0] + ".png")
        if not mask.is_file():
            raise LgvitError(f"{img_dir / f}: no mask {mask}")
        images.append(str(img_dir / f))
        masks.append(str(mask))
    return SegSplit(images, masks, classes, reduce)


def read_mask(
    path: str, size: tuple[int, int], num_classes: int, reduce_zero: bool,
    image: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """A mask PNG as ``(H, W)`` int64 labels (0..n-1, 255 ignored), as stored (its EXIF tag
    ignored); ``size`` is the stored ``(H, W)`` of its image (the file ``image``). Wrong size,
    several channels or labels beyond the classes: one line."""
    try:
        with Image.open(path) as m:
            if m.mode not in ("L", "P", "I", "I;16"):
                raise LgvitError(f"{path}: a {m.mode} image, not a single-channel label PNG")
            arr = np.asarray(m).astype(np.int64)
    except LgvitError:
        raise
    except Exception as e:  # noqa: BLE001 -- any decoder failure is a bad file
        raise LgvitError(f"{path}: not a readable mask ({type(e).__name__})") from None
    if arr.shape != tuple(size):
        raise LgvitError(
            f"{path}: mask is {arr.shape[0]}x{arr.shape[1]} but its image is {size[0]}x{size[1]}"
            + _turned_hint(arr.shape, size, image)
        )
    if reduce_zero:  # ADE20K: 0 is "other" (ignored), 1..150 -> 0..149
        arr = np.where(arr == 0, IGNORE + 1, arr) - 1
    # Negative labels too (a 32-bit "I" mask can hold them): bincount would fail on them later.
    bad = ((arr < 0) | (arr >= num_classes)) & (arr != IGNORE)
    if bad.any():
        wrong = arr[bad]
        label = int(wrong.min() if wrong.min() < 0 else wrong.max()) + int(reduce_zero)
        allowed = f"1..{num_classes} (0 ignored)" if reduce_zero else f"0..{num_classes - 1}, 255"
        raise LgvitError(f"{path}: label {label} is out of range ({allowed} expected)")
    return torch.from_numpy(arr)


def _turned_hint(mask_hw: Sequence[int], image_hw: Sequence[int], image: str | None) -> str:
    """Why a mask of the size of its image turned by 90 degrees is refused: it was drawn on the
    photo as a viewer shows it (turned by its EXIF tag), and segmentation reads it as stored."""
    if image is None or tuple(mask_hw) != tuple(image_hw)[::-1]:
        return ""
    orientation = exif_orientation(image)
    if orientation not in TURNED_ORIENTATIONS:
        return ""
    return (
        f" as stored ({mask_hw[0]}x{mask_hw[1]} once turned by its EXIF orientation "
        f"{orientation}, which segmentation ignores in image and mask alike): save the mask in "
        f"the image's stored orientation, or {image} turned upright without the tag"
    )


def read_pair(split: SegSplit, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Image ``(3, H, W)`` uint8 and mask ``(H, W)`` int64 of sample ``i``, both as stored (an
    EXIF orientation tag on either ignored), so the pair is aligned pixel for pixel."""
    img = read_image_rgb(split.images[i], upright=False)
    mask = read_mask(split.masks[i], tuple(img.shape[-2:]), len(split.classes),
                     split.reduce_zero_label, split.images[i])  # fmt: skip
    return img, mask


# --------------------------------------------------------------------------------- transforms


def rescale_size(hw: Sequence[int], scale: Sequence[int]) -> tuple[int, int]:
    """mmcv's ``rescale_size`` keeping the ratio: the long side at most ``max(scale)``, the
    short side at most ``min(scale)``; ``int(x * f + 0.5)``."""
    h, w = hw
    f = min(max(scale) / max(h, w), min(scale) / min(h, w))
    return int(h * f + 0.5), int(w * f + 0.5)


def resize_pair(
    img: torch.Tensor, mask: torch.Tensor | None, hw: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bilinear image (as cv2's INTER_LINEAR: no antialiasing), nearest mask."""
    if tuple(img.shape[-2:]) == tuple(hw):
        return img, mask
    x = F.interpolate(img[None].float(), size=tuple(hw), mode="bilinear", align_corners=False)
    img = x[0].round().clamp(0, 255).to(torch.uint8)
    if mask is not None:
        mask = F.interpolate(mask[None, None].float(), size=tuple(hw), mode="nearest")[0, 0].long()
    return img, mask


def _crop_box(rng: np.random.Generator, hw: Sequence[int], crop: int) -> tuple[int, int]:
    top = int(rng.integers(0, max(hw[0] - crop, 0) + 1))
    left = int(rng.integers(0, max(hw[1] - crop, 0) + 1))
    return top, left


def random_crop(
    img: torch.Tensor, mask: torch.Tensor, crop: int, rng: np.random.Generator,
    cat_max_ratio: float = 0.75,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """mmseg's ``RandomCrop``: up to ten tries for a crop where no class covers more than
    ``cat_max_ratio`` of the scored pixels."""
    top, left = _crop_box(rng, mask.shape, crop)
    if cat_max_ratio < 1.0:
        for _ in range(10):
            m = mask[top : top + crop, left : left + crop]
            counts = torch.bincount(m[m != IGNORE].flatten())
            counts = counts[counts > 0]
            if len(counts) > 1 and counts.max() / counts.sum() < cat_max_ratio:
                break
            top, left = _crop_box(rng, mask.shape, crop)
    return (img[:, top : top + crop, left : left + crop],
            mask[top : top + crop, left : left + crop])  # fmt: skip


def _rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(0)
    v, _ = x.max(0)
    c = v - x.min(0).values
    s = torch.where(v > 0, c / v.clamp(min=1e-8), torch.zeros_like(v))
    cc = c.clamp(min=1e-8)
    h = torch.where(v == r, (g - b) / cc, torch.where(v == g, 2 + (b - r) / cc, 4 + (r - g) / cc))
    h = torch.where(c > 0, (h / 6) % 1.0, torch.zeros_like(h))
    return torch.stack([h, s, v])


def _hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    h, s, v = x.unbind(0)
    i = torch.floor(h * 6)
    f = h * 6 - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    i = i.long() % 6
    r = torch.stack([v, q, p, p, t, v]).gather(0, i[None])[0]
    g = torch.stack([t, v, v, q, p, p]).gather(0, i[None])[0]
    b = torch.stack([p, p, t, v, v, q]).gather(0, i[None])[0]
    return torch.stack([r, g, b])


def photometric_distortion(img: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """mmseg's ``PhotoMetricDistortion`` (each with probability 0.5): brightness +U(-32, 32),
    contrast xU(0.5, 1.5) (before or after the rest, at random), saturation xU(0.5, 1.5) and
    hue +U{-18..18} of 180 in HSV; clipped to 0..255 and truncated after each step, as mmcv."""
    x = img.float()

    def clip(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(0, 255).floor()

    def contrast(t: torch.Tensor) -> torch.Tensor:
        return clip(t * rng.uniform(0.5, 1.5)) if rng.integers(2) else t

    if rng.integers(2):
        x = clip(x + rng.uniform(-32, 32))
    mode = rng.integers(2)
    if mode == 1:
        x = contrast(x)
    if rng.integers(2):
        hsv = _rgb_to_hsv(x)
        hsv[1] = (hsv[1] * rng.uniform(0.5, 1.5)).clamp(0, 1)
        x = clip(_hsv_to_rgb(hsv))
    if rng.integers(2):
        hsv = _rgb_to_hsv(x)
        hsv[0] = (hsv[0] + int(rng.integers(-18, 19)) / 180.0) % 1.0
        x = clip(_hsv_to_rgb(hsv))
    if mode == 0:
        x = contrast(x)
    return x.to(torch.uint8)


@dataclass
class SegAugment:
    """The training pipeline's settings (LIT's ADE20K config by default)."""

    crop: int = SEG_CROP
    scale: tuple[int, int] = SEG_SCALE
    ratio_range: tuple[float, float] = (0.5, 2.0)
    cat_max_ratio: float = 0.75
    hflip: bool = True
    photometric: bool = True


def train_sample(
    img: torch.Tensor, mask: torch.Tensor, aug: SegAugment, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training sample: ``(3, crop, crop)`` uint8 and ``(crop, crop)`` int64 (255 padded)."""
    r = rng.uniform(*aug.ratio_range)
    scale = (int(aug.scale[0] * r), int(aug.scale[1] * r))
    img, mask = resize_pair(img, mask, rescale_size(img.shape[-2:], scale))
    img, mask = random_crop(img, mask, aug.crop, rng, aug.cat_max_ratio)
    if aug.hflip and rng.random() < 0.5:
        img, mask = img.flip(-1), mask.flip(-1)
    if aug.photometric:
        img = photometric_distortion(img, rng)
    ph, pw = aug.crop - img.shape[-2], aug.crop - img.shape[-1]
    if ph or pw:
        img = F.pad(img, (0, pw, 0, ph), value=0)
        mask = F.pad(mask, (0, pw, 0, ph), value=IGNORE)
    return img.contiguous(), mask.contiguous()


def eval_sample(img: torch.Tensor, scale: Sequence[int]) -> torch.Tensor:
    """The whole image rescaled to ``scale`` (ratio kept), uint8."""
    return resize_pair(img, None, rescale_size(img.shape[-2:], scale))[0]


# --------------------------------------------------------------------------------- loaders


def own_generator() -> torch.Generator:
    """For a DataLoader: without one, starting each iteration draws its workers' base seed from
    the global RNG, which drop path and dropout also draw from -- a run resumed mid-epoch
    starts one more iteration than an uninterrupted one and its model's draws would differ.
    (Every augmentation here draws from ``sample_rng``, not from workers' seeds.)"""
    return torch.Generator().manual_seed(0)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random stream of one image in one epoch: independent of workers and processes."""
    return np.random.Generator(np.random.PCG64([seed, epoch, index]))


class _TrainSet(torch.utils.data.Dataset):
    def __init__(self, split: SegSplit, aug: SegAugment, seed: int) -> None:
        self.split, self.aug, self.seed, self.epoch = split, aug, seed, 0

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> Any:
        try:
            img, mask = read_pair(self.split, i)
        except LgvitError as e:  # raised again in the main process, as one line
            return str(e)
        return train_sample(img, mask, self.aug, sample_rng(self.seed, self.epoch, i))


def pins(device: torch.device | str) -> bool:
    """Whether a loader's batches for ``device`` are pinned (by its DataLoader, off the main
    thread, once per batch): a pinned batch's copy to a GPU (``non_blocking``) overlaps the
    work queued there. Pinned memory needs CUDA, and a CPU run gains nothing from it."""
    return torch.device(device).type == "cuda"


def _keep(items: list[Any]) -> list[Any]:
    return items


def _stack(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A batch from a worker's samples, stacked in the worker, so that the tensors pinned are
    the ones that go to the device; a sample that failed: its one-line error (raised by
    :func:`_checked` in the main process)."""
    for item in items:
        if isinstance(item, str):
            return item
    return torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])


def _checked(batch: tuple[torch.Tensor, torch.Tensor] | str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, str):
        raise LgvitError(batch)
    return batch


class EpochLoader:
    """The engine's loader contract for loaders whose every draw depends only on (seed, epoch,
    image): ``set_epoch(epoch, batch)`` continues an epoch at a batch, and there is no stream
    state to save. Subclasses set ``steps`` and ``set`` (the dataset, told the epoch)."""

    steps: int
    set: Any
    workers: int
    epoch: int = 0
    start: int = 0
    pin: bool = False  # pins(device)
    collate: Any = staticmethod(_keep)

    def __len__(self) -> int:  # a whole epoch's steps, also when it is resumed mid-way
        return self.steps

    def set_epoch(self, epoch: int, batch: int = 0, state: Any = None) -> None:
        self.epoch, self.start = epoch, batch
        self.set.epoch = epoch

    def aug_state(self) -> None:
        return None

    def _items(self, batches: list[list[int]]) -> Any:
        """The items of ``batches`` (index lists), read in ``workers`` processes."""
        self.start = 0  # the next epoch starts at its beginning
        return torch.utils.data.DataLoader(
            self.set, batch_sampler=batches, num_workers=self.workers, collate_fn=self.collate,
            pin_memory=self.pin, generator=own_generator(),
        )  # fmt: skip


class SegTrainLoader(EpochLoader):
    """Batches ``(images uint8 (B, 3, S, S), masks int64 (B, S, S))`` of one process's share,
    in an order drawn per epoch; the engine's loader contract (``set_epoch(epoch, batch)``
    continues an epoch at a batch: every sample's augmentation depends only on (seed, epoch,
    image), so there is no stream state to save). Pinned for a CUDA ``device``."""

    collate = staticmethod(_stack)

    def __init__(
        self, split: SegSplit, aug: SegAugment, batch_size: int, seed: int, rank: int = 0,
        world: int = 1, workers: int = DECODE_WORKERS, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        self.set = _TrainSet(split, aug, seed)
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.workers, self.pin = workers, pins(device)
        self.steps = len(split) // (batch_size * world)
        if self.steps == 0:
            raise LgvitError(
                f"{len(split)} training images are fewer than one global batch "
                f"({batch_size} x {world}); lower --batch-size"
            )
        self.epoch, self.start = 0, 0

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.set), generator=g).tolist()
        per = self.batch_size * self.world
        out = []
        for s in range(self.start, self.steps):
            chunk = order[s * per : (s + 1) * per]
            out.append(chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])
        return out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self._items(self._batches()):
            yield _checked(batch)


class SegEvalLoader:
    """One image at a time, whole: ``(image uint8 (1, 3, h, w) at the eval scale, mask int64
    (1, H, W) at the original size)``; process ``rank`` takes every ``world``-th image.
    Pinned for a CUDA ``device``."""

    def __init__(
        self, split: SegSplit, scale: Sequence[int], rank: int = 0, world: int = 1,
        workers: int = DECODE_WORKERS, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        self.split, self.scale, self.rank, self.world = split, tuple(scale), rank, world
        self.workers, self.pin = workers, pins(device)
        self.indices = list(range(rank, len(split), world))

    def __len__(self) -> int:
        return len(self.indices)

    def _item(self, i: int) -> Any:
        try:
            img, mask = read_pair(self.split, i)
        except LgvitError as e:
            return str(e)
        return eval_sample(img, self.scale), mask

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = torch.utils.data.DataLoader(
            _Items(self._item, self.indices), batch_size=1, num_workers=self.workers,
            collate_fn=_stack, pin_memory=self.pin, generator=own_generator(),
        )  # fmt: skip
        for batch in loader:
            yield _checked(batch)


class _Items(torch.utils.data.Dataset):
    def __init__(self, fn: Any, indices: list[int]) -> None:
        self.fn, self.indices = fn, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> Any:
        return self.fn(self.indices[k])
