"""lgvit: locality-enhanced vision transformers in plain PyTorch."""

from lgvit.errors import LgvitError
from lgvit.models import create_model, get_model_config, list_models, register_model

__version__ = "0.1.0"
__all__ = [
    "LgvitError",
    "create_model",
    "get_model_config",
    "list_models",
    "register_model",
    "__version__",
]
