"""Turning a checkpoint into a ready model: the one path (:func:`load_eval_model`) every task's
``eval`` and ``predict``, ``viz`` and ``export`` use; each task adds its builder."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lgvit.core.errors import LgvitError


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``'auto'``: CUDA when available, else the CPU; a device that is not there is an
    error naming it."""
    if device is None or str(device) == "auto":
        return default_device()
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise LgvitError(f"--device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LgvitError(f"--device {device}: CUDA is not available on this machine")
    return dev


Resolved = tuple[str, str | None, str | None]  # (checkpoint file, --model, --detector)


@dataclass(frozen=True)
class EvalBuilder:
    """What a task adds to :func:`load_eval_model`: ``build(checkpoint, record, model_name,
    detector)`` makes its model from the checkpoint's record and loads the weights into it;
    ``task`` is the record's task (another task's checkpoint is one line from
    :func:`~lgvit.checkpoints.files.load_record`; None: the builder checks); ``build_released``
    builds a released file's model (to check a download); ``resolve``, where the task names
    its sources otherwise, replaces the released-name lookup: a ready model, or the file to
    read with its ``--model`` / ``--detector``."""

    task: str | None
    build: Callable[[str, Any, str | None, str | None], nn.Module]
    build_released: Callable[[Any], nn.Module] | None = None
    resolve: Callable[[str, str | None, str | None], nn.Module | Resolved] | None = None

    def named(self, checkpoint: str, model_name: str | None, detector: str | None) -> Any:
        if self.resolve is not None:
            return self.resolve(checkpoint, model_name, detector)
        from lgvit.dense import pretrained  # read at call time: tests watch it

        assert self.task is not None and self.build_released is not None
        released = pretrained.released_checkpoint(
            checkpoint, self.task, self.build_released, model_name, detector
        )
        if released is None:
            return checkpoint, model_name, detector
        return released[0], released[1].model, released[1].detector  # the cached file, its own


def load_eval_model(
    checkpoint: str,
    device: str | torch.device | None,
    builder: EvalBuilder,
    model_name: str | None = None,
    detector: str | None = None,
) -> nn.Module:
    """The one path from a checkpoint to a ready model, for every task: a released name or a
    folder resolved (``builder.named``), the record read and checked for the task, the model
    built and loaded by the task's ``builder``, non-finite weights refused (a diverged run's
    NaNs would only predict NaN), eval mode on ``device``. Every failure is an
    :class:`LgvitError` with one line naming the file and the problem."""
    from lgvit.checkpoints.files import check_finite_weights, load_record

    found = builder.named(str(checkpoint), model_name, detector)
    if isinstance(found, nn.Module):
        model = found
    else:
        checkpoint, model_name, detector = found
        # Checked first: another task's checkpoint or a malformed value is one line, key named.
        record = load_record(checkpoint, builder.task)
        model = builder.build(checkpoint, record, model_name, detector)
    check_finite_weights(model, checkpoint)
    return model.to(resolve_device(device)).eval()


def load_task_weights(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    checkpoint: str,
    what: str,
    authors: tuple[Callable[[Any], bool], Callable[..., Any]],
) -> None:
    """``weights`` into ``model`` strictly, the authors' layout (``authors``: its test and its
    mapping to lgvit's keys) mapped first."""
    from lgvit.checkpoints.files import load_into
    from lgvit.models.loading import adapt_state_dict

    weights = adapt_state_dict(model, weights, str(checkpoint), (authors,))
    load_into(model, weights, str(checkpoint), what)


def load_model(
    checkpoint: str,
    device: str | torch.device | None = None,
    model_name: str | None = None,
    img_size: int | None = None,
) -> nn.Module:
    """An eval-mode model on ``device`` from an lgvit checkpoint (``runs/x/best``, a
    ``.safetensors``) or a ``.pth`` state dict (then ``model_name`` is needed), released
    weights by name (``lit_ti.in1k_authors``: downloaded once, see ``lgvit weights list``), or a
    ``save_pretrained`` folder (``local-dir:DIR``, ``hf-hub:ORG/NAME``, ``DIR`` or
    ``DIR/model.safetensors``: its ``config.json`` names the model).

    The model name, input size, class names and normalisation come from the checkpoint's
    metadata; ``model.pretrained_cfg`` carries them (``mean``, ``std``, ``label_names``,
    ``input_size``), so preprocessing read from the model is the one it was trained with.
    Every failure is an :class:`LgvitError` with one line naming the file and the problem.
    """
    return load_eval_model(checkpoint, device, classifier_builder(img_size), model_name)


def classifier_builder(img_size: int | None = None) -> EvalBuilder:
    """Classification's part of :func:`load_eval_model`: folders and released names resolved
    to a model, a checkpoint built by ``create_model`` (at ``img_size`` when given)."""
    kwargs = {"img_size": img_size} if img_size is not None else {}  # 0 is refused, not ignored

    def resolve(checkpoint: str, model_name: str | None, detector: str | None) -> Any:
        from lgvit.models import create_model
        from lgvit.models.hub import folder_named

        folder = folder_named(checkpoint)
        if folder is not None:
            return _load_folder(folder, checkpoint, model_name, kwargs)
        released = _released(checkpoint, model_name)
        if released is not None:
            return create_model(released, pretrained=True, **kwargs)
        return checkpoint, model_name, detector

    def build(checkpoint: str, record: Any, model_name: str | None, detector: str | None) -> Any:
        from lgvit.models import create_model, is_model

        if record.is_dense:  # else "Missing key(s) pos_embed", unexplained
            from lgvit.task_table import get_task

            words = record.detector or get_task(record.task).model_words
            what = f"{words} on {record.model or '?'}"
            raise LgvitError(
                f"{checkpoint} is a {record.task} checkpoint ({what}), not a classification "
                f"model: export and viz take classification checkpoints; `lgvit eval` and "
                f"`lgvit predict` run {record.task} ones"
            )
        name = model_name or record.model
        if not name:
            from lgvit.checkpoints.files import load_weights

            load_weights(checkpoint)  # a missing or broken file is reported as such first
            raise LgvitError(f"{checkpoint}: no model name stored in it; pass --model NAME")
        if not is_model(name):
            raise LgvitError(f"unknown model {name!r}; `lgvit info` lists the registered ones")
        try:
            return create_model(name, checkpoint_path=checkpoint, **kwargs)
        except ValueError as e:
            raise LgvitError(f"model {name} from {checkpoint}: {e}") from None

    return EvalBuilder(task=None, build=build, resolve=resolve)


def _load_folder(
    folder: str, checkpoint: str, model_name: str | None, kwargs: dict[str, Any]
) -> nn.Module:
    """A ``save_pretrained`` folder: the model, classes, mean/std and input size its
    ``config.json`` gives; ``--model``, when given, must be the one it names."""
    from lgvit.models import create_model
    from lgvit.models.hub import CONFIG_NAME

    try:
        model = create_model(folder, **kwargs)
    except ValueError as e:
        raise LgvitError(f"{checkpoint}: {e}") from None
    if model_name is not None and model_name != model.model_name:
        raise LgvitError(f"{checkpoint} holds {model.model_name} (its {CONFIG_NAME} names it), "
                         f"but --model {model_name} was given")  # fmt: skip
    return model


def initial_weights_file(source: str, model_name: str | None) -> str:
    """What ``--initial-checkpoint`` names: a file, as given, a ``save_pretrained`` folder (its
    weights file: :func:`folder_weights_file`), or released classification weights by name
    (``lit_ti.in1k_authors``, of the run's ``model_name``): their file in the weights cache,
    downloaded and checked on the registered model once, as ``create_model(...,
    pretrained=True)`` does."""
    in_folder = folder_weights_file(source)
    if in_folder is not None:
        return in_folder
    released = _released(source, model_name)
    if released is None:
        return source
    from lgvit.dense.pretrained import verifier
    from lgvit.models.download import fetch
    from lgvit.models.weights import find_weights

    w = find_weights(released)
    return str(fetch(w, verifier(w)).path)


def folder_weights_file(source: str) -> str | None:
    """The weights file of the ``save_pretrained`` folder ``source`` names, in the forms eval
    takes (``local-dir:DIR``, ``hf-hub:ORG/NAME``: downloaded once, then from the cache, as
    ``create_model`` does; ``DIR`` or ``DIR/model.safetensors``); None for anything else."""
    from lgvit.models.hub import download, folder_named, weights_file

    folder = folder_named(source)
    if folder is None:
        return None
    kind, _, where = folder.partition(":")
    return str(weights_file(where if kind == "local-dir" else download(where)))


def _released(checkpoint: str, model_name: str | None) -> str | None:
    """``checkpoint`` when it names released classification weights (``model.tag``) and is
    not a file; ``--model``, when given, must be theirs."""
    from lgvit.models.weights import find_weights
    from lgvit.task_table import CLASSIFICATION

    w = find_weights(str(checkpoint))
    if w is None or Path(checkpoint).exists():
        return None
    if w.task != CLASSIFICATION:
        raise LgvitError(f"{checkpoint} are {w.task} weights, not a classification model's")
    if model_name is not None and model_name != w.model:
        raise LgvitError(f"{checkpoint} are the weights of {w.model}, but --model {model_name} "
                         "was given")  # fmt: skip
    return w.name


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes a model input at evaluation (timm's data config): resize the
    shorter side to ``floor(size / crop_pct)`` with ``interpolation``, centre-crop ``size``,
    normalise by ``mean``/``std`` (``[0, 1]`` units). An image already ``size x size`` is
    taken as it is (CIFAR at 32 px)."""

    input_size: tuple[int, int, int]
    crop_pct: float
    crop_mode: str
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def size(self) -> int:
        return self.input_size[-1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line, as ``lgvit eval`` prints it."""
        resize = math.floor(self.size / self.crop_pct)
        fmt = lambda v: "(" + ", ".join(f"{x:.4g}" for x in v) + ")"  # noqa: E731
        return (
            f"{self.size}x{self.size}: shorter side to {resize} ({self.interpolation}, crop_pct "
            f"{self.crop_pct:g}), centre crop; mean {fmt(self.mean)}, std {fmt(self.std)}"
        )


def resolve_preprocessing(
    model: nn.Module,
    *,
    crop_pct: float | None = None,
    interpolation: str | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Preprocessing:
    """The model's own preprocessing (its ``pretrained_cfg``: the registered defaults, or what
    its checkpoint was trained with), each value overridable as timm's ``validate.py`` flags do.
    The input size is the model's (build it at another ``img_size`` to change it)."""
    from lgvit.data.transforms import INTERPOLATIONS

    cfg = model.pretrained_cfg
    pre = Preprocessing(
        input_size=tuple(cfg["input_size"]),
        crop_pct=float(cfg["crop_pct"] if crop_pct is None else crop_pct),
        crop_mode=str(cfg.get("crop_mode", "center")),
        interpolation=str(cfg["interpolation"] if interpolation is None else interpolation),
        mean=tuple(float(v) for v in (cfg["mean"] if mean is None else mean)),
        std=tuple(float(v) for v in (cfg["std"] if std is None else std)),
    )
    if not 0 < pre.crop_pct <= 1:
        raise LgvitError(f"crop_pct {pre.crop_pct:g}: must be in (0, 1]")
    if pre.interpolation not in INTERPOLATIONS:
        raise LgvitError(
            f"interpolation {pre.interpolation!r}: must be one of {', '.join(INTERPOLATIONS)}"
        )
    if pre.crop_mode != "center":
        raise LgvitError(f"crop_mode {pre.crop_mode!r}: only 'center' is implemented")
    if len(pre.mean) != 3 or len(pre.std) != 3 or min(pre.std) <= 0:
        raise LgvitError(f"mean {pre.mean} / std {pre.std}: need 3 values each (RGB), std positive")
    return pre


def preprocess_images(
    model: nn.Module, paths: Sequence[str], device: torch.device | str | None = None
) -> torch.Tensor:
    """Image files -> the normalised ``(N, C, H, W)`` batch ``model`` expects: its
    :func:`resolve_preprocessing` (what it was trained with, for a model from a checkpoint).
    With ``device`` (a GPU), each decoded uint8 image goes there and is resized and normalised
    there, by the same functions; without it, on the CPU. An unreadable file is an
    :class:`LgvitError` naming it."""
    from lgvit.data.decode import read_image_rgb
    from lgvit.data.transforms import normalize, resize_center_crop

    pre = resolve_preprocessing(model)
    dev = torch.device("cpu" if device is None else device)
    crops = [
        resize_center_crop(
            read_image_rgb(p)[None].to(dev), pre.size, pre.crop_pct, pre.interpolation
        )
        for p in paths
    ]
    return normalize(torch.cat(crops), pre.mean, pre.std)
