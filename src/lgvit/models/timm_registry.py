"""lgvit's models in timm's registry: ``import lgvit, timm`` and ``timm.create_model(name)``.

With timm installed, ``import lgvit`` registers every lgvit model in timm's registry under its own
name (never over one of timm's: a name timm already has is left to timm). timm is not imported
for it -- that costs about a second -- unless it is already loaded: an import hook registers the
models right after ``import timm`` finishes, in whichever order the two are imported. Without timm
nothing happens; a timm older than 0.9 (no ``timm.models._registry``) imports as it would alone,
with a warning that the models are not registered in it. :func:`register_in_timm` does the same
explicitly.

Each registered entrypoint builds the model with :func:`lgvit.create_model`, so timm's arguments
mean what they mean in lgvit (``num_classes``, ``features_only``, ``out_indices``, ``img_size``,
``in_chans``, ``drop_path_rate``, ``global_pool``, ``pretrained_cfg_overlay=dict(file=...)``).
``timm.create_model(name, pretrained=True)`` (or ``"name.tag"``) loads the authors' released
weights through lgvit's download cache (timm's ``cache_dir`` is its folder); each released file
is a pretrained tag in timm's registry (``timm.list_pretrained("lit_*")``).
timm's own ``checkpoint_path`` loads through ``model.load_state_dict``, which maps the authors'
checkpoint layouts (:meth:`StagedViT.load_state_dict`). ``timm.create_model('local-dir:DIR',
pretrained=True)`` and ``hf-hub:`` read the folders :meth:`save_pretrained` writes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.nn as nn

from lgvit.models.base import POOLS
from lgvit.models.registry import FeatureMaps, create_model, get_model_config, list_models

TIMM_MODULE = "lgvit"  # timm.list_models(module="lgvit") lists them
# timm's pretrained_cfg keys that we fill from our ModelConfig (the rest keep timm's defaults).
_CFG_KEYS = ("input_size", "num_classes", "mean", "std", "crop_pct", "crop_mode",
             "interpolation", "first_conv", "classifier")  # fmt: skip
# timm's feature wrappers that ours stands for: a list of NCHW maps from forward_intermediates.
_FEATURE_CLS = ("list", "getter")
_registered: list[str] = []


def timm_pretrained_cfg(name: str) -> dict[str, Any]:
    """The timm ``pretrained_cfg`` of a registered lgvit model (``pool_size`` aside, which needs
    the built model)."""
    cfg = get_model_config(name).to_dict()
    out = {k: cfg[k] for k in _CFG_KEYS}
    out.update(architecture=name, fixed_input_size=True)
    return out


def timm_default_cfgs(names: list[str]) -> dict[str, Any]:
    """timm's ``DefaultCfg`` per model: one tag per released classification weights
    (:mod:`lgvit.models.weights`; the first is the default), else the untagged config."""
    from timm.models import generate_default_cfgs

    from lgvit.models.weights import weights_of
    from lgvit.task_table import CLASSIFICATION

    cfgs: dict[str, dict[str, Any]] = {}
    for n in names:
        released = [w for w in weights_of(n) if w.task == CLASSIFICATION]
        for w in released:
            cfgs[w.name] = {**timm_pretrained_cfg(n), **w.pretrained_cfg()}
        if not released:
            cfgs[n] = timm_pretrained_cfg(n)
    return dict(generate_default_cfgs(cfgs))


def _tag(pretrained_cfg: Any) -> str | None:
    """The pretrained tag timm hands over: ``create_model("name.tag")`` passes it as a string;
    a ``PretrainedCfg`` or dict carries it as ``tag``."""
    if isinstance(pretrained_cfg, str):
        return pretrained_cfg or None
    tag = getattr(pretrained_cfg, "tag", None)
    if tag is None and isinstance(pretrained_cfg, dict):
        tag = pretrained_cfg.get("tag")
    return tag or None


def _folder(cfg: dict[str, Any]) -> str | None:
    """``local-dir:DIR`` / ``hf-hub:ORG/NAME`` when timm hands over a saved folder's config."""
    if cfg.get("source") == "local-dir" and cfg.get("file"):
        return f"local-dir:{cfg['file']}"
    if cfg.get("source") == "hf-hub" and cfg.get("hf_hub_id"):
        return f"hf-hub:{cfg['hf_hub_id']}"
    return None


def _entrypoint(name: str) -> Callable[..., nn.Module]:
    def build(
        pretrained: bool = False,
        pretrained_cfg: Any = None,
        pretrained_cfg_overlay: dict[str, Any] | None = None,
        cache_dir: Any = None,
        **kwargs: Any,
    ) -> nn.Module:
        feature_cls = kwargs.pop("feature_cls", None)
        if feature_cls is not None and str(feature_cls).lower() not in _FEATURE_CLS:
            raise ValueError(
                f"{name}: feature_cls={feature_cls!r}; lgvit's features_only gives a list of "
                f"NCHW maps ({' or '.join(_FEATURE_CLS)})"
            )
        features_only = kwargs.pop("features_only", False)
        out_indices = kwargs.pop("out_indices", None)
        num_classes = kwargs.pop("num_classes", None)
        global_pool = kwargs.pop("global_pool", None)  # timm's argument; a pooling, no weights
        kwargs.pop("pretrained_model_args", None)  # already merged into kwargs by timm
        given = pretrained_cfg if isinstance(pretrained_cfg, dict) else {}
        folder = _folder(given)
        tag = None if folder else _tag(pretrained_cfg)
        if pretrained:
            # timm's meaning: the weights (a folder's, a file's, or the released ones of the
            # tag, downloaded into cache_dir), then a new classifier if another class count is
            # asked for (lgvit's checkpoint_path refuses that instead).
            model = create_model(
                folder or (f"{name}.{tag}" if tag else name), pretrained=folder is None,
                pretrained_cfg_overlay=pretrained_cfg_overlay,
                cache_dir=None if cache_dir is None else str(cache_dir), **kwargs,
            )  # fmt: skip
            if num_classes is not None and num_classes != model.num_classes:
                model.reset_classifier(num_classes)
                model.pretrained_cfg.pop("label_names", None)  # the old head's outputs
        else:
            if num_classes is None:
                num_classes = given.get("num_classes")  # a saved folder's class count
            model = create_model(name, num_classes=num_classes, **kwargs)
        if global_pool is not None:
            if global_pool not in POOLS:
                raise ValueError(f"global_pool {global_pool!r} is not one of {POOLS}")
            model.global_pool = global_pool
        for key in ("mean", "std", "label_names", "crop_pct", "interpolation"):
            # What timm read from a saved folder, for the architecture alone; with its weights
            # lgvit's reader has set (and checked) them.
            if given.get(key) is not None and not (pretrained and folder):
                model.pretrained_cfg[key] = given[key]
        names = model.pretrained_cfg.get("label_names")
        if names is not None and len(names) != model.num_classes:
            del model.pretrained_cfg["label_names"]  # names of another head name none of ours
        return FeatureMaps(model, out_indices) if features_only else model

    build.__name__ = build.__qualname__ = name
    build.__module__ = __name__
    build.__doc__ = f"lgvit's ``{name}`` (lgvit.create_model)."
    return build


def register_in_timm() -> list[str]:
    """Register every lgvit model that timm does not already have under that name; returns the
    names registered (again: none). Raises ImportError without timm."""
    from timm.models import _registry as reg
    from timm.models import register_model

    if _registered:
        return []
    mod = sys.modules[__name__]
    names = [n for n in list_models() if n not in reg._model_entrypoints]
    mod.default_cfgs = timm_default_cfgs(names)  # read by register_model
    for n in names:
        fn = _entrypoint(n)
        setattr(mod, n, fn)
        register_model(fn)
        # timm files a model under the last part of its module's name; ours under "lgvit".
        reg._module_to_models[__name__.rsplit(".", 1)[-1]].discard(n)
        reg._module_to_models[TIMM_MODULE].add(n)
        reg._model_to_module[n] = TIMM_MODULE
    _registered.extend(names)
    return list(names)


def _register_if_supported(timm: ModuleType) -> None:
    """Register in a timm that has the registry lgvit writes to (timm >= 0.9); an older timm
    (0.3.2, which the LocalViT and LIT authors' code imports) is left as it is, with a warning,
    so that importing it beside lgvit still works."""
    try:
        importlib.import_module("timm.models._registry")
    except ImportError:
        version = getattr(timm, "__version__", "of unknown version")
        warnings.warn(
            f"lgvit: timm {version} has no timm.models._registry (timm >= 0.9 has): "
            "lgvit's models are not registered in it",
            stacklevel=2,
        )
        return
    register_in_timm()


class _AfterTimmImport(importlib.abc.MetaPathFinder):
    """Registers lgvit's models once ``import timm`` has run (timm stays unimported until the
    user imports it: ``import lgvit`` does not pay for it)."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != "timm":
            return None
        sys.meta_path.remove(self)  # once; the other finders locate timm
        spec = next((s for f in sys.meta_path if (s := _find(f, fullname, path))), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register_if_supported(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _find(finder: Any, fullname: str, path: Any) -> Any:
    find = getattr(finder, "find_spec", None)
    return find(fullname, path) if find is not None else None


def install() -> None:
    """Register now if timm is loaded, else right after it is; nothing if timm is absent."""
    if "timm" in sys.modules:
        if sys.modules["timm"] is not None:  # None: imports of timm are blocked
            _register_if_supported(sys.modules["timm"])
        return
    if importlib.machinery.PathFinder.find_spec("timm") is None:
        return
    if not any(isinstance(f, _AfterTimmImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTimmImport())
