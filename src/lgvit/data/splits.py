"""What every dataset loader returns: uint8 image splits and their normalisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from PIL import Image

from lgvit.data.decode import load_rgb

__all__ = ["DatasetSplits", "FileImageSet", "ImageSet", "SampleSet"]


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
