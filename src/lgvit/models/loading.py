"""Weights into a model: the one path ``create_model``, the dense builders, evaluation and
fine-tuning share.

* where ``create_model``'s weights come from (:func:`weights_source`): a saved folder, the
  authors' released file, a checkpoint file, or none;
* a state dict adapted to a model (:func:`adapt_state_dict`), the one place: a foreign layout
  mapped (the authors' mmdet / mmseg files), the model's own mapping of the checkpoints it reads
  (``checkpoint_filter_fn``: the authors' classification releases), RGB first convolutions fitted
  to other input channels;
* loading: a checkpoint into a classifier (:func:`load_checkpoint`: the head fitted, strict),
  ``--initial-checkpoint``'s partial load (:func:`load_initial_weights`);
* the released weights' builder (:func:`create_released`), one for classification and the dense
  models: the file fetched into the cache (checked on the model as registered), the model built
  with the caller's arguments and loaded.

Every load goes through the model's ``load_state_dict``, so its load hooks run. This module
never imports the registry: the builders are passed in. It imports the checkpoint layer where
it reads files, as the registry did: ``import lgvit`` stays as light as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from lgvit.core.errors import LgvitError, error_lines

if TYPE_CHECKING:
    from lgvit.models.weights import Weights

StateDict = dict[str, torch.Tensor]
# A foreign layout: its test, and its mapping ``(weights, model, source) -> weights``.
Layout = tuple[Callable[[StateDict], bool], Callable[..., StateDict]]

FOLDER, RELEASED, FILE, NONE = "folder", "released", "file", "none"


@dataclass(frozen=True)
class WeightsSource:
    """Where ``create_model``'s weights come from: ``kind`` is ``folder`` (``local-dir:`` /
    ``hf-hub:``), ``released`` (the authors' file, from the cache), ``file`` (``path``) or
    ``none``."""

    kind: str
    path: str | None = None


def weights_source(
    name: str, pretrained: bool, checkpoint_path: Any, overlay: dict[str, Any] | None
) -> WeightsSource:
    """``create_model``'s arguments -> where its weights come from: a folder's name wins; then
    ``checkpoint_path``; ``pretrained`` without one: timm's ``pretrained_cfg_overlay`` file, else
    the released weights."""
    from lgvit.models.hub import FOLDER_PREFIXES

    if name.startswith(FOLDER_PREFIXES):
        return WeightsSource(FOLDER)
    if pretrained and checkpoint_path is None:
        checkpoint_path = (overlay or {}).get("file")  # timm's file, by hand
        if checkpoint_path is None:
            return WeightsSource(RELEASED)
    if checkpoint_path is None:
        return WeightsSource(NONE)
    return WeightsSource(FILE, str(checkpoint_path))


def adapt_input_conv(weight: torch.Tensor, in_chans: int) -> torch.Tensor:
    """A first conv's ``weight`` trained on other input channels (RGB), for ``in_chans``: one
    channel takes their sum (a grey image gets the response its colour had); more repeat them,
    cut to ``in_chans``, scaled by (channels trained) / ``in_chans`` so that an image repeated
    over the channels keeps its response. The channel axis is -3: ``(out, in, k, k)`` or LSA's
    stacked ``(T, out, in, k, k)``."""
    w = weight.float()  # summed in float32, whatever the checkpoint's precision
    if in_chans == 1:
        w = w.sum(dim=-3, keepdim=True)
    else:
        have = w.shape[-3]
        w = torch.cat([w] * -(-in_chans // have), dim=-3)[..., :in_chans, :, :] * (have / in_chans)
    return w.to(weight.dtype)


def adapt_first_convs(
    weights: StateDict, model: nn.Module, first_conv: str | tuple[str, ...]
) -> StateDict:
    """``weights`` with each ``first_conv`` weight adapted (:func:`adapt_input_conv`) to the
    model's input channels where they differ."""
    own = model.state_dict()
    for name in (first_conv,) if isinstance(first_conv, str) else first_conv:
        key = f"{name}.weight"
        w, want = weights.get(key), own.get(key)
        if w is not None and want is not None and w.ndim == want.ndim >= 3:
            if w.shape[-3] != want.shape[-3]:
                weights = {**weights, key: adapt_input_conv(w, want.shape[-3])}
    return weights


def adapt_state_dict(
    model: nn.Module,
    weights: StateDict,
    source: str,
    layouts: Sequence[Layout] = (),
    first_conv: str | tuple[str, ...] | None = None,
) -> StateDict:
    """``weights`` in ``model``'s keys, the one place a state dict is adapted before it loads:
    the first of ``layouts`` whose test claims them maps them (``source``, the file, names it in
    errors); then the model's own ``checkpoint_filter_fn`` (the authors' classification
    layouts; lgvit's keys pass); then the ``first_conv`` weights fitted to the model's input
    channels."""
    for is_layout, convert in layouts:
        if is_layout(weights):
            weights = convert(weights, model, source)
            break
    filt = getattr(model, "checkpoint_filter_fn", None)
    if filt is not None:
        weights = filt(weights)
    if first_conv is not None:
        weights = adapt_first_convs(weights, model, first_conv)  # RGB weights, in_chans != 3
    return weights


def load_checkpoint(
    model: nn.Module,
    weights: StateDict,
    path: str,
    name: str,
    first_conv: str | tuple[str, ...],
    classifier: str,
    explicit: int | None,
) -> None:
    """A checkpoint into the classifier ``name``: mapped (authors' layouts), the head fitted to
    the file's class count (``explicit``: the caller's, which a file of another count refuses),
    loaded strictly; errors are one line."""
    from lgvit.checkpoints.files import check_weight_dtypes, load_into

    weights = adapt_state_dict(model, weights, path, first_conv=first_conv)
    check_weight_dtypes(weights, model.state_dict(), path)  # before the head: int or bool
    head_w = weights.get(f"{classifier}.weight")
    if head_w is not None and head_w.shape[0] != getattr(model, "num_classes", head_w.shape[0]):
        if explicit is not None:
            raise LgvitError(
                f"{path} has a {head_w.shape[0]}-class head but num_classes={explicit} was asked"
                " for; drop its head first or pass the checkpoint's class count"
            )
        model.reset_classifier(head_w.shape[0])
    load_into(model, weights, path, f"model {name}")


def load_initial_weights(model: nn.Module, path: str) -> str:
    """Fine-tuning start: weights only from ``path`` (an lgvit checkpoint, ``.safetensors`` or
    ``.pth``); a classifier of another class count is dropped (the new head stays freshly
    initialised), position embeddings of another grid are resized by the model's load hooks.
    Anything else that does not fit is a one-line error. Returns a line for the log."""
    from lgvit.checkpoints.files import check_weight_dtypes, load_weights, short_reason

    sd = adapt_state_dict(model, load_weights(path), path)
    own = model.state_dict()
    head = getattr(model, "pretrained_cfg", {}).get("classifier", "head")
    dropped = [
        k for k in sd if k.startswith(head + ".") and k in own and sd[k].shape != own[k].shape
    ]
    for k in dropped:
        del sd[k]
    check_weight_dtypes(sd, own, path)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a shape the load hooks cannot fit: torch names key and shapes
        detail = next((ln for ln in error_lines(e) if "size mismatch" in ln), short_reason(e))
        raise LgvitError(
            f"--initial-checkpoint {path} does not fit {model.model_name}: {detail}"
        ) from None
    missing = [k for k in missing if k not in dropped]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise LgvitError(f"--initial-checkpoint {path} does not fit {model.model_name}: {what}")
    note = f" (its {head} for another class count dropped)" if dropped else ""
    return f"started from the weights of {path}{note}"


def create_released(
    w: Weights,
    make: Callable[[Path, dict[str, Any]], nn.Module],
    kwargs: dict[str, Any],
    cache_dir: str | None = None,
) -> nn.Module:
    """The model of the released weights ``w``, with them: ``make(path, kwargs)`` builds the
    architecture with the caller's ``kwargs`` and loads the file ``path`` into it. A fresh
    download is checked on ``make(path, {})`` (the model as registered, so an argument of the
    caller's never condemns a good file), and that model is kept when ``kwargs`` asks for
    nothing else. Its ``pretrained_cfg`` gains the entry's facts (timm's keys: url, tag,
    licence, paper, class count)."""
    from lgvit.models.download import fetch, quiet_left_out

    got = fetch(w, lambda path: make(path, {}), cache_dir)
    if got.built is not None and not kwargs:
        model = got.built
    else:
        with quiet_left_out():
            model = make(got.path, kwargs)
    model.pretrained_cfg = {**model.pretrained_cfg, **w.pretrained_cfg()}
    return model
