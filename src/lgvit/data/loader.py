"""In-memory batch loader that runs the DeiT augmentation recipe on whole batches.

Images live as one uint8 ``(N, 3, H, W)`` tensor; each batch is gathered by index and
augmented with the batched ops in :mod:`lgvit.data.transforms` (no per-sample Python work,
no worker processes). Sharding follows ``DistributedSampler`` / DeiT's ``RASampler`` so
multi-process runs see the same data as a torch ``DataLoader`` setup would.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lgvit.core.constants import CROP_PCT, IMAGENET_MEAN, IMAGENET_STD
from lgvit.core.errors import LgvitError
from lgvit.data.recipe import DEIT_RECIPE, RE_MODES, TRAIN_CROPS
from lgvit.data.transforms import (
    INTERPOLATIONS,
    mean_to_fill,
    mixup_cutmix,
    normalize,
    one_hot_smooth,
    rand_augment,
    random_crop_flip,
    random_erasing,
    random_resized_crop,
    resize_center_crop,
)

__all__ = ["AugmentConfig", "BatchLoader", "BatchRecipe", "parse_rand_augment"]


def _recipe(key: str) -> Any:
    """The DeiT recipe's default for ``key`` (declared once, in lgvit.data.recipe)."""
    return DEIT_RECIPE[key]


@dataclass
class AugmentConfig:
    """Training/eval augmentation settings (defaults: DeiT recipe at CIFAR resolution).

    Beyond the DeiT flags: ``rrc_scale``/``rrc_ratio`` configure 'random_resized_crop',
    ``mixup_mode`` is timm's Mixup mode ('batch' or 'elem') and ``recount`` the maximum
    number of random-erasing boxes.
    """

    img_size: int = 32
    # 'random_crop' (pad + crop + flip, CIFAR), 'random_resized_crop' (ImageNet) or 'none'.
    train_crop: str = _recipe("train_crop")
    crop_padding: int = _recipe("crop_padding")
    hflip: bool = _recipe("hflip")
    # airbench's alternating flip (with hflip): each image is mirrored in every other epoch.
    alternate_flip: bool = _recipe("alternate_flip")
    # timm-style RandAugment spec parsed by parse_rand_augment(); None or '' disables it.
    rand_augment: str | None = _recipe("rand_augment")
    mixup: float = _recipe("mixup")
    cutmix: float = _recipe("cutmix")
    mixup_switch_prob: float = _recipe("mixup_switch_prob")
    mixup_prob: float = _recipe("mixup_prob")
    label_smoothing: float = _recipe("label_smoothing")
    reprob: float = _recipe("reprob")
    remode: str = _recipe("remode")
    crop_pct: float = CROP_PCT
    interpolation: str = "bicubic"  # of the eval resize (timm's ``interpolation``)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    rrc_scale: tuple[float, float] = (0.08, 1.0)
    rrc_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    mixup_mode: str = "batch"
    recount: int = 1

    def __post_init__(self) -> None:
        if self.train_crop not in TRAIN_CROPS:
            raise LgvitError(f"train_crop must be one of {TRAIN_CROPS}, got {self.train_crop!r}")
        if self.remode not in RE_MODES:
            raise LgvitError(f"remode must be 'pixel', 'rand' or 'const', got {self.remode!r}")
        if self.mixup_mode not in ("batch", "elem"):
            raise LgvitError(f"mixup_mode must be 'batch' or 'elem', got {self.mixup_mode!r}")
        if self.img_size <= 0:
            raise LgvitError(f"img_size must be positive, got {self.img_size}")
        if self.interpolation not in INTERPOLATIONS:
            raise LgvitError(
                f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got "
                f"{self.interpolation!r}"
            )
        if len(self.mean) != 3 or len(self.std) != 3:
            raise LgvitError("mean and std need 3 values each (one per RGB channel)")
        if self.rand_augment:
            parse_rand_augment(self.rand_augment)  # fail at config time, not mid-epoch

    @property
    def mix_active(self) -> bool:
        """Whether mixup/cutmix can change a batch."""
        return (self.mixup > 0 or self.cutmix > 0) and self.mixup_prob > 0


def parse_rand_augment(spec: str) -> dict:
    """Parse a timm RandAugment string such as ``'rand-m9-mstd0.5-inc1'``.

    Returns ``{'magnitude', 'magnitude_std', 'increasing', 'num_ops'}`` (keyword arguments
    of :func:`lgvit.data.transforms.rand_augment`), plus ``'prob'`` / ``'magnitude_max'``
    when the string has ``-p`` / ``-mmax``. Defaults are timm's: m10, n2, mstd0, inc0.
    Unlike timm, ``inc0`` means off (timm's ``bool('0')`` turns it on).
    """
    bad = LgvitError(
        f"bad RandAugment spec {spec!r}: expected e.g. 'rand-m9-mstd0.5-inc1' "
        "(sections m<int>, n<int>, mstd<float>, mmax<float>, inc<0|1>, p<float>)"
    )
    parts = spec.strip().split("-") if isinstance(spec, str) else []
    if not parts or parts[0] != "rand":
        raise bad
    out: dict = {"magnitude": 10.0, "magnitude_std": 0.0, "increasing": False, "num_ops": 2}
    for part in parts[1:]:
        m = re.fullmatch(r"([a-z]+)(\d+(?:\.\d*)?)", part)
        if m is None:
            raise bad
        key, val = m.group(1), m.group(2)
        if key == "m":
            out["magnitude"] = float(val)
        elif key == "n":
            if not val.isdigit():
                raise bad
            out["num_ops"] = int(val)
        elif key == "mstd":
            # timm: mstd > 100 means "uniform in [0, m]".
            out["magnitude_std"] = float("inf") if float(val) > 100 else float(val)
        elif key == "mmax":
            out["magnitude_max"] = float(val)
        elif key == "inc":
            out["increasing"] = bool(int(float(val)))
        elif key == "p":
            out["prob"] = float(val)
        else:
            raise bad
    return out


def _seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from small integers (seed, epoch, rank, stream)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


class BatchRecipe:
    """What :class:`BatchLoader` and the streaming loader (:mod:`lgvit.data.stream`) share,
    whatever holds the images: each epoch's sample order, this rank's shard and its batches,
    the augmentation stream (exact mid-epoch resume) and the batched recipe run on a batch.

    ``num_images`` images with ``labels`` (moved to ``labels_device``: where the images are
    indexed; None for shards, whose batches bring their labels, checked as they are read); the
    other arguments are :class:`BatchLoader`'s.
    """

    def __init__(
        self,
        num_images: int,
        labels: torch.Tensor | None,
        batch_size: int,
        *,
        num_classes: int,
        train: bool,
        aug: AugmentConfig | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool | None = None,
        device: torch.device | str = "cpu",
        repeated_aug: int = 1,
        with_index: bool = False,
        labels_device: torch.device | str = "cpu",
    ) -> None:
        if with_index and train:
            raise LgvitError("with_index is for evaluation (train=False)")
        self.num_images, given = num_images, labels is not None
        labels = torch.as_tensor(labels) if given else torch.zeros(0, dtype=torch.long)
        if given and labels.shape != (num_images,):
            raise LgvitError(f"labels must have shape ({num_images},), got {tuple(labels.shape)}")
        if labels.is_floating_point() or labels.is_complex():
            raise LgvitError(f"labels must be integers, got {labels.dtype}")
        labels = labels.long().to(labels_device)
        if num_classes <= 0:
            raise LgvitError(f"num_classes must be positive, got {num_classes}")
        if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
            raise LgvitError(
                f"labels must lie in [0, {num_classes}), got range "
                f"[{int(labels.min())}, {int(labels.max())}]"
            )
        if batch_size <= 0:
            raise LgvitError(f"batch_size must be positive, got {batch_size}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise LgvitError(f"need 0 <= rank < world_size, got rank={rank}, world={world_size}")
        if seed < 0:
            raise LgvitError(f"seed must be non-negative, got {seed}")
        if repeated_aug < 1:
            raise LgvitError(f"repeated_aug must be >= 1, got {repeated_aug}")
        self.aug = aug if aug is not None else AugmentConfig()
        self.labels = labels
        self.batch_size = batch_size
        self.num_classes = num_classes
        self.train = train
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = train if drop_last is None else drop_last
        self.device = torch.device(device)
        self.repeated_aug = repeated_aug if train else 1
        self.with_index = with_index
        self.epoch = 0
        self._flip_phase: torch.Tensor | None = None
        self.rand_augment = (
            parse_rand_augment(self.aug.rand_augment) if self.aug.rand_augment else None
        )
        self.mix = train and self.aug.mix_active
        self._soft = train and (self.mix or self.aug.label_smoothing > 0)
        if self.mix and batch_size % 2:
            raise LgvitError(f"mixup/cutmix needs an even batch_size, got {batch_size}")
        self._start: tuple[int, torch.Tensor | None] = (0, None)
        self._gen: torch.Generator | None = None
        # The recipe's sync-free path (lgvit.data.transforms): None takes it off the CPU only;
        # True runs it on a CPU too (tests of what a GPU run does).
        self.sync_free: bool | None = None

    # ------------------------------------------------------------------ the loader contract

    def set_epoch(self, epoch: int, batch: int = 0, state: torch.Tensor | None = None) -> None:
        """Select the epoch whose permutation and augmentation stream to use. ``batch`` and
        ``state`` (from :meth:`aug_state` after that many batches) continue an epoch in the
        middle, exactly: the next pass yields batch ``batch`` onwards with the augmentation
        draws it would have had. They apply to the next pass only."""
        if epoch < 0:
            raise LgvitError(f"epoch must be non-negative, got {epoch}")
        if not 0 <= batch <= len(self):
            raise LgvitError(f"batch {batch} is outside the epoch's {len(self)} batches")
        self.epoch = epoch
        self._start = (batch, state)

    def aug_state(self) -> torch.Tensor | None:
        """The augmentation generator's state after the batches yielded so far this epoch."""
        return self._gen.get_state() if self._gen is not None else None

    def pass_start(self) -> tuple[int, torch.Generator]:
        """The first batch of this pass and the augmentation generator, positioned there.

        On a GPU the generator lives there, made once per pass: every draw of a batch is made
        where the batch is, with nothing copied from the host. Its state is a GPU generator's;
        a state saved on the other kind of device cannot position it, so the epoch then
        continues at its batch with the stream started afresh, as after a change of process
        count (the CPU and CUDA streams differ anyway)."""
        start, state = self._start
        self._start = (0, None)
        on, index = torch.device("cpu"), self.device.index
        if self.device.type == "cuda":  # with its index, so that it equals the batch's device
            on = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        gen = torch.Generator(device=on).manual_seed(_seed(self.seed, self.epoch, self.rank, 1))
        if state is not None:
            try:
                gen.set_state(state)
            except RuntimeError:  # saved on the other kind of device: its size differs
                gen.manual_seed(_seed(self.seed, self.epoch, self.rank, 1))
        self._gen = gen
        return start, gen

    # ------------------------------------------------------------------ sharding

    @property
    def dataset_size(self) -> int:
        """Number of images in the whole dataset (all ranks)."""
        return self.num_images

    def indices(self) -> torch.Tensor:
        """Dataset indices this rank visits in the current epoch, in order (before batching)."""
        n = self.dataset_size
        if not self.train:
            return torch.arange(self.rank, n, self.world_size)
        g = torch.Generator().manual_seed(_seed(self.seed, self.epoch))
        order = torch.randperm(n, generator=g)
        if self.repeated_aug > 1:
            order = order.repeat_interleave(self.repeated_aug)
        total = math.ceil(order.numel() / self.world_size) * self.world_size
        if total > order.numel() and order.numel():
            reps = math.ceil(total / order.numel())
            order = order.repeat(reps)[:total]  # DistributedSampler's padding
        shard = order[self.rank : total : self.world_size]
        if self.repeated_aug > 1:
            shard = shard[: n // self.world_size]
        return shard

    @property
    def num_samples(self) -> int:
        """Samples this rank visits per epoch before batching (eval: its true share)."""
        n = self.dataset_size
        if not self.train:
            return len(range(self.rank, n, self.world_size))
        per_rank = math.ceil(n * self.repeated_aug / self.world_size)
        return min(per_rank, n // self.world_size) if self.repeated_aug > 1 else per_rank

    def batch_bounds(self, n: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each batch of ``n`` indices (mixup: even batches only)."""
        b = self.batch_size
        stop = (n // b) * b if self.drop_last else n
        bounds = [(s, min(s + b, stop)) for s in range(0, stop, b)]
        if self.mix and bounds and (bounds[-1][1] - bounds[-1][0]) % 2:
            s, e = bounds.pop()
            if e - s > 1:
                bounds.append((s, e - 1))
        return bounds

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self.batch_bounds(self.num_samples))

    # ------------------------------------------------------------------ one batch

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        if self.device.type == "cuda" and t.device.type == "cpu":
            # Pinned memory lets the copy overlap with the GPU work already queued.
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def fit_size(self, x: torch.Tensor) -> torch.Tensor:
        s = self.aug.img_size
        if tuple(x.shape[-2:]) == (s, s):
            return x
        pct = self.aug.crop_pct if not self.train else 1.0
        return resize_center_crop(x, s, crop_pct=pct, interpolation=self.aug.interpolation)

    def _flips(self, idx: torch.Tensor) -> torch.Tensor:
        """Alternating flips (airbench): image ``i`` is mirrored in epoch ``e`` when its random
        phase bit (from the seed alone, the same on every rank) differs from ``e % 2``, so any
        two consecutive epochs show every image both ways -- a random flip repeats the same
        view in half the pairs. (Repeated augmentation's copies of an image share the flip.)"""
        if self._flip_phase is None:  # kept where the recipe runs: no per-batch copy
            g = torch.Generator().manual_seed(_seed(self.seed, 0, 0, 3))
            self._flip_phase = self.to_device(torch.rand(self.dataset_size, generator=g) < 0.5)
        return self._flip_phase[self.to_device(idx)] ^ bool(self.epoch % 2)

    def train_batch(
        self, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The recipe on uint8 images ``x`` (dataset indices ``idx``), drawing from ``gen``."""
        a = self.aug
        flip = self._flips(idx) if a.hflip and a.alternate_flip else a.hflip
        if self.device.type != "cpu":
            # On a GPU the whole recipe runs there: the uint8 batch (a quarter of its float
            # size) moves once, pinned and non-blocking, and no op waits for the host.
            x, y = self.to_device(x), self.to_device(y)
        if a.train_crop == "random_resized_crop":
            x = random_resized_crop(x, a.img_size, a.rrc_scale, a.rrc_ratio, gen=gen, flip=flip)
        else:
            x = self.fit_size(x)
            pad = a.crop_padding if a.train_crop == "random_crop" else 0
            if pad > 0 or a.hflip:
                x = random_crop_flip(x, a.img_size, pad, flip, gen=gen)
        if self.rand_augment is not None:
            fill = mean_to_fill(a.mean)
            x = rand_augment(x, gen, fill=fill, sync_free=self.sync_free, **self.rand_augment)
        x, y = self.to_device(x), self.to_device(y)
        x = normalize(x, a.mean, a.std)
        if a.reprob > 0:
            x = random_erasing(x, gen, prob=a.reprob, mode=a.remode, max_count=a.recount,
                               sync_free=self.sync_free)  # fmt: skip
        if self.mix:
            return self.mix_batch(x, y, gen)
        if self._soft:
            return x, one_hot_smooth(y, self.num_classes, a.label_smoothing)
        return x, y

    def mix_batch(
        self, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixup/cutmix of a normalised batch, with soft (smoothed) targets."""
        a = self.aug
        return mixup_cutmix(
            x,
            y,
            self.num_classes,
            gen,
            mixup_alpha=a.mixup,
            cutmix_alpha=a.cutmix,
            switch_prob=a.mixup_switch_prob,
            prob=a.mixup_prob,
            label_smoothing=a.label_smoothing,
            mode=a.mixup_mode,
            sync_free=self.sync_free,
        )

    def eval_batch(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> tuple:
        """Uint8 images ``x`` resized to the eval size when they are not, normalised; with
        ``with_index``, the images' indices in the split too."""
        x = normalize(self.fit_size(self.to_device(x)), self.aug.mean, self.aug.std)
        if self.with_index:
            return x, self.to_device(y), idx.cpu()
        return x, self.to_device(y)


class RecipeLoader:
    """The engine's loader contract (:class:`lgvit.data.protocol.TrainLoader`) of a loader
    whose batches a :class:`BatchRecipe` (``self.recipe``) plans: in memory, streamed from
    files or rows, or from shards."""

    recipe: BatchRecipe

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self.recipe)

    def set_epoch(self, epoch: int, batch: int = 0, state: torch.Tensor | None = None) -> None:
        """:meth:`BatchRecipe.set_epoch`: the epoch, and where in it the next pass starts."""
        self.recipe.set_epoch(epoch, batch, state)

    def aug_state(self) -> torch.Tensor | None:
        return self.recipe.aug_state()

    def recipe_batch(
        self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor,
        gen: torch.Generator,
    ) -> tuple | None:  # fmt: skip
        """A workers' uint8 batch through the recipe: its readable images (``ok``) only, an
        odd one left out for mixup; None when none is left."""
        r = self.recipe
        if not ok.all():  # only then a copy (pinned as the workers' batch was)
            keep = ok.nonzero().flatten()
            x, y, idx = _kept(x, keep), y[keep], idx[keep]
        if r.mix and len(y) % 2:
            x, y, idx = x[:-1], y[:-1], idx[:-1]
        if len(y) == 0:
            return None
        return r.train_batch(x, y, gen, idx) if r.train else r.eval_batch(x, y, idx)


def _kept(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The images ``keep`` of ``x``, in memory pinned as ``x`` is: a batch is pinned once (by
    the DataLoader, for a CUDA device), and the copy to the device reads that buffer
    (``Tensor.pin_memory`` returns a pinned tensor itself), with no pageable copy between."""
    if x.device.type != "cpu":  # decoded on the device (lgvit.data.device_decode)
        return x[keep.to(x.device)]
    out = torch.empty((len(keep), *x.shape[1:]), dtype=x.dtype, pin_memory=x.is_pinned())
    return torch.index_select(x, 0, keep, out=out)


class BatchLoader(RecipeLoader):
    """Iterates ``(inputs float (B, 3, S, S), targets)`` over uint8 images in memory,
    augmenting whole batches (:class:`BatchRecipe`).

    Train: the epoch permutation comes from ``(seed, epoch)`` (identical on every rank);
    each index is repeated ``repeated_aug`` times (DeiT RASampler), the list is padded to a
    multiple of ``world_size`` by repeating its start and rank ``r`` takes ``r::world_size``
    (``DistributedSampler``). With ``repeated_aug > 1`` each rank keeps only its first
    ``N // world_size`` samples so an epoch still covers about N images (RASampler also
    rounds N down to a multiple of 256; we don't). Augmentation randomness comes from
    ``(seed, epoch, rank)``, so a run is reproducible and resumable at any epoch boundary.
    Ops: crop + flip (uint8) -> RandAugment (uint8) -> normalize -> random erasing ->
    mixup/cutmix, all on ``device``: a GPU gets the uint8 batch (pinned, non-blocking) before
    the crop, a CPU run augments where the images are. Targets are soft ``(B, num_classes)``
    when mixup/cutmix or label smoothing is on, else int64 labels.

    Mixup needs an even batch: ``batch_size`` must be even, and an odd final partial batch
    (only with ``drop_last=False``) loses its last sample (a lone sample is not yielded).

    Eval: dataset order, no augmentation except :func:`resize_center_crop` when the images
    are not ``img_size`` square, int64 labels. With several ranks, eval is *not* padded: rank
    ``r`` gets the disjoint strided shard ``r::world_size``, so the shards cover the dataset
    exactly once and summed per-rank metrics are exact. Shard sizes (hence batch counts) may
    differ by one between ranks, so do cross-rank reductions after the loop, not per batch;
    :attr:`num_samples` gives this rank's count. ``with_index`` (eval): yield
    ``(inputs, labels, indices)``, the indices of the batch's images in the split (so results
    can be matched to files, and images a streamed split could not read are accounted for).

    The engine's loader contract (:class:`lgvit.data.protocol.TrainLoader`).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        num_classes: int,
        train: bool,
        aug: AugmentConfig | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool | None = None,
        device: torch.device | str = "cpu",
        repeated_aug: int = 1,
        with_index: bool = False,
    ) -> None:
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images)
            raise LgvitError(f"images must be a (N, 3, H, W) tensor, got {shape}")
        if images.dtype != torch.uint8:
            raise LgvitError(f"images must be uint8, got {images.dtype}")
        self.images = images
        self.recipe = BatchRecipe(
            images.shape[0], labels, batch_size, num_classes=num_classes, train=train, aug=aug,
            seed=seed, rank=rank, world_size=world_size, drop_last=drop_last, device=device,
            repeated_aug=repeated_aug, with_index=with_index, labels_device=images.device,
        )  # fmt: skip
        self.labels = self.recipe.labels
        self.aug = self.recipe.aug

    def indices(self) -> torch.Tensor:
        """Dataset indices this rank visits in the current epoch, in order (before batching)."""
        return self.recipe.indices()

    @property
    def num_samples(self) -> int:
        """Samples this rank visits per epoch before batching (eval: its true share)."""
        return self.recipe.num_samples

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        r = self.recipe
        idx_all = r.indices()
        bounds = r.batch_bounds(idx_all.numel())
        if idx_all.device != self.images.device:  # once per pass, not a copy per batch
            idx_all = idx_all.pin_memory().to(self.images.device, non_blocking=True)
        start, gen = r.pass_start()
        for s, e in bounds[start:]:
            idx = idx_all[s:e]
            x, y = self.images[idx], self.labels[idx]
            yield r.train_batch(x, y, gen, idx) if r.train else r.eval_batch(x, y, idx)
