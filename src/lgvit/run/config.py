"""Training configuration as plain data: a dataclass, a flat YAML file, command-line overrides.

Precedence, lowest to highest: the dataclass defaults, the YAML file, explicit command-line flags
(keyword arguments that are not None), then ``--set key=value`` items, applied last so they win.

The YAML file is a *flat* mapping of field names to values; a nested mapping is an error naming
the key (one namespace keeps ``--set key=value`` and the file in the same terms). Values are
coerced to the field's type: ``5e-4`` (which YAML 1.1 reads as a string) becomes a float, a
two-item list becomes a tuple, ``null``/``none`` becomes None for optional fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lgvit.checkpoints.kinds import DETECTORS
from lgvit.core.atomic import atomic_write_bytes
from lgvit.core.constants import CROP_PCT, DECODE_WORKERS, MAX_BAD_FRACTION, MAX_DENSE_SCALE
from lgvit.core.errors import LgvitError, first_line
from lgvit.core.runtime import AMP_MODES, COMPILE_MODES
from lgvit.data.coco import COCO_DATASETS, DET_SCALE
from lgvit.data.datasets import DATASETS
from lgvit.data.device_decode import DECODE_DEVICES
from lgvit.data.recipe import DEIT_RECIPE as _R
from lgvit.data.recipe import RE_MODES, TRAIN_CROPS
from lgvit.data.segmentation import SEG_DATASETS, SEG_SCALE
from lgvit.data.sources import DATA_SOURCES, OPTION_KEYS, sources_taking
from lgvit.run.loggers import LOGGERS
from lgvit.task_table import ALL_DATASETS, DEFAULT_TASK, TASK_NAMES, TASKS, TTA_MODES, get_task

__all__ = [
    "AMP_MODES",
    "COCO_DATASETS",
    "DATASETS",
    "DETECTORS",
    "SEG_DATASETS",
    "TrainConfig",
    "config_description",
    "config_text",
    "config_from_dict",
    "config_keys",
    "config_to_dict",
    "global_batch",
    "load_config",
    "load_config_with_explicit",
    "resolve_config",
    "save_config",
    "scaled_lr",
    "shipped_configs",
    "validate_config",
]

OPTIMIZERS = ("adamw", "sgd", "lamb")
SCHEDULES = ("cosine", "linear", "step", "poly", "none")
DEVICES = ("auto", "cpu", "cuda")  # a run's device (auto: CUDA when there is one)
MAX_IMG_SIZE = 4096  # beyond any model here; larger sizes only exhaust memory in the size probe


@dataclass
class TrainConfig:
    """Everything a training run needs; saved with every checkpoint."""

    task: str = DEFAULT_TASK  # one of lgvit.task_table.TASK_NAMES (lgvit train --help lists them)
    # model
    model: str = "lsa_micro_cifar"  # registered model name (`lgvit info` lists them)
    num_classes: int | None = None  # None -> from the dataset
    img_size: int | None = None  # None -> model default
    patch_size: int | None = None  # None -> model default (e.g. 4 for ViTs on 32px images)
    window_size: int | None = None  # None -> model default (Swin's attention windows)
    drop_path: float = 0.1  # stochastic depth rate of the last block (linear from 0)
    # data
    data: str = "cifar10"  # cifar10 | cifar100 | imagefolder | digits | synthetic | ade20k | ...
    data_dir: str | None = None  # archive or folder of the data (cifar: downloaded if None)
    cache_dir: str | None = None  # where decoded uint8 images are cached (~/.cache/lgvit)
    # unreadable images tolerated per split before stopping
    max_bad_fraction: float = MAX_BAD_FRACTION
    stream: bool | None = None  # imagefolder: None = stream from files when too big to cache
    # classification: the decoded splits' uint8 images moved to the device once, batches
    # indexed and augmented there (no host work per batch); CIFAR-sized data on a GPU
    data_on_device: bool = False
    # wds / hfds (None: timm's defaults): a shard sample's image key(s), e.g. 'jpg;png;webp'
    # (the first present), or a dataset's image column ('image'); the label's ('cls', 'label')
    input_key: str | None = None
    target_key: str | None = None
    train_split: str | None = None  # wds / hfds: the split trained on (None: train)
    val_split: str | None = None  # wds / hfds: the split evaluated (None: validation)
    # schedule
    epochs: int = 300  # training epochs
    iters: int | None = None  # an iteration budget instead (the run's epochs follow from it)
    batch_size: int = 64  # per process
    grad_accum_steps: int = 1  # micro-batches of batch_size per optimizer step (timm's flag)
    lr: float = 5e-4  # for a global batch of lr_base_batch; scaled linearly, see scaled_lr()
    lr_base_batch: int = 512  # the global batch lr is given for (DeiT: 512)
    min_lr: float = 1e-5  # where the schedule decays to
    warmup_lr: float = 1e-6  # where the linear warm-up starts
    warmup_epochs: float = 5.0  # linear warm-up length (fractions allowed)
    warmup_iters: int | None = None  # the warm-up in iterations instead (mmdet's warmup_iters)
    weight_decay: float = 0.05  # decoupled; none on position embeddings, norms, biases
    # fine-tuning: layer-wise lr decay, each block's lr x layer_decay^(blocks above it) (None: off)
    layer_decay: float | None = None
    clip_grad: float | None = 5.0  # gradient-norm clip (None: off)
    opt_betas: tuple[float, float] = (0.9, 0.999)  # AdamW / LAMB betas
    opt_eps: float = 1e-8  # AdamW / LAMB epsilon
    opt: str = "adamw"  # adamw | sgd (momentum 0.9, nesterov) | lamb
    momentum: float = 0.9  # sgd
    sched: str = "cosine"  # cosine | linear | step | poly | none (after the linear warm-up)
    poly_power: float = 0.9  # poly: lr = min_lr + (base - min_lr) * (1 - t)^power
    decay_epochs: float = 30.0  # step: multiply the lr by decay_rate every decay_epochs
    decay_rate: float = 0.1  # step: the factor
    decay_milestones: tuple[float, ...] = ()  # step: decay after these epochs instead (mmdet)
    no_decay_keys: tuple[str, ...] = ()  # detection: no weight decay where a name holds one
    # augmentation (DeiT)
    train_crop: str = _R["train_crop"]  # random_crop | random_resized_crop | none
    crop_padding: int = _R["crop_padding"]  # random_crop's zero padding (CIFAR recipe: 4)
    hflip: bool = _R["hflip"]  # random horizontal flip
    # with hflip: each image mirrored in every other epoch (airbench)
    alternate_flip: bool = _R["alternate_flip"]
    rand_augment: str | None = _R["rand_augment"]  # timm RandAugment spec (None: off)
    mixup: float = _R["mixup"]  # mixup alpha (0: off)
    cutmix: float = _R["cutmix"]  # cutmix alpha (0: off)
    # chance of cutmix instead of mixup when both are on
    mixup_switch_prob: float = _R["mixup_switch_prob"]
    mixup_prob: float = _R["mixup_prob"]  # chance a batch is mixed at all
    label_smoothing: float = _R["label_smoothing"]  # label smoothing of the targets
    reprob: float = _R["reprob"]  # random erasing probability
    remode: str = _R["remode"]  # random erasing fill: pixel | rand | const
    repeated_aug: int = 1  # repeated augmentation count (DeiT RASampler; 1: off)
    crop_pct: float = CROP_PCT  # eval: resize to size / crop_pct, then centre crop
    # segmentation (mmseg's ADE20K pipeline; img_size is the crop)
    seg_scale: tuple[int, int] = SEG_SCALE  # images rescaled to fit (long, short) x ratio
    seg_ratio_range: tuple[float, float] = (0.5, 2.0)  # training: random ratio of seg_scale
    cat_max_ratio: float = 0.75  # training crops: at most this share of one class (10 tries)
    photometric: bool = True  # training: mmseg's photometric distortion
    # detection (torchvision's RetinaNet / Mask R-CNN as LIT's mmdet configs)
    detector: str = DETECTORS[0]  # retinanet | maskrcnn
    det_scale: tuple[int, int] = DET_SCALE  # images resized to fit (long, short), ratio kept
    # progressive resizing: early epochs train on downscaled batches, then the full size
    train_size_start: int | None = None  # training input size of the first epochs (None: off)
    train_size_ramp: tuple[float, float] = (0.25, 0.75)  # run fractions: grows to img_size
    train_size_step: int = 8  # progressive sizes: train_size_start + a multiple of this
    # model EMA
    ema: bool = False  # keep an EMA of the weights (saved as last_ema.safetensors)
    ema_decay: float = 0.99996  # EMA decay per step
    # LIT: the deformable merging's offset weights train at this factor x lr
    offset_lr_factor: float = 0.01  # LIT: lr factor of the sampling-offset weights
    # run
    device: str = "auto"  # auto (CUDA when there is one) | cpu | cuda
    amp: str = "auto"  # auto | bf16 | fp16 | none: mixed precision (auto: bf16 where supported)
    compile: bool | str = False  # torch.compile the model: false, true (default mode) or a mode
    channels_last: bool = False  # model and batches in NHWC (measure first: lgvit bench)
    tf32: bool = True  # CUDA: fp32 matmuls and convolutions in TF32 (timm's choice); false: IEEE
    # deterministic CUDA kernels (cuBLAS workspace, no cuDNN autotuning): exact reruns, slower
    deterministic: bool = False
    grad_checkpointing: bool = False  # recompute block activations in backward (less memory)
    seed: int = 0  # data order, augmentation and initialisation
    workers: int = DECODE_WORKERS  # decoding processes when an image folder streams from its files
    # none | cuda | cpu: a streamed split's JPEGs decoded and cropped there, not by PIL in the
    # workers (lgvit.data.device_decode); in-memory splits are decoded once, unaffected
    decode_device: str = "none"
    out: str = "runs/default"  # run directory: config, metrics.jsonl, checkpoints, train.log
    resume: str | None = None  # None | 'auto' (the last checkpoint in out) | a checkpoint
    initial_checkpoint: str | None = None  # start from these weights (fine-tuning), fresh run
    eval_every: int = 1  # evaluate every N epochs (and after the last)
    eval_tta: str = "none"  # none | flip | flip-translate: test-time augmentation (mean logits)
    save_every: int = 1  # write the `last` checkpoint every N epochs (and after the last)
    save_every_steps: int = 0  # also a mid-epoch checkpoint every N steps (0: off)
    save_every_min: float | None = None  # ... or every N minutes of training
    max_nonfinite: int = 0  # non-finite losses skipped (step not taken) before stopping
    log_every: int = 50  # a progress line every N steps (off a terminal; train.log always)
    log_to: tuple[str, ...] = ()  # [tensorboard, wandb]: the run's curves there too (rank 0)
    wandb_project: str | None = None  # log_to wandb: the W&B project (None: lgvit)
    keep_best: int = 0  # also keep the N best epochs' weights in <out>/kept (lgvit average)
    time_limit_min: float | None = None  # stop cleanly after this many minutes of training


_FIELDS: dict[str, Any] = typing.get_type_hints(TrainConfig)


def config_help() -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` for every config key, the meaning read from the comment on
    the key's line in :class:`TrainConfig` (one source of truth for ``lgvit train --help``)."""
    import inspect

    meaning, above = {}, ""
    for line in inspect.getsource(TrainConfig).splitlines():
        name, sep, rest = line.strip().partition(":")
        if line.strip().startswith("#"):
            above = line.strip()[1:].strip()  # a key too long for its comment has it above
        elif sep and name.isidentifier():
            meaning[name] = rest.split("#", 1)[1].strip() if "#" in rest else above
            above = ""
    return [
        (f.name, repr(f.default), meaning.get(f.name, "")) for f in dataclasses.fields(TrainConfig)
    ]


def config_keys() -> list[str]:
    """The valid configuration keys, in declaration order."""
    return [f.name for f in dataclasses.fields(TrainConfig)]


# --------------------------------------------------------------------------- coercion


class _Bad(Exception):
    """Internal: a value does not fit a type; the message says what was expected."""


def _split_optional(tp: Any) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _describe(tp: Any, optional: bool) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             bool | str: "true, false or a name"}  # fmt: skip
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        what = "names" if args[0] is str else "numbers"
        text = f"a list of {what}" if args[-1] is Ellipsis else f"a list of {len(args)} {what}"
    else:
        text = names.get(tp, str(tp))
    return text + (" or null" if optional else "")


def _coerce_scalar(value: Any, tp: Any, raw: str | None) -> Any:
    if tp == bool | str:  # compile: true, false or a mode's name (validated later)
        if isinstance(value, bool | str):
            return value
        raise _Bad
    if tp is str:
        if isinstance(value, str):
            return value
        if raw is not None:
            # `--set out=007`: YAML made it the int 7; the text the user typed is what they meant.
            return raw
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise _Bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Bad
    if isinstance(value, bool):  # bool is an int subclass; "epochs: yes" is a mistake
        raise _Bad
    if tp is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value)  # "1e3" (a string to YAML 1.1)
            except ValueError:
                raise _Bad from None
            if as_float.is_integer():
                return int(as_float)
        raise _Bad
    if tp is float:
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "5e-4" as a string
            except ValueError:
                raise _Bad from None
        raise _Bad
    raise TypeError(f"unsupported config field type {tp!r}")  # a bug in TrainConfig


def _coerce(value: Any, tp: Any, raw: str | None = None) -> Any:
    inner, optional = _split_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() == "none"):
        if optional:
            return None
        raise _Bad
    if typing.get_origin(inner) is tuple:
        items = value
        if isinstance(value, str):  # "0.9,0.95" as well as "[0.9, 0.95]"
            inside = value.strip("()[] ")
            items = [v.strip() for v in inside.split(",")] if inside else []
        args = typing.get_args(inner)
        if isinstance(items, list | tuple) and args[-1] is Ellipsis:  # any length
            args = (args[0],) * len(items)
        if not isinstance(items, list | tuple) or len(items) != len(args):
            raise _Bad
        return tuple(_coerce_scalar(v, a, None) for v, a in zip(items, args, strict=True))
    return _coerce_scalar(value, inner, raw)


def _set_value(
    values: dict[str, Any],
    sources: dict[str, str],
    key: Any,
    value: Any,
    where: str,
    shown: str,
    raw: str | None = None,
) -> None:
    """Coerce ``value`` into ``values[key]``; ``shown`` is how the error quotes the setting."""
    if not isinstance(key, str) or key not in _FIELDS:
        raise LgvitError(_unknown_key_message(key, where))
    try:
        values[key] = _coerce(value, _FIELDS[key], raw)
    except _Bad:
        inner, optional = _split_optional(_FIELDS[key])
        raise LgvitError(f"{shown}: expected {_describe(inner, optional)}") from None
    sources[key] = where


def _unknown_key_message(key: Any, where: str) -> str:
    close = difflib.get_close_matches(str(key), config_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"{where}: unknown config key {_short(key)}{hint}; valid keys: {', '.join(config_keys())}"
    )


# Values quoted in errors: bounded (a YAML value can be a huge or deeply shared structure).
_REPR = reprlib.Repr()  # Python 3.11 takes no arguments here
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 4, 4, 4
_REPR.maxstring = _REPR.maxother = 60


def _short(value: Any) -> str:
    return _REPR.repr(value)


# --------------------------------------------------------------------------- YAML


MAX_YAML_ALIASES = 16
MAX_YAML_DEPTH = 16  # a flat config nests 2 deep (the file's mapping, a list value)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, str | int | float | bool | None):
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a name, not a {type(key).__name__}", key_node.start_mark
            )
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_short(key)}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


def _check_yaml_events(text: str, where: str) -> None:
    """Before anything is built: an alias bomb expands exponentially when used, and a
    structure nested thousands deep takes PyYAML's scanner seconds per thousand levels (it
    rescans every open level per token) and then its constructor's recursion; a flat config
    needs no alias and two levels, so both are refused early, in one line."""
    aliases = depth = 0
    for ev in yaml.parse(text):
        if isinstance(ev, yaml.AliasEvent):
            aliases += 1
        elif isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise LgvitError(f"{where}: YAML nested too deeply to read (more than "
                                 f"{MAX_YAML_DEPTH} levels; a flat config has 2)")  # fmt: skip
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1
    if aliases > MAX_YAML_ALIASES:
        raise LgvitError(
            f"{where}: {aliases} YAML aliases (*name); a flat config needs none, at most "
            f"{MAX_YAML_ALIASES} are read"
        )


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LgvitError(f"{path}: no such config file")
    try:
        text = path.read_text(encoding="utf-8")
        _check_yaml_events(text, str(path))
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or first_line(e)
        raise LgvitError(f"{path}: invalid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise LgvitError(f"{path}: not a text file (UTF-8)") from None
    if data is None:  # an empty file means "all defaults"
        return {}
    if not isinstance(data, dict):
        raise LgvitError(
            f"{path}: top level must be a mapping of config keys, got {type(data).__name__}"
        )
    for key, value in data.items():
        if isinstance(value, dict):
            raise LgvitError(
                f"{path}: key {_short(key)} holds a nested mapping; lgvit configs are flat "
                "(key: value)"
            )
    return data


# --------------------------------------------------------------------------- shipped configs

# Package data: the configs install with lgvit, so `--config NAME` works from a pip install too.
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"  # lgvit/configs
CONFIG_SUFFIXES = (".yaml", ".yml")
_SENTENCE_END = re.compile(r"[.;](\s|$)")


def shipped_configs() -> dict[str, Path]:
    """The configs installed with lgvit, by name (the file name without ``.yaml``), sorted."""
    return {p.stem: p for p in sorted(CONFIGS_DIR.glob("*.yaml"))}


def config_description(path: str | Path) -> str:
    """A config's one-line description: its first comment line up to the first sentence's end
    ('' when the file starts with no comment)."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if not first.startswith("#"):
        return ""
    text = first.lstrip("#").strip()
    end = _SENTENCE_END.search(text)
    return text[: end.start()] if end else text


def config_text(spec: str | Path) -> str:
    """The text of a config, for ``lgvit configs --show``: a shipped config's name, or a YAML
    file (``.yaml``/``.yml``) holding a mapping of config keys. The command prints what it is
    given, so anything else (``/etc/passwd``) is one line, nothing printed."""
    path = resolve_config(spec)
    if path.suffix.lower() not in CONFIG_SUFFIXES:
        raise LgvitError(
            f"{spec}: not a config (a .yaml or .yml file); `lgvit configs` lists the shipped ones"
        )
    for key in _read_yaml(path):
        if not isinstance(key, str) or key not in _FIELDS:
            raise LgvitError(_unknown_key_message(key, str(path)))
    return path.read_text(encoding="utf-8")


def resolve_config(spec: str | Path) -> Path:
    """The YAML file a ``--config`` value names: an existing file (a path wins), else a shipped
    config's name, with or without ``.yaml``. Anything else is a one-line error."""
    path = Path(spec)
    if path.is_file():
        return path
    text = str(spec)
    name = text
    for suffix in CONFIG_SUFFIXES:
        name = name.removesuffix(suffix)
    shipped = shipped_configs()
    bare = path.name == text  # no folder in it: may be a shipped name
    if bare and name in shipped:
        return shipped[name]
    if path.exists():
        raise LgvitError(f"{text}: not a config file")
    stem = Path(name).name
    if not bare and stem in shipped:  # configs/X.yaml, where checkouts kept them before
        raise LgvitError(f"{text}: no such config file; the shipped one is --config {stem}")
    what = ""
    if bare:
        close = difflib.get_close_matches(name, shipped, n=1, cutoff=0.6)
        what = " or shipped config" + (f" (did you mean {close[0]}?)" if close else "")
    raise LgvitError(
        f"{text}: no such config file{what}; `lgvit configs` lists the shipped configs"
    )


# --------------------------------------------------------------------------- public API


def load_config(path: str | Path | None, overrides: Iterable[str] = (), **cli: Any) -> TrainConfig:
    """Defaults, then the YAML file at ``path`` (a file, or a shipped config's name:
    :func:`resolve_config`), then ``cli`` keywords that are not None, then ``--set key=value``
    ``overrides`` (last wins). The result is validated."""
    return load_config_with_explicit(path, overrides, **cli)[0]


def load_config_with_explicit(
    path: str | Path | None, overrides: Iterable[str] = (), **cli: Any
) -> tuple[TrainConfig, set[str]]:
    """:func:`load_config`, plus the keys set explicitly (by the YAML file, a ``cli`` keyword
    that is not None, or an override): on ``--resume`` those override the run's saved config."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        p = resolve_config(path)
        for key, value in _read_yaml(p).items():
            name = key if isinstance(key, str) else _short(key)
            _set_value(values, sources, key, value, str(p), f"{p}: {name}={_short(value)}")
    for key, value in cli.items():
        if value is None:  # an absent flag; explicit values only
            continue
        flag = "--" + str(key).replace("_", "-")
        _set_value(values, sources, key, value, flag, f"{flag} {_short(value)}")
    if overrides is None:
        overrides = ()
    elif isinstance(overrides, str):  # one "k=v" string, not an iterable of characters
        overrides = [overrides]
    for item in overrides:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise LgvitError(f"--set {item!r}: expected key=value")
        try:
            _check_yaml_events(text, f"--set {key}")
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text  # e.g. "a: b" is YAML syntax; keep the text for a str field
        _set_value(values, sources, key, value, "--set", f"--set {key}={text}", raw=text)
    cfg = TrainConfig(**values)
    validate_config(cfg, sources)
    return cfg, set(sources)


def config_from_dict(data: Mapping[str, Any], source: str = "config") -> TrainConfig:
    """A validated TrainConfig from a plain dict (e.g. the one stored in a checkpoint)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value in data.items():
        _set_value(values, sources, key, value, source, f"{source}: {key}={_short(value)}")
    cfg = TrainConfig(**values)
    validate_config(cfg, sources)
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain dict of the config (tuples become lists) for YAML, JSON and checkpoints."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write the config as flat YAML, atomically; ``load_config(path)`` reads it back equal."""
    text = "# lgvit training config (resolved)\n" + yaml.safe_dump(
        config_to_dict(cfg), sort_keys=False, default_flow_style=None
    )
    atomic_write_bytes(Path(path), text.encode("utf-8"))


def global_batch(cfg: TrainConfig, world_size: int) -> int:
    """The images of one optimizer step: per process, times processes, times accumulation."""
    return cfg.batch_size * world_size * cfg.grad_accum_steps


def scaled_lr(cfg: TrainConfig, world_size: int) -> float:
    """Peak learning rate for this run: ``lr * global_batch / lr_base_batch`` (DeiT's rule)."""
    return cfg.lr * global_batch(cfg, world_size) / cfg.lr_base_batch


def _validate_sizes(cfg: TrainConfig, fail: Any) -> None:
    """Architecture sizes, padding, the seed and the run directory."""
    if cfg.img_size is not None and cfg.img_size > MAX_IMG_SIZE:
        fail("img_size", f"must be <= {MAX_IMG_SIZE}")
    for key in ("patch_size", "window_size"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            fail(key, "must be >= 1")
    if not 0 <= cfg.crop_padding <= 256:
        fail("crop_padding", "must be in [0, 256] pixels")
    if not 0 <= cfg.seed < 2**32 - 2**16:  # numpy's seed range, less room for the ranks
        fail("seed", f"must be in [0, {2**32 - 2**16})")
    if not cfg.out:
        fail("out", "must name the run directory")


def _validate_task(cfg: TrainConfig, fail: Any) -> None:
    """The task, its data, the iteration budget, the schedule's milestones, the segmentation
    and detection keys."""
    if cfg.task not in TASKS:
        fail("task", f"must be one of {', '.join(TASK_NAMES)}")
    if cfg.data not in ALL_DATASETS:
        fail("data", f"must be one of {', '.join(ALL_DATASETS)}")
    task = get_task(cfg.task)
    if cfg.data not in task.datasets:
        fail("data", f"task={cfg.task} trains on {', '.join(task.datasets)}")
    if cfg.detector not in DETECTORS:
        fail("detector", f"must be one of {', '.join(DETECTORS)}")
    for key in ("det_scale", "seg_scale"):
        if not 1 <= min(getattr(cfg, key)) <= max(getattr(cfg, key)) <= MAX_DENSE_SCALE:
            fail(key, f"must be two sizes in [1, {MAX_DENSE_SCALE}] pixels")
    if cfg.eval_tta not in task.eval_tta:  # refused, not silently ignored
        fail("eval_tta", f"task={cfg.task} takes {' or '.join(task.eval_tta)}")
    if cfg.warmup_iters is not None and cfg.warmup_iters < 0:
        fail("warmup_iters", "must be >= 0")
    m = cfg.decay_milestones
    if any(not a < b for a, b in zip((0, *m), m, strict=False)):
        fail("decay_milestones", "must be increasing epochs > 0")
    if cfg.iters is not None and cfg.iters < 1:
        fail("iters", "must be >= 1")
    if not cfg.poly_power > 0:
        fail("poly_power", "must be > 0")
    if not 0 <= cfg.cat_max_ratio <= 1:
        fail("cat_max_ratio", "must be in [0, 1]")
    if not 0 < cfg.seg_ratio_range[0] <= cfg.seg_ratio_range[1]:
        fail("seg_ratio_range", "must be two ratios, 0 < low <= high")


def _validate_sources_and_run(cfg: TrainConfig, fail: Any) -> None:
    """The data source's keys, the loggers and the fine-tuning decay."""
    source = DATA_SOURCES.get(cfg.data)  # None: a dense task's dataset (its own checks)
    if source is not None and source.needs_dir and not cfg.data_dir:
        fail("data_dir", f"data={cfg.data} needs data_dir")
    if cfg.data_on_device and cfg.task != DEFAULT_TASK:
        fail("data_on_device", f"applies to task={DEFAULT_TASK}, not task={cfg.task}")
    if cfg.data_on_device and ((source is not None and source.streamed) or cfg.stream):
        how = "stream=true: the files are" if cfg.stream else f"data={cfg.data} is"
        fail("data_on_device", f"needs a split decoded into memory ({how} read while training)")
    for key in OPTION_KEYS:
        if getattr(cfg, key) is not None and (source is None or key not in source.options):
            fail(key, f"applies to data={' or '.join(sources_taking(key))}, not {cfg.data}")
    bad = [name for name in cfg.log_to if name not in LOGGERS]
    if bad or len(set(cfg.log_to)) != len(cfg.log_to):
        fail("log_to", f"must be a list of distinct names from {', '.join(LOGGERS)}")
    if cfg.layer_decay is not None and not 0 < cfg.layer_decay <= 1:
        fail("layer_decay", "must be in (0, 1] (e.g. 0.65-0.75 to fine-tune a ViT), or null")


def validate_config(cfg: TrainConfig, sources: Mapping[str, str] | None = None) -> None:
    """Raise LgvitError naming the first key whose value is out of range."""
    sources = sources or {}

    def fail(key: str, rule: str) -> None:
        origin = sources.get(key)
        where = f" (from {origin})" if origin else ""
        raise LgvitError(f"{key}={_short(getattr(cfg, key))}{where}: {rule}")

    def choice(key: str, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        if getattr(cfg, key) not in allowed:
            fail(key, f"must be one of {', '.join(allowed)}")

    def at_least(key: str, low: float, optional: bool = False) -> None:
        v = getattr(cfg, key)
        if v is None and optional:
            return
        if not v >= low:  # also catches NaN
            fail(key, f"must be >= {low}")

    def positive(key: str, optional: bool = False) -> None:
        v = getattr(cfg, key)
        if v is None and optional:
            return
        if not v > 0:
            fail(key, "must be > 0")

    def unit(key: str, upper_open: bool = False) -> None:
        v = getattr(cfg, key)
        ok = 0 <= v < 1 if upper_open else 0 <= v <= 1
        if not ok:
            fail(key, f"must be in [0, 1{')' if upper_open else ']'}")

    for key in _FIELDS:  # inf/nan anywhere: refused before anything runs
        v = getattr(cfg, key)
        values = v if isinstance(v, tuple | list) else (v,)
        if any(isinstance(x, float) and not math.isfinite(x) for x in values):
            fail(key, "must be a finite number")
    _validate_task(cfg, fail)
    choice("opt", OPTIMIZERS)
    choice("sched", SCHEDULES)
    choice("eval_tta", TTA_MODES)
    choice("amp", AMP_MODES)
    if cfg.compile not in (False, True, *COMPILE_MODES):
        fail("compile", f"must be true, false or a mode: {', '.join(COMPILE_MODES)}")
    choice("device", DEVICES)
    choice("decode_device", DECODE_DEVICES)
    choice("train_crop", TRAIN_CROPS)
    choice("remode", RE_MODES)
    if not cfg.model:
        fail("model", "must name a model")
    for key in ("epochs", "batch_size", "grad_accum_steps", "lr_base_batch", "repeated_aug"):
        at_least(key, 1)
    for key in ("eval_every", "save_every", "log_every"):
        at_least(key, 1)
    at_least("save_every_steps", 0)
    at_least("keep_best", 0)
    positive("save_every_min", optional=True)
    positive("decay_epochs")
    unit("decay_rate")
    unit("momentum", upper_open=True)
    at_least("num_classes", 1, optional=True)
    at_least("img_size", 1, optional=True)
    _validate_sizes(cfg, fail)
    for key in ("lr", "min_lr", "warmup_lr", "warmup_epochs", "weight_decay", "mixup", "cutmix"):
        at_least(key, 0)
    at_least("workers", 0)
    at_least("max_nonfinite", 0)
    positive("clip_grad", optional=True)
    positive("time_limit_min", optional=True)
    positive("opt_eps")
    positive("crop_pct")
    positive("offset_lr_factor")
    for key in ("max_bad_fraction", "mixup_switch_prob", "mixup_prob", "reprob"):
        unit(key)
    unit("drop_path", upper_open=True)  # 1 would drop every residual branch
    unit("label_smoothing", upper_open=True)
    at_least("train_size_start", 1, optional=True)
    at_least("train_size_step", 1)
    a, b = cfg.train_size_ramp
    if not 0 <= a <= b <= 1:
        fail("train_size_ramp", "must be two fractions of the run, 0 <= start <= end <= 1")
    unit("ema_decay", upper_open=True)
    if cfg.crop_pct > 1:
        fail("crop_pct", "must be in (0, 1]")
    if not all(0 <= b < 1 for b in cfg.opt_betas):
        fail("opt_betas", "both betas must be in [0, 1)")
    _validate_sources_and_run(cfg, fail)
