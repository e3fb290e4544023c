"""Model registry: ``@register_model``, ``create_model``, ``list_models``.

The same shape as timm's registry, without its machinery: a registered function builds a model
from keyword overrides and carries a ``ModelConfig`` (timm's ``pretrained_cfg``: input size,
normalisation, classifier name, and the paper's reference numbers). ``create_model`` takes
timm's arguments: ``pretrained``, ``checkpoint_path``, ``features_only``, ``out_indices``.
"""

from __future__ import annotations

import fnmatch
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from lgvit.core.constants import CIFAR10_MEAN, CIFAR10_STD, CROP_PCT, IMAGENET_MEAN, IMAGENET_STD
from lgvit.core.errors import LgvitError, first_line
from lgvit.models.loading import (
    FOLDER,
    RELEASED,
    create_released,
    load_checkpoint,
    weights_source,
)

if TYPE_CHECKING:
    from lgvit.checkpoints.record import CheckpointRecord

# Where a paper's throughput and memory figures were measured (`lgvit bench` names it beside
# them). The LSA paper gives img/s on a GPU it does not name; the LocalViT paper gives none.
LSA_PAPER_GPU = "LSA paper: img/s on a GPU it does not name, batch not given"
LIT_PAPER_GPU = "LIT paper, Table 1: RTX 3090, batch 64, memory = training / test peak"


def lit_paper_speed(img_s: float, train_mem_mb: float, test_mem_mb: float) -> dict[str, Any]:
    """The LIT paper's Table 1 throughput and peak memory, with where they were measured."""
    return dict(
        img_s=img_s, train_mem_mb=train_mem_mb, test_mem_mb=test_mem_mb, hardware=LIT_PAPER_GPU
    )


CIFAR_MEAN, CIFAR_STD = CIFAR10_MEAN, CIFAR10_STD  # the names the families import


@dataclass(frozen=True)
class ModelConfig:
    """Defaults a registered model carries (what timm calls ``pretrained_cfg``).

    ``smoke_input_size`` is the small input the contract tests run every model at; it is not a
    ``pretrained_cfg`` key (timm's ``test_input_size`` means the size to evaluate at, and a model
    is evaluated at ``input_size`` here).
    """

    input_size: tuple[int, int, int] = (3, 224, 224)
    num_classes: int = 1000
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    crop_pct: float = CROP_PCT
    crop_mode: str = "center"  # timm's: the eval crop is a centre crop
    interpolation: str = "bicubic"
    first_conv: str | tuple[str, ...] = "patch_embed.proj"  # a tuple: a stem of several
    classifier: str = "head"
    dataset: str = "imagenet"
    smoke_input_size: tuple[int, int, int] = (3, 64, 64)
    paper: dict[str, Any] = field(default_factory=dict)  # reference numbers from the paper

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_MODELS: dict[str, Callable[..., nn.Module]] = {}
_CONFIGS: dict[str, ModelConfig] = {}
# Checkpoint layouts only one registered model reads (the LSA authors' releases): each function
# returns that model's name for a state dict in its layout, else None.
_LAYOUT_OWNERS: list[Callable[[dict[str, torch.Tensor]], str | None]] = []


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


def register_checkpoint_layout(
    owner_of: Callable[[dict[str, torch.Tensor]], str | None],
) -> Callable[[dict[str, torch.Tensor]], str | None]:
    """Register ``owner_of(state_dict) -> model name | None``: a checkpoint it claims loads only
    into that model; any other model refuses it, naming that one."""
    _LAYOUT_OWNERS.append(owner_of)
    return owner_of


def checkpoint_layout_owner(state_dict: dict[str, torch.Tensor]) -> str | None:
    """The registered model whose foreign layout ``state_dict`` is in, if any."""
    return next((n for f in _LAYOUT_OWNERS if (n := f(state_dict)) is not None), None)


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


def model_class(name: str) -> type:
    """The class registered model ``name`` (``name.tag``, or a ``local-dir:``/``hf-hub:``
    folder: the architecture its config names) builds, read from its constructor's return
    annotation: asked without building the model."""
    import typing

    from lgvit.models import hub

    if name.startswith(hub.FOLDER_PREFIXES):
        name = hub.read_config(_hub_folder(name))["architecture"]
    return typing.get_type_hints(_MODELS[_architecture(name)])["return"]


def _check_name(name: str) -> None:
    if name not in _MODELS:
        close = [n for n in _MODELS if name.split("_")[0] in n][:8]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise ValueError(f"unknown model {name!r} (see `lgvit info` for the list){hint}")


class ModelArgumentError(LgvitError, ValueError):
    """An argument of :func:`create_model` that builds no sensible model: one line naming it
    (a ValueError too, as timm raises for a bad argument)."""


def _check_img_size(size: Any) -> None:
    """``img_size``: a positive int or an (height, width) pair of them (a string such as "32"
    would build a model for another input, a float such as 32.0 fails deep inside)."""
    from lgvit.checkpoints.files import is_img_size

    if size is not None and not is_img_size(size):
        raise ModelArgumentError(
            f"img_size {size!r}: must be a positive int or a (height, width) pair of them"
        )


def _check_num_classes(n: Any) -> None:
    """``num_classes``: a whole number >= 0 (0: no classifier; a negative count built none
    silently)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ModelArgumentError(
            f"num_classes {n!r}: must be a whole number >= 0 (0: no classifier, the pooled "
            "features come out)"
        )


def pretrained_cfg_for(
    name: str, model: nn.Module, record: CheckpointRecord | None = None
) -> dict[str, Any]:
    """timm-style ``pretrained_cfg`` dict of a built model: the registered defaults, with the
    model's real input size and class count, and -- for a model loaded from an lgvit
    checkpoint -- the normalisation and class names it was trained with."""
    cfg = _CONFIGS[name].to_dict()
    del cfg["smoke_input_size"]
    img = getattr(model, "img_size", None)
    if img is not None:
        cfg["input_size"] = (getattr(model, "in_chans", 3), *img)
    cfg["num_classes"] = getattr(model, "num_classes", cfg["num_classes"])
    cfg["fixed_input_size"] = not getattr(model, "dynamic_img_size", False)
    info = getattr(model, "feature_info", None)
    if info:  # timm's: the final feature map's size at input_size
        r = info[-1]["reduction"]
        cfg["pool_size"] = tuple(-(-s // r) for s in cfg["input_size"][1:])  # padded up
    cfg["architecture"] = name
    if record is None:
        return cfg
    for key in ("mean", "std"):
        if getattr(record, key) is not None:
            cfg[key] = tuple(getattr(record, key))
    if record.classes is not None:
        cfg["label_names"] = list(record.classes)
    if record.dataset is not None:
        cfg["dataset"] = record.dataset
    if record.crop_pct is not None:
        cfg["crop_pct"] = record.crop_pct
    return cfg


def create_model(
    name: str,
    pretrained: bool = False,
    num_classes: int | None = None,
    *,
    checkpoint_path: str | None = None,
    features_only: bool = False,
    out_indices: int | Sequence[int] | None = None,
    pretrained_cfg_overlay: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build a registered model (timm's ``create_model``).

    Args:
        name: a registered name; ``name.tag`` (timm's form) naming released weights;
            ``local-dir:DIR`` (a folder written by ``save_pretrained``) or ``hf-hub:ORG/NAME``
            (the same layout on the Hugging Face hub; needs ``huggingface_hub``).
        pretrained: the authors' released weights (the tag's, else the model's default; see
            ``lgvit weights list``), downloaded once into the weights cache (``cache_dir``,
            default ``$LGVIT_WEIGHTS_DIR``, else torch hub's); another ``num_classes`` gets a
            new classifier on them (timm's rule).
        num_classes: the classifier size (default: the config's, or the checkpoint's).
        checkpoint_path: weights to load: an lgvit checkpoint (``runs/x/best``, a
            ``.safetensors``) or a ``.pth``/``.pt`` state dict -- including the authors'
            released checkpoints, whose layout the family maps. Loaded with
            ``weights_only=True``; a file that does not fit is an error naming the key.
        features_only: return a module whose forward gives the list of feature maps
            (``out_indices`` chooses which; default every stage), with ``feature_info``.
        pretrained_cfg_overlay: timm's; ``dict(file=PATH)`` with ``pretrained=True`` loads PATH.
        overrides: architecture arguments (``img_size=64``, ``drop_path_rate=0.2``, ...).

    Where the weights come from is settled first (:func:`~lgvit.models.loading.weights_source`:
    a folder, the released file, a checkpoint file or none), then that source's model is built
    and loaded (:mod:`lgvit.models.loading` adapts and loads every state dict).
    """
    if num_classes is not None:  # the caller's own arguments: named as theirs
        _check_num_classes(num_classes)
    _check_img_size(overrides.get("img_size"))
    source = weights_source(name, pretrained, checkpoint_path, pretrained_cfg_overlay)
    if source.kind == FOLDER:
        model = _create_from_folder(name, num_classes, overrides)
    elif source.kind == RELEASED:
        model = _create_pretrained(name, num_classes, cache_dir, overrides)
    else:
        model = _create_from_file(_architecture(name), source.path, num_classes, overrides)
    return FeatureMaps(model, out_indices) if features_only else model


def _architecture(name: str) -> str:
    """The registered model ``name`` (or ``name.tag``, whose tag must exist) builds."""
    if "." in name:
        from lgvit.models.weights import find_weights, resolve_weights

        _check_name(name.partition(".")[0])
        name = (find_weights(name) or resolve_weights(name)).model
    _check_name(name)
    return name


def _create_from_file(
    name: str, path: str | None, num_classes: int | None, overrides: dict[str, Any]
) -> nn.Module:
    """The registered model ``name``, with the weights of the checkpoint ``path`` when one is
    given: the file read once, the input size and architecture choices its record holds
    taken where the caller gave none."""
    cfg = _CONFIGS[name]
    weights, record = _read_checkpoint(path, name) if path is not None else (None, None)
    if record is not None:
        if record.img_size is not None:
            overrides.setdefault("img_size", record.img_size)
        for key, value in (record.model_kwargs or {}).items():
            overrides.setdefault(key, value)  # architecture choices the run was trained with
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    overrides.setdefault("num_classes", cfg.num_classes)
    _check_num_classes(overrides["num_classes"])
    _check_img_size(overrides.get("img_size"))
    try:
        model = _MODELS[name](**overrides)
    except TypeError as e:
        if record is None or not record.model_kwargs:
            raise
        raise LgvitError(
            f"{path}: metadata model_kwargs do not fit {name} ({first_line(e)})"
        ) from None
    # The architecture arguments, so save_pretrained can write them (class count aside, and
    # LIT's deform_impl: which kernel runs on this machine, not what the model is).
    model.model_args = {
        k: v for k, v in overrides.items() if k not in ("num_classes", "deform_impl")
    }
    if weights is not None:
        load_checkpoint(
            model, weights, str(path), name, cfg.first_conv, cfg.classifier, num_classes
        )
    model.pretrained_cfg = pretrained_cfg_for(name, model, record)
    model.model_name = name
    return model


def _read_checkpoint(path: str, name: str) -> tuple[dict[str, torch.Tensor], CheckpointRecord]:
    """The weights and the record of the checkpoint ``path``, from one read of the file; a file
    in the authors' layout of another model is refused before anything is built."""
    from lgvit.checkpoints.files import load_weights_and_metadata
    from lgvit.checkpoints.record import CheckpointRecord

    weights, meta = load_weights_and_metadata(path)
    owner = checkpoint_layout_owner(weights)
    if owner is not None and owner != name:
        raise LgvitError(
            f"{path} is a checkpoint in the authors' layout of {owner}, which "
            f"{name} does not read: load it as {owner} (create_model('{owner}', "
            f"checkpoint_path=...), --model {owner})"
        )
    record = CheckpointRecord.from_meta(meta, path)  # malformed: one line, file and key
    return weights, record


def _create_pretrained(
    name: str, num_classes: int | None, cache_dir: str | None, overrides: dict[str, Any]
) -> nn.Module:
    """``name`` (``model`` or ``model.tag``) with its released weights from the cache (the
    shared builder, :func:`~lgvit.models.loading.create_released`); another ``num_classes``
    gets a new classifier on them (timm's rule)."""
    from lgvit.models.weights import resolve_weights

    _check_name(name.partition(".")[0])
    w = resolve_weights(name)

    def make(path: Any, kwargs: dict[str, Any]) -> nn.Module:
        return create_model(w.model, checkpoint_path=str(path), **kwargs)

    model = create_released(w, make, overrides, cache_dir)
    if num_classes is not None and num_classes != model.num_classes:
        model.reset_classifier(num_classes)  # timm's meaning: their weights, a new classifier
    model.pretrained_cfg["num_classes"] = model.num_classes
    return model


def _hub_folder(name: str) -> Any:
    """The folder of ``local-dir:DIR`` (DIR) or ``hf-hub:ORG/NAME`` (downloaded once)."""
    from lgvit.models import hub

    kind, _, where = name.partition(":")
    return where if kind == "local-dir" else hub.download(where)


def _create_from_folder(name: str, num_classes: int | None, overrides: dict[str, Any]) -> nn.Module:
    """``local-dir:DIR`` / ``hf-hub:ORG/NAME``: the architecture the folder's config names,
    its arguments, weights, preprocessing and class names."""
    from lgvit.models import hub

    if num_classes is not None:
        overrides["num_classes"] = num_classes
    folder = _hub_folder(name)
    config = hub.read_config(folder)
    arch = config["architecture"]
    if not is_model(arch):
        raise LgvitError(f"{folder}/{hub.CONFIG_NAME}: unknown architecture {arch!r}")
    weights = hub.weights_file(folder)
    args = {**config.get("model_args", {}), **overrides}
    args.setdefault("num_classes", config.get("num_classes"))
    try:
        model = create_model(arch, checkpoint_path=str(weights), **args)
    except (TypeError, ValueError) as e:  # model_args the architecture does not take
        raise LgvitError(f"{folder}/{hub.CONFIG_NAME}: model_args: {first_line(e)}") from None
    resized = bool({"img_size", "in_chans"} & overrides.keys())  # the caller's input
    hub.apply_saved_cfg(model, config, str(folder), resized)
    return model


class FeatureMaps(nn.Module):
    """``create_model(..., features_only=True)``: forward returns the list of feature maps
    ``(B, C, H, W)`` of the stages in ``out_indices``; ``feature_info`` describes them. The
    stages after the last one asked for, the final norm and the head are dropped."""

    def __init__(self, model: nn.Module, out_indices: int | Sequence[int] | None = None) -> None:
        super().__init__()
        n = len(model.feature_info)
        indices = list(range(n)) if out_indices is None else out_indices
        indices = indices if isinstance(indices, int) else list(indices)
        if indices == []:
            raise ModelArgumentError(
                f"out_indices={out_indices!r} asks for no feature map; choose from 0 to {n - 1} "
                "(or leave it out: all of them)"
            )
        self.out_indices = model.prune_intermediate_layers(indices, prune_norm=True)
        self.feature_info = model.feature_info.select(self.out_indices)
        self.model = model

    output_fmt = "NCHW"  # timm's: the layout of the maps forward returns

    @property
    def pretrained_cfg(self) -> dict[str, Any]:
        """The wrapped model's (timm's feature wrappers share it too)."""
        return self.model.pretrained_cfg

    @pretrained_cfg.setter
    def pretrained_cfg(self, cfg: dict[str, Any]) -> None:
        self.model.pretrained_cfg = cfg

    default_cfg = pretrained_cfg

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model.forward_intermediates(
            x, self.out_indices, intermediates_only=True, stop_early=True
        )
