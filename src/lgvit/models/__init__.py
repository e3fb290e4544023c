"""Registered model families; importing this module registers them all."""

from lgvit.models import lsa, pvt, swin, vit  # noqa: F401  (register the families)
from lgvit.models.base import StagedViT
from lgvit.models.registry import (
    FeatureMaps,
    ModelConfig,
    create_model,
    get_model_config,
    is_model,
    list_models,
    register_model,
)

__all__ = [
    "FeatureMaps",
    "ModelConfig",
    "StagedViT",
    "create_model",
    "get_model_config",
    "is_model",
    "list_models",
    "register_model",
]
