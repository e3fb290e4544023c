"""Registered model families; importing this module registers them all."""

# Importing a family module registers its models; one line each.
from lgvit.models import lsa  # noqa: F401, I001
from lgvit.models import lsa_authors  # noqa: F401
from lgvit.models import vit  # noqa: F401
from lgvit.models import pvt  # noqa: F401
from lgvit.models import swin  # noqa: F401
from lgvit.models import localvit  # noqa: F401
from lgvit.models import lit  # noqa: F401
from lgvit.models import t2t  # noqa: F401
from lgvit.models import tnt  # noqa: F401
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
