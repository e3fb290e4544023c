"""Model registry: ``@register_model``, ``create_model``, ``list_models``.

The same shape as timm's registry, without its machinery: a registered function builds a model
from keyword overrides, and carries a ``ModelConfig`` with the default input size, normalisation
and the paper's reference numbers.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.nn as nn

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2471, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ModelConfig:
    """Defaults a registered model carries (what timm calls ``pretrained_cfg``)."""

    input_size: tuple[int, int, int] = (3, 224, 224)
    num_classes: int = 1000
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    dataset: str = "imagenet"
    paper: dict[str, Any] = field(default_factory=dict)  # reference numbers from the paper

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_MODELS: dict[str, Callable[..., nn.Module]] = {}
_CONFIGS: dict[str, ModelConfig] = {}


def register_model(
    fn: Callable[..., nn.Module] | None = None, *, config: ModelConfig | None = None
) -> Callable:
    """Register a model-building function under its own name.

    Usable bare (``@register_model``) or with a config (``@register_model(config=...)``).
    """

    def wrap(f: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = f.__name__
        if name in _MODELS:
            raise ValueError(f"model {name!r} is registered twice")
        _MODELS[name] = f
        _CONFIGS[name] = config or ModelConfig()
        return f

    return wrap(fn) if fn is not None else wrap


def list_models(pattern: str | None = None) -> list[str]:
    """Registered model names, sorted; ``pattern`` is a shell-style wildcard (``'lsa_*'``)."""
    names = sorted(_MODELS)
    if pattern:
        names = [n for n in names if fnmatch.fnmatch(n, pattern)]
    return names


def is_model(name: str) -> bool:
    return name in _MODELS


def get_model_config(name: str) -> ModelConfig:
    _check_name(name)
    return _CONFIGS[name]


def _check_name(name: str) -> None:
    if name not in _MODELS:
        close = [n for n in _MODELS if name.split("_")[0] in n][:8]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise ValueError(f"unknown model {name!r} (see `lgvit info` for the list){hint}")


def create_model(name: str, num_classes: int | None = None, **overrides: Any) -> nn.Module:
    """Build a registered model.

    ``num_classes`` defaults to the model's config; any other keyword overrides an architecture
    argument (``img_size=64``, ``drop_path_rate=0.2``, ...).
    """
    _check_name(name)
    cfg = _CONFIGS[name]
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    overrides.setdefault("num_classes", cfg.num_classes)
    model = _MODELS[name](**overrides)
    model.default_cfg = cfg
    model.model_name = name
    return model
