"""Classification evaluation: top-1/top-5, loss and per-class accuracy over a test split (all
ranks), with optional test-time augmentation. ``lgvit eval`` and training share it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.config import TTA_MODES
from lgvit.data.loader import BatchLoader
from lgvit.errors import LgvitError
from lgvit.progress import StepProgress, on_terminal
from lgvit.runtime import Dist, all_reduce_sum, autocast


def _mirror_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (model(x).float() + model(x.flip(-1)).float())


def tta_logits(model: nn.Module, x: torch.Tensor, tta: str) -> torch.Tensor:
    """Logits of ``x`` under test-time augmentation ``tta`` (one of ``TTA_MODES``):
    ``none``; ``flip``: the mean over the image and its mirror image; ``flip-translate``
    (airbench's six views): half the flip mean, plus half the mean of the flip means of the
    image shifted one pixel up-left and one pixel down-right (reflect-padded)."""
    if tta == "none":
        return model(x).float()
    logits = _mirror_logits(model, x)
    if tta == "flip":
        return logits
    H, W = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = [padded[..., :H, :W], padded[..., 2 : H + 2, 2 : W + 2]]
    return 0.5 * logits + 0.25 * sum(_mirror_logits(model, v) for v in shifted)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: BatchLoader,
    num_classes: int,
    d: Dist,
    amp: torch.dtype | None,
    desc: str = "eval",
    tta: str = "none",
) -> dict[str, Any]:
    """Top-1, top-5, loss and per-class accuracy over the whole test split (all ranks); a
    progress bar on a terminal (rank 0). ``tta``: test-time augmentation, see :func:`tta_logits`
    (the short-budget CIFAR recipes')."""
    if tta not in TTA_MODES:
        raise LgvitError(f"tta={tta!r}: must be one of {', '.join(TTA_MODES)}")
    model.eval()
    progress = StepProgress(len(loader), desc, d.main and on_terminal())
    correct1 = torch.zeros((), dtype=torch.float64)
    correct5 = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    per_class = torch.zeros(2, num_classes, dtype=torch.float64)  # correct, seen
    k = min(5, num_classes)
    for x, y in loader:
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        with autocast(d.device, amp):
            logits = tta_logits(model, x, tta)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double().cpu()
        top = logits.topk(k, dim=1).indices
        hit1 = (top[:, 0] == y).double().cpu()
        correct1 += hit1.sum()
        correct5 += (top == y[:, None]).any(1).double().sum().cpu()
        count += len(y)
        yc = y.cpu()
        per_class[0].index_add_(0, yc, hit1)
        per_class[1].index_add_(0, yc, torch.ones_like(hit1))
        progress.update(len(y) * d.world_size)
    progress.close()
    stats = torch.cat([torch.stack([correct1, correct5, loss_sum, count]), per_class.flatten()])
    stats = all_reduce_sum(stats.to(d.device), d).cpu()
    c1, c5, ls, n = stats[:4].tolist()
    pc = stats[4:].view(2, num_classes)
    n = max(n, 1.0)
    return {
        "acc1": 100.0 * c1 / n,
        "acc5": 100.0 * c5 / n,
        "loss": ls / n,
        "count": int(n),
        "per_class_acc": (100.0 * pc[0] / pc[1].clamp(min=1)).tolist(),
    }
