"""lgvit: locality-enhanced vision transformers in plain PyTorch."""

from lgvit.core.errors import LgvitError
from lgvit.core.runtime import tune_cpu_allocator
from lgvit.models import create_model, get_model_config, list_models, register_model

__version__ = "0.1.0"
__all__ = [
    "LgvitError",
    "create_model",
    "get_model_config",
    "list_models",
    "register_model",
    "tune_cpu_allocator",
    "__version__",
]

# With timm installed, lgvit's models are timm's too (registered when timm is imported).
from lgvit.models import timm_registry as _timm_registry  # noqa: E402

_timm_registry.install()
