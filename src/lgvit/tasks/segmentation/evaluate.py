"""Semantic segmentation: loading a segmenter, scoring it (mmseg's mIoU/mAcc/aAcc), predicting
masks. Used by ``lgvit eval``/``predict`` and by the training task
(:mod:`lgvit.tasks.segmentation.train`).

The scores accumulate per class over the whole split, as mmseg's ``eval_metrics``: for class
c, the intersection (pixels labelled c and predicted c), the union, the predicted and the
labelled areas; ignored pixels (255) count nowhere. IoU_c = intersection / union and Acc_c =
intersection / labelled area; mIoU and mAcc average them over the classes present (a class
with no labelled and no predicted pixel is NaN and left out); aAcc = all intersections / all
labelled pixels.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.core.constants import IMAGENET_MEAN, IMAGENET_STD
from lgvit.core.errors import LgvitError
from lgvit.core.progress import StepProgress, on_terminal
from lgvit.core.runtime import Dist, all_reduce_sum, autocast
from lgvit.data.segmentation import IGNORE


class SegMetrics:
    """Per-class areas (float64), summed over batches and processes."""

    def __init__(self, num_classes: int, device: torch.device | str = "cpu") -> None:
        self.n = num_classes
        self.areas = torch.zeros(4, num_classes, dtype=torch.float64, device=device)

    def update(self, pred: torch.Tensor, label: torch.Tensor) -> None:
        """``pred`` and ``label``: integer maps of one shape; ``label`` 255 is not scored."""
        # A confusion matrix by scatter_add_: masking (``x[keep]``) and ``bincount`` read the
        # host on a GPU (the output size), this does not. Row n takes labels outside the
        # classes (their prediction counts, their label does not); bin (n+1)*n the ignored.
        n = self.n
        p, t = pred.reshape(-1).long(), label.reshape(-1).long()
        t = torch.where((t >= 0) & (t < n), t, n)
        cell = torch.where(label.reshape(-1) != IGNORE, t * n + p, (n + 1) * n)
        conf = torch.zeros((n + 1) * n + 1, dtype=torch.long, device=cell.device)
        conf = conf.scatter_add_(0, cell, torch.ones_like(cell))[:-1].view(n + 1, n)
        inter = conf[:n].diagonal()
        area_p, area_t = conf.sum(0), conf[:n].sum(1)
        self.areas += torch.stack([inter, area_p + area_t - inter, area_p, area_t]).to(self.areas)

    def reduce(self, d: Dist) -> None:
        self.areas = all_reduce_sum(self.areas, d)

    def result(self) -> dict[str, Any]:
        inter, union, _, label = self.areas.cpu().numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            iou = inter / union
            acc = inter / label
        present = label > 0
        return {
            "mIoU": 100 * float(np.nanmean(iou)) if np.isfinite(iou).any() else 0.0,
            "mAcc": 100 * float(np.nanmean(acc[present])) if present.any() else 0.0,
            "aAcc": 100 * float(inter.sum() / max(label.sum(), 1)),
            "per_class_iou": [None if math.isnan(v) else round(100 * float(v), 4) for v in iou],
            "per_class_acc": [None if math.isnan(v) else round(100 * float(v), 4) for v in acc],
        }


def normalise(x: torch.Tensor, mean: Any, std: Any) -> torch.Tensor:
    """uint8 ``(B, 3, H, W)`` -> float, normalised by ``[0, 1]``-unit mean/std."""
    m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1) * 255
    s = torch.tensor(std, device=x.device).view(1, -1, 1, 1) * 255
    return (x.float() - m) / s


def predict_logits(
    model: nn.Module, image: torch.Tensor, out_size: tuple[int, int], mean: Any, std: Any,
    amp: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """Class logits ``(B, C, *out_size)`` of uint8 images (resized back bilinear, float32)."""
    device = next(model.parameters()).device
    x = normalise(image.to(device, non_blocking=True), mean, std)
    with torch.no_grad(), autocast(device, amp):
        logits = model(x)
    return F.interpolate(logits.float(), size=out_size, mode="bilinear", align_corners=False)


def predict_scores(
    model: nn.Module, image: torch.Tensor, out_size: tuple[int, int], mean: Any, std: Any,
    amp: torch.dtype | None = None, flip: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Class scores ``(B, C, *out_size)`` whose argmax is the prediction: the logits, or with
    ``flip`` mmseg's flip test (its ``aug_test`` with ``flip=True``): the mean of the softmax
    of the image and of its horizontal mirror image's, mirrored back."""
    logits = predict_logits(model, image, out_size, mean, std, amp)
    if not flip:
        return logits
    mirrored = predict_logits(model, image.flip(-1), out_size, mean, std, amp).flip(-1)
    return (logits.softmax(1) + mirrored.softmax(1)) / 2


def evaluate_segmentation(
    model: nn.Module, loader: Any, num_classes: int, d: Dist, amp: torch.dtype | None,
    mean: Any, std: Any, desc: str = "eval", flip: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """mIoU, mAcc, aAcc and per-class IoU/Acc (%) over the loader's whole images, all ranks;
    ``flip``: mmseg's flip test (:func:`predict_scores`)."""
    was_training = model.training
    model.eval()
    metrics = SegMetrics(num_classes, d.device)
    progress = StepProgress(len(loader), desc, d.main and on_terminal())
    count = 0
    for image, mask in loader:
        mask = mask.to(d.device, non_blocking=True)
        scores = predict_scores(model, image, tuple(mask.shape[-2:]), mean, std, amp, flip)
        metrics.update(scores.argmax(1), mask)
        count += len(image)
        progress.update(len(image))
    progress.close()
    metrics.reduce(d)
    model.train(was_training)
    result = metrics.result()
    result["count"] = int(all_reduce_sum(torch.tensor(float(count), device=d.device), d).item())
    return result


# --------------------------------------------------------------------------------- loading


def load_segmenter(
    checkpoint: str, device: str | torch.device | None = None, model_name: str | None = None
) -> nn.Module:
    """An eval-mode :class:`~lgvit.dense.semfpn.SemanticFPN` from an lgvit segmentation
    checkpoint (its metadata names the backbone, classes, sizes) or from the LIT authors'
    mmseg ``.pth`` (``model_name`` = the backbone, e.g. ``lit_ti``; ADE20K's 150 classes), or
    their released file by name (``lit_ti.ade20k_semfpn_authors``, downloaded once).

    ``model.seg_info`` holds what prediction needs: ``classes``, ``mean``, ``std``,
    ``scale``."""
    from lgvit.inference import EvalBuilder, load_eval_model
    from lgvit.tasks.segmentation import build_released

    builder = EvalBuilder("segmentation", _build_segmenter, build_released)
    return load_eval_model(checkpoint, device, builder, model_name)


def _build_segmenter(
    checkpoint: str, record: Any, model_name: str | None, detector: str | None
) -> nn.Module:
    """Segmentation's builder for :func:`~lgvit.inference.load_eval_model`: the Semantic FPN
    its record describes, the weights (lgvit's or the authors' mmseg layout) loaded."""
    from lgvit.checkpoints.files import load_weights
    from lgvit.dense.mmseg import is_mmseg_layout, mmseg_to_lgvit
    from lgvit.dense.semfpn import create_segmenter
    from lgvit.inference import load_task_weights

    weights = load_weights(checkpoint)
    name = model_name or record.model
    if not name:
        raise LgvitError(f"{checkpoint}: no backbone name stored in it; pass --model NAME")
    classes = list(record.classes or ())
    model = create_segmenter(name, len(classes), img_size=record.img_size)
    authors = (is_mmseg_layout, mmseg_to_lgvit)
    load_task_weights(model, weights, checkpoint, f"Semantic FPN on {name}", authors)
    cfg = model.pretrained_cfg  # the backbone's normalisation, where the checkpoint has none
    model.seg_info = {
        "classes": classes, "scale": list(record.seg_scale), "backbone": name,
        "mean": list(record.mean or cfg.get("mean", IMAGENET_MEAN)),
        "std": list(record.std or cfg.get("std", IMAGENET_STD)),
    }  # fmt: skip
    return model
