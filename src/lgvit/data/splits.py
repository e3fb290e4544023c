"""What every dataset loader returns: uint8 image splits and their normalisation."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from PIL import Image

from lgvit.core.errors import LgvitError
from lgvit.data.decode import load_rgb

__all__ = ["DatasetSplits", "FileImageSet", "ImageSet", "SampleSet", "splits_on_device"]


@dataclass
class ImageSet:
    """One split: ``images`` uint8 ``(N, 3, H, W)``, ``labels`` int64 ``(N,)``, class names."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        # Internal invariants (a bug in a loader, not a user error), so plain ValueError.
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(
                f"images must be uint8 (N, 3, H, W), got {self.images.dtype} "
                f"{tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must be int64 ({self.images.shape[0]},), got "
                f"{self.labels.dtype} {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@runtime_checkable
class SampleSet(Protocol):
    """A split read sample by sample while iterating (image files, a Hugging Face dataset's
    rows): what :class:`lgvit.data.stream.StreamingLoader` reads."""

    labels: torch.Tensor  # int64 (N,)
    classes: list[str]

    def __len__(self) -> int: ...

    def open(self, i: int) -> Image.Image:
        """Sample ``i`` as an upright RGB image; raises when it is unreadable (the loader
        counts it as bad)."""
        ...

    def name(self, i: int) -> str:
        """Sample ``i``'s name in results and in messages."""
        ...


@dataclass
class FileImageSet:
    """A split read from its image files while iterating (too large to decode once)."""

    paths: list[str]
    labels: torch.Tensor
    classes: list[str]

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        """Image ``i``'s name in results (every split read sample by sample has one)."""
        return self.paths[i]

    def open(self, i: int) -> Image.Image:
        """Image ``i`` upright (EXIF orientation); too large or too thin images refused."""
        return load_rgb(self.paths[i])

    def encoded(self, i: int) -> bytes:
        """Image ``i``'s file as stored (what a device decoder reads)."""
        with open(self.paths[i], "rb") as f:
            return f.read()


@dataclass
class DatasetSplits:
    """Train and test splits plus the per-dataset normalisation (in ``[0, 1]`` units)."""

    train: ImageSet | SampleSet  # or a source's own split (lgvit.data.wds.ShardSet)
    test: ImageSet | SampleSet
    name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    skipped: list[str]


# data_on_device refuses splits past this share of the GPU's free memory: the rest is the run's.
ON_DEVICE_MAX_SHARE = 0.5


def splits_on_device(splits: DatasetSplits, device: torch.device | str) -> DatasetSplits:
    """Both decoded splits with their uint8 images and labels moved to ``device``, once: the
    loader then indexes each batch there and runs the recipe where the images are, with no
    host gather or copy per batch (CIFAR-10's 184 MB on a GPU). A split read from its files or
    rows, or one that would take more than half of the GPU's free memory, is one line."""
    device = torch.device(device)
    parts = {"train": splits.train, "test": splits.test}
    for name, split in parts.items():
        if not isinstance(split, ImageSet):
            raise LgvitError(
                f"data_on_device: the {name} split of {splits.name} is read from its files while "
                "training, not decoded into memory (set data_on_device false)"
            )
    need = sum(s.images.nbytes + s.labels.nbytes for s in parts.values())
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > ON_DEVICE_MAX_SHARE * free:
            raise LgvitError(
                f"data_on_device: the decoded splits take {need / 2**30:.1f} GiB, more than "
                f"{ON_DEVICE_MAX_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device} "
                "(set data_on_device false)"
            )
    moved = {n: replace(s, images=s.images.to(device), labels=s.labels.to(device))
             for n, s in parts.items()}  # fmt: skip
    return replace(splits, **moved)
