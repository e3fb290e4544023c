"""Classification evaluation: top-1/top-5, loss and per-class accuracy over a test split (all
ranks), with optional test-time augmentation. ``lgvit eval`` and training share it; ``lgvit
eval`` also records each image's top-5 (:class:`TopKRecorder`) for ImageNet-ReaL accuracy
(:class:`RealLabels`) and the predictions file."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.core.atomic import atomic_write_bytes
from lgvit.core.errors import LgvitError, first_line, refuse_deep_nesting
from lgvit.core.progress import StepProgress, on_terminal
from lgvit.core.runtime import Dist, all_reduce_sum, autocast
from lgvit.data.protocol import Loader
from lgvit.task_table import TTA_MODES


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
    loader: Loader,
    num_classes: int,
    d: Dist,
    amp: torch.dtype | None,
    desc: str = "eval",
    tta: str = "none",
    on_batch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None,
) -> dict[str, Any]:
    """Top-1, top-5, loss and per-class accuracy over the whole test split (all ranks); a
    progress bar on a terminal (rank 0). ``tta``: test-time augmentation, see :func:`tta_logits`
    (the short-budget CIFAR recipes'). ``on_batch(logits, labels, indices)`` sees every batch
    (``indices``: the images' places in the split, from a loader built ``with_index``)."""
    if tta not in TTA_MODES:
        raise LgvitError(f"tta={tta!r}: must be one of {', '.join(TTA_MODES)}")
    model.eval()
    progress = StepProgress(len(loader), desc, d.main and on_terminal())
    # The sums stay on the device (float64: exact counts) and are read once, after the last
    # batch: a host read per batch would make the host wait for each batch's forward.
    sums = torch.zeros(3, dtype=torch.float64, device=d.device)  # top-1, top-5, loss
    per_class = torch.zeros(2, num_classes, dtype=torch.float64, device=d.device)  # hit, seen
    count = 0
    k = min(5, num_classes)
    for batch in loader:
        x, y = batch[0].to(d.device, non_blocking=True), batch[1].to(d.device, non_blocking=True)
        with autocast(d.device, amp):
            logits = tta_logits(model, x, tta)
        if on_batch is not None:
            on_batch(logits, y, batch[2] if len(batch) > 2 else None)
        top = logits.topk(k, dim=1).indices
        hit1 = (top[:, 0] == y).double()
        hit5 = (top == y[:, None]).any(1).double()
        loss = F.cross_entropy(logits, y, reduction="sum").double()
        sums += torch.stack([hit1.sum(), hit5.sum(), loss])
        per_class[0].index_add_(0, y, hit1)
        per_class[1].index_add_(0, y, torch.ones_like(hit1))
        count += len(y)
        progress.update(len(y) * d.world_size)
    progress.close()
    n_local = torch.tensor([float(count)], dtype=torch.float64, device=d.device)
    stats = torch.cat([sums, n_local, per_class.flatten()])
    stats = all_reduce_sum(stats, d).cpu()
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


class TopKRecorder:
    """``on_batch`` for :func:`evaluate`: each image's label and its ``k`` most probable classes
    with their softmax probabilities, in split order (:meth:`result`)."""

    def __init__(self, k: int = 5) -> None:
        self.k = k
        self._parts: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, logits: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None) -> None:
        if idx is None:
            raise LgvitError("TopKRecorder needs a loader built with with_index=True")
        top = logits.float().softmax(-1).topk(min(self.k, logits.shape[-1]), dim=-1)
        # Kept where they are (the device) and read once in result(): no host wait per batch.
        self._parts.append((idx, y, top.indices, top.values))

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(index (N,), label (N,), top classes (N, k), their probabilities (N, k))``."""
        idx, y, top, p = (torch.cat(t).cpu() for t in zip(*self._parts, strict=True))
        order = idx.argsort()
        return idx[order], y[order], top[order], p[order]


def write_predictions(
    path: str | Path,
    names: Sequence[str],
    labels: torch.Tensor,
    top: torch.Tensor,
    probs: torch.Tensor,
) -> None:
    """One CSV row per image: its name, true label, top-k class indices, their probabilities
    (written atomically)."""
    k = top.shape[1]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["image", "label", *(f"top{i}" for i in range(1, k + 1)),
                *(f"prob{i}" for i in range(1, k + 1))])  # fmt: skip
    for name, y, t, p in zip(names, labels.tolist(), top.tolist(), probs.tolist(), strict=True):
        w.writerow([name, y, *t, *(f"{v:.6g}" for v in p)])
    try:
        atomic_write_bytes(path, buf.getvalue().encode())
    except OSError as e:
        raise LgvitError(f"--predictions {path}: cannot write it ({first_line(e)})") from None


# ImageNet's validation images are ILSVRC2012_val_00000001.JPEG ... _00050000; ReaL's JSON list
# holds their label sets in that order.
_REAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})")


class RealLabels:
    """ImageNet-ReaL's labels (Beyer et al. 2020, ``real.json``): a JSON list with one list of
    class indices per validation image, in the order of the ``ILSVRC2012_val_XXXXXXXX`` file
    names. Scored as timm's ``RealLabelsImagenet``: a prediction is right when it is in the
    image's list; images whose list is empty are left out."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with refuse_deep_nesting(f"--real-labels {path}", "JSON"):
                data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise LgvitError(
                f"--real-labels {path}: not a readable JSON file ({first_line(e)})"
            ) from None
        if not isinstance(data, list) or not data:
            raise LgvitError(f"--real-labels {path}: expected a JSON list of label lists")
        for i, labels in enumerate(data):
            ok = isinstance(labels, list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in labels
            )
            if not ok:
                raise LgvitError(
                    f"--real-labels {path}: entry {i} (ILSVRC2012_val_{i + 1:08d}) is "
                    f"{json.dumps(labels)[:60]}, not a list of class indices"
                )
        self.labels: list[list[int]] = data

    def for_images(self, names: Sequence[str], num_classes: int) -> list[list[int]]:
        """Each image's label set, matched by its file name (``..._00000042.*`` -> entry 41)."""
        out = []
        for name in names:
            m = _REAL_NAME.search(Path(name).name)
            i = int(m.group(1)) - 1 if m else -1
            if not 0 <= i < len(self.labels):
                raise LgvitError(
                    f"--real-labels {self.path}: no entry for image {name} (ReaL labels "
                    f"ILSVRC2012_val_00000001 ... _{len(self.labels):08d} by file name)"
                )
            if any(v >= num_classes for v in self.labels[i]):
                raise LgvitError(
                    f"--real-labels {self.path}: entry {i} has class {max(self.labels[i])}, "
                    f"beyond the model's {num_classes} classes"
                )
            out.append(self.labels[i])
        if names and not any(out):  # ReaL's accuracy would be 0.00% of 0 images
            raise LgvitError(
                f"--real-labels {self.path}: none of the {len(names)} images has a ReaL label "
                "(each one's list is empty); nothing to score"
            )
        return out


def real_accuracy(top: torch.Tensor, label_sets: Sequence[Sequence[int]]) -> dict[str, Any]:
    """ReaL top-1 / top-5 (%) of predictions ``top`` ``(N, k)`` against each image's label
    set; images with an empty set are left out (``real_count`` says how many stayed)."""
    hit1 = hit5 = n = 0
    for pred, real in zip(top.tolist(), label_sets, strict=True):
        if not real:
            continue
        n += 1
        hit1 += pred[0] in real
        hit5 += any(p in real for p in pred[:5])
    return {
        "real_acc1": 100.0 * hit1 / max(n, 1),
        "real_acc5": 100.0 * hit5 / max(n, 1),
        "real_count": n,
    }
