"""The LIT authors' released detectors and segmenters, by name: downloaded once into the weights
cache (:mod:`lgvit.models.download`), mapped from mmdetection's / mmsegmentation's layout and
loaded strictly.

``create_detector(kind, backbone, pretrained=True)`` and ``create_segmenter(backbone,
pretrained=True)`` come here (:func:`create_released`), and so does a checkpoint given by name
(``lit_ti.coco_maskrcnn_authors``) to ``lgvit eval`` / ``predict`` (:func:`released_checkpoint`).
The builders are passed in: this module imports neither detection nor semfpn. How a downloaded
file of any task is checked (:func:`verifier`) is here too: ``lgvit weights --download``,
``--initial-checkpoint`` by name and eval's names all ask it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn as nn

from lgvit.core.errors import LgvitError
from lgvit.models.weights import Weights, find_weights
from lgvit.task_table import get_task


def load_dense_file(model: nn.Module, path: str | Path, what: str) -> None:
    """Load a dense checkpoint file into ``model`` strictly: an lgvit one as it is, the authors'
    mmdet or mmseg layout mapped first (mmdet's is tested first: its FPN neck has mmseg's
    keys too); non-finite weights refused."""
    from lgvit.checkpoints.files import check_finite_weights, load_into, load_weights
    from lgvit.dense.mmdet import MMDET_LAYOUT
    from lgvit.dense.mmseg import MMSEG_LAYOUT
    from lgvit.models.loading import adapt_state_dict

    layouts = (MMDET_LAYOUT, MMSEG_LAYOUT)
    weights = adapt_state_dict(model, load_weights(path), str(path), layouts)
    load_into(model, weights, str(path), what)
    check_finite_weights(model, path)


def _what(w: Weights) -> str:
    return f"{w.detector or get_task(w.task).model_words} on {w.model}"


def check_classes(w: Weights, num_classes: int | None) -> None:
    """Released dense weights keep their classes: another count is refused (fine-tune instead)."""
    if num_classes is not None and num_classes != w.num_classes:
        raise LgvitError(
            f"{w.name} has {w.num_classes} classes ({w.dataset}) but num_classes={num_classes} "
            f"was asked for; fine-tune from it (lgvit train --initial-checkpoint FILE, the file "
            "`lgvit weights download` prints) or leave num_classes out"
        )


def create_released(
    w: Weights, build: Callable[..., nn.Module], kwargs: dict[str, Any],
    cache_dir: str | None = None,
) -> nn.Module:  # fmt: skip
    """The dense model of ``w`` with its weights: ``build(**kwargs)`` makes the architecture,
    the authors' file loads into it (the shared builder,
    :func:`~lgvit.models.loading.create_released`: a fresh download is checked on ``build()``,
    the defaults, kept as the result when ``kwargs`` asks for nothing else)."""
    from lgvit.models.loading import create_released as with_released

    def make(path: Path, kw: dict[str, Any]) -> nn.Module:
        model = build(**kw)
        load_dense_file(model, path, _what(w))
        return model

    return with_released(w, make, kwargs, cache_dir)


def released_checkpoint(
    spec: str, task: str, build: Callable[[Weights], nn.Module], model_name: str | None = None,
    detector: str | None = None,
) -> tuple[str, Weights] | None:  # fmt: skip
    """A checkpoint given by name (``model.tag`` of :mod:`lgvit.models.weights`): its cached
    file (downloaded first if needed, and checked on ``build(entry)``) and its entry; None when
    ``spec`` is a file or no such name. ``--model`` / ``--detector``, when given, must be the
    entry's."""
    w = find_weights(spec)
    if w is None or Path(spec).exists():
        return None
    if w.task != task:
        raise LgvitError(f"{spec} are {w.task} weights, not {task} ones")
    for flag, given, want in (("--model", model_name, w.model), ("--detector", detector,
                                                                w.detector)):  # fmt: skip
        if given is not None and want is not None and given != want:
            raise LgvitError(f"{spec} are the weights of {want}, but {flag} {given} was given")
    from lgvit.models.download import fetch

    return str(fetch(w, verifier(w, build)).path), w


def verifier(
    w: Weights, build: Callable[[Weights], nn.Module] | None = None
) -> Callable[[Path], Any]:
    """How a downloaded file of ``w`` is checked, the one rule for every caller: loaded strictly
    into the model it belongs to, as registered (classification: ``create_model(w.model,
    checkpoint_path=...)``; a dense task: ``build(w)``, the authors' layout mapped)."""
    if not get_task(w.task).dense:
        from lgvit.models import create_model

        return lambda path: create_model(w.model, checkpoint_path=str(path))
    if build is None:
        raise ValueError(f"{w.name}: a dense model's file is checked on build(entry), none given")
    return lambda path: load_dense_file(build(w), path, _what(w))
