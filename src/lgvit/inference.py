"""Turning a checkpoint into a ready model: the one path ``eval``, ``predict`` (and later
``bench``, ``viz``, ``export``) use."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from lgvit.errors import LgvitError


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


def load_model(
    checkpoint: str,
    device: str | torch.device | None = None,
    model_name: str | None = None,
    img_size: int | None = None,
) -> nn.Module:
    """An eval-mode model on ``device`` from an lgvit checkpoint (``runs/x/best``, a
    ``.safetensors``) or a ``.pth`` state dict (then ``model_name`` is needed).

    The model name, input size, class names and normalisation come from the checkpoint's
    metadata; ``model.pretrained_cfg`` carries them (``mean``, ``std``, ``label_names``,
    ``input_size``), so preprocessing read from the model is the one it was trained with.
    Every failure is an :class:`LgvitError` with one line naming the file and the problem.
    """
    from lgvit.checkpoint import load_metadata
    from lgvit.models import create_model, is_model

    try:
        meta = load_metadata(checkpoint)
    except LgvitError:
        meta = {}  # a plain .pt/.pth state dict carries no metadata (or an unreadable file,
        # which create_model reports below)
    name = model_name or meta.get("model")
    if not name:
        from lgvit.checkpoint import load_weights

        load_weights(checkpoint)  # a missing or broken file is reported as such first
        raise LgvitError(f"{checkpoint}: no model name stored in it; pass --model NAME")
    if not is_model(name):
        raise LgvitError(f"unknown model {name!r}; `lgvit info` lists the registered ones")
    kwargs = {"img_size": img_size} if img_size else {}
    try:
        model = create_model(name, checkpoint_path=checkpoint, **kwargs)
    except ValueError as e:
        raise LgvitError(f"model {name} from {checkpoint}: {e}") from None
    return model.to(resolve_device(device)).eval()


def preprocess_images(model: nn.Module, paths: Sequence[str]) -> torch.Tensor:
    """Image files -> the normalised ``(N, C, H, W)`` batch ``model`` expects: resize and
    centre crop by its ``crop_pct``, its mean/std (those it was trained with, for a model
    from a checkpoint). An unreadable file is an :class:`LgvitError` naming it."""
    from lgvit.data.decode import read_image_rgb
    from lgvit.data.transforms import normalize, resize_center_crop

    cfg = model.pretrained_cfg
    size = cfg["input_size"][-2]
    crops = [
        resize_center_crop(read_image_rgb(p)[None], size, crop_pct=cfg["crop_pct"]) for p in paths
    ]
    return normalize(torch.cat(crops), tuple(cfg["mean"]), tuple(cfg["std"]))
