"""Image classification on the shared run (:mod:`lgvit.run.engine`): the DeiT recipe of the papers,
on one CPU, one GPU or many (torchrun).

The task brings its model (checked to run at the configured sizes before any data loads), its
data and batched augmentation, the soft-target cross-entropy of a batch (after progressive
resizing), and top-1/top-5 evaluation; :func:`train` runs it.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.checkpoints.record import CheckpointRecord
from lgvit.core.errors import LgvitError, first_line
from lgvit.core.runtime import Dist, autocast, barrier
from lgvit.data.datasets import DatasetSplits, load_dataset
from lgvit.data.device_decode import decode_device
from lgvit.data.loader import AugmentConfig
from lgvit.data.sources import OPTION_KEYS
from lgvit.data.splits import splits_on_device
from lgvit.data.stream import make_loader
from lgvit.data.transforms import soft_target_cross_entropy
from lgvit.models import create_model, get_model_config, is_model, list_models
from lgvit.run.config import TrainConfig, config_keys
from lgvit.run.engine import Prepared
from lgvit.run.optim import param_groups
from lgvit.tasks.classification.evaluate import evaluate


def train_size_at(epoch: int, cfg: TrainConfig, full: int) -> int:
    """Progressive resizing (fast.ai's DAWNBench ImageNet, FFCV): the training input size of
    ``epoch`` (from 0). ``train_size_start`` up to the fraction ``train_size_ramp[0]`` of the
    run, then growing linearly in steps of ``train_size_step`` to ``full`` at the fraction
    ``train_size_ramp[1]``, where it stays. Early epochs cost less (fewer tokens) and the last
    ones train at the size the model is tested at."""
    start = cfg.train_size_start
    if not start or start >= full:
        return full
    a, b = cfg.train_size_ramp
    f = epoch / cfg.epochs
    if f >= b:
        return full
    t = 0.0 if f <= a else (f - a) / (b - a)
    return min(full, start + int(t * (full - start) / cfg.train_size_step) * cfg.train_size_step)


# --------------------------------------------------------------------------------- data + model


def build_data(cfg: TrainConfig, img_size: int, d: Dist) -> DatasetSplits:
    """Rank 0 decodes (and fills the cache) first; the others then read the cache."""
    kw = dict(
        img_size=img_size,
        cache_dir=cfg.cache_dir,
        max_bad_fraction=cfg.max_bad_fraction,
        seed=cfg.seed,
        stream=cfg.stream,
    )
    for key in OPTION_KEYS:
        if getattr(cfg, key) is not None:  # validated: only the sources taking it
            kw[key] = getattr(cfg, key)
    if cfg.data == "synthetic" and cfg.num_classes:
        kw["num_classes"] = cfg.num_classes
    if d.main:
        splits = load_dataset(cfg.data, cfg.data_dir, **kw)
        barrier(d)
    else:
        barrier(d)
        splits = load_dataset(cfg.data, cfg.data_dir, **kw)
    return splits


def build_model(cfg: TrainConfig, num_classes: int) -> tuple[nn.Module, int]:
    """The configured model at the run's input size, checked to run at that size (before any
    data is loaded): a size it cannot take is one line, not a traceback after loading."""
    if not is_model(cfg.model):
        close = difflib.get_close_matches(cfg.model, list_models(), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise LgvitError(
            f"unknown model {cfg.model!r}{hint} (`lgvit info` lists the registered ones)"
        )
    default = get_model_config(cfg.model).input_size[-1]
    img_size = cfg.img_size or default
    try:
        model = create_model(
            cfg.model, num_classes=num_classes, img_size=img_size, drop_path_rate=cfg.drop_path,
            **model_kwargs(cfg),
        )  # fmt: skip
    except ValueError as e:
        raise LgvitError(f"model {cfg.model} at --img-size {img_size}: {e}") from None
    except TypeError as e:  # an architecture key this model does not take
        raise LgvitError(f"model {cfg.model}: {e}") from None
    stride = max((f["reduction"] for f in getattr(model, "feature_info", [])), default=1)
    if img_size < stride:
        raise LgvitError(
            f"--img-size {img_size} is smaller than {cfg.model}'s total stride {stride}: its "
            f"last stage would have no tokens (use at least {stride})"
        )
    sizes = {f"--img-size {img_size}": img_size}
    if cfg.train_size_start:
        if cfg.train_size_start > img_size:
            raise LgvitError(
                f"train_size_start {cfg.train_size_start} is larger than the training size "
                f"{img_size}: progressive resizing grows the size up to it"
            )
        sizes[f"train_size_start {cfg.train_size_start}"] = cfg.train_size_start
        if hasattr(model, "dynamic_img_size"):  # resize position embeddings to the input
            model.dynamic_img_size = True
    for what, size in sizes.items():
        try:
            probe = torch.zeros(1, getattr(model, "in_chans", 3), size, size)
            with torch.no_grad():
                model.eval()(probe)
        except (ValueError, RuntimeError) as e:
            raise LgvitError(f"model {cfg.model} cannot run at {what}: {first_line(e)}") from None
    model.train()
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model, img_size


def model_kwargs(cfg: TrainConfig) -> dict[str, int]:
    """Architecture keys of the config that were set (stored in checkpoints for eval)."""
    keys = ("patch_size", "window_size")
    return {k: getattr(cfg, k) for k in keys if getattr(cfg, k) is not None}


def augment_config(cfg: TrainConfig, img_size: int, splits: DatasetSplits) -> AugmentConfig:
    """The recipe keys of the run config (same names in both), at the run's size and stats."""
    shared = {f.name for f in dataclasses.fields(AugmentConfig)} & set(config_keys())
    kw = {k: getattr(cfg, k) for k in shared - {"img_size", "mean", "std"}}
    return AugmentConfig(img_size=img_size, mean=tuple(splits.mean), std=tuple(splits.std), **kw)


def checkpoint_metadata(cfg: TrainConfig, img_size: int, splits: DatasetSplits) -> dict[str, str]:
    """What ``lgvit eval``/``predict`` need to rebuild the model without the run's config."""
    return CheckpointRecord(
        model=cfg.model, img_size=img_size, num_classes=len(splits.train.classes),
        classes=tuple(splits.train.classes), mean=tuple(splits.mean), std=tuple(splits.std),
        dataset=cfg.data, model_kwargs=model_kwargs(cfg),
    ).to_meta()  # fmt: skip


@dataclass
class ClassificationTask:
    """Image classification (:class:`lgvit.run.engine.Task`)."""

    # Keys that define what a run trains: a resume may not change them.
    identity_keys: tuple[str, ...] = (
        "task", "model", "data", "img_size", "patch_size", "window_size", "num_classes",
    )  # fmt: skip
    best_metric: str = "acc1"
    cfg: TrainConfig | None = None  # set by prepare(), with the run's size and class count
    img_size: int = 0
    num_classes: int = 0

    def prepare(self, cfg: TrainConfig, d: Dist) -> Prepared:
        """The model (built and size-checked before any data loads), the data, the loaders."""
        self.cfg = cfg
        decode_on = decode_device(cfg.decode_device, d.device)  # no CUDA: one line, first
        model, self.img_size = build_model(cfg, num_classes=cfg.num_classes or 1)
        splits = build_data(cfg, self.img_size, d)
        if cfg.data_on_device:
            splits = splits_on_device(splits, d.device)
        num_classes = self.num_classes = cfg.num_classes or len(splits.train.classes)
        if num_classes != model.num_classes:
            model.reset_classifier(num_classes)
        common = dict(
            num_classes=num_classes, aug=augment_config(cfg, self.img_size, splits),
            seed=cfg.seed, rank=d.rank, world_size=d.world_size, device=d.device,
            workers=cfg.workers, max_bad_fraction=cfg.max_bad_fraction, decode_device=decode_on,
        )  # fmt: skip
        train_loader = make_loader(
            splits.train, cfg.batch_size, train=True, repeated_aug=cfg.repeated_aug, **common
        )
        test_loader = make_loader(splits.test, max(cfg.batch_size, 64), train=False, **common)
        if len(train_loader) == 0:
            raise LgvitError(
                f"--batch-size {cfg.batch_size} x {d.world_size} process(es) is larger than the "
                f"{len(splits.train)} training images"
            )
        params = sum(p.numel() for p in model.parameters()) / 1e6
        description = (
            f"model {cfg.model} ({params:.2f}M params), data {cfg.data}: {len(splits.train)} "
            f"train / {len(splits.test)} test images, {num_classes} classes, {self.img_size}px"
        )
        notes = []
        if splits.skipped:
            notes.append(
                f"skipped {len(splits.skipped)} unreadable or unlabelled samples, e.g. "
                f"{splits.skipped[:3]}"
            )
        meta = checkpoint_metadata(cfg, self.img_size, splits)
        return Prepared(model, train_loader, test_loader, meta, description, notes,
                        train_images=len(splits.train))  # fmt: skip

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        return param_groups(model, cfg.weight_decay, cfg.offset_lr_factor, cfg.layer_decay)

    def loss(
        self, model: nn.Module, batch: Any, epoch: int, d: Dist, amp: torch.dtype | None
    ) -> tuple[torch.Tensor, int]:
        """Soft-target cross-entropy (mixup/cutmix/label smoothing) or plain; progressive
        resizing downscales the augmented batch (bilinear, antialiased) to this epoch's size."""
        x, y = (t.to(d.device, non_blocking=True) for t in batch)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        size = train_size_at(epoch, self.cfg, x.shape[-1])
        if size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
        with autocast(d.device, amp):
            logits = model(x)
        logits = logits.float()
        if y.ndim == 2:  # soft targets from mixup/cutmix/label smoothing
            return soft_target_cross_entropy(logits, y), len(x)
        return F.cross_entropy(logits, y), len(x)

    def evaluate(
        self, model: nn.Module, loader: Any, d: Dist, amp: torch.dtype | None, desc: str
    ) -> dict[str, Any]:
        return evaluate(model, loader, self.num_classes, d, amp, desc, tta=self.cfg.eval_tta)

    def summary(self, result: dict[str, Any]) -> str:
        parts = [f"top-{k} {result[f'acc{k}']:.2f}%" for k in (1, 5) if f"acc{k}" in result]
        return " ".join(parts)

    def epoch_info(self, epoch: int) -> dict[str, Any]:
        if not self.cfg.train_size_start:
            return {}
        return {"train_size": train_size_at(epoch, self.cfg, self.img_size)}

    def train_sizes(self) -> list[int]:
        """The run's training input sizes (progressive resizing's schedule; the full size too:
        an iteration budget may run past ``epochs``), smallest first."""
        cfg = self.cfg
        return sorted({train_size_at(e, cfg, self.img_size) for e in range(cfg.epochs)}
                      | {self.img_size})  # fmt: skip

    def compiled_graphs(self) -> int:
        """The input shapes a compiled run feeds the model, a graph each (the engine's
        ``--compile``): one per training size (the last, partial batch is dropped), and
        evaluation's full batch and its last, smaller one."""
        return len(self.train_sizes()) + 2

    def epoch_cost(self, epoch: int) -> float:
        # Progressive resizing's small epochs are cheaper: cost ~ (size ratio)^1.5, between the
        # MLPs' linear and attention's quadratic growth in tokens. Measured: lsa_micro_cifar's
        # 16px and 24px epochs (with evaluation) took 0.34 and 0.63 of a 32px one; ^1.5 gives
        # 0.35, 0.65.
        return (train_size_at(epoch, self.cfg, self.img_size) / self.img_size) ** 1.5


def make_task() -> ClassificationTask:
    """The task the engine runs (:data:`lgvit.tasks.run.MAKE_TASK` names it)."""
    return ClassificationTask()
