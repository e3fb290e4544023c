"""Semantic segmentation on the shared run (:mod:`lgvit.run.engine`): Semantic FPN on any pyramid
model, LIT's ADE20K recipe (the shipped configs ade20k_semfpn_*).

The task brings the segmenter (:mod:`lgvit.dense`), the data and mmseg's pipelines
(:mod:`lgvit.data.segmentation`), the per-pixel cross-entropy and mIoU evaluation
(:mod:`lgvit.tasks.segmentation.evaluate`); the run, its checkpoints, resume, preemption, DDP
and logs are the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lgvit.checkpoints.record import CheckpointRecord
from lgvit.core.errors import LgvitError, first_line
from lgvit.core.runtime import Dist, autocast, barrier
from lgvit.data.segmentation import (
    IGNORE,
    SEG_CROP,
    SegAugment,
    SegEvalLoader,
    SegTrainLoader,
    load_seg_split,
    rescale_size,
    resize_pair,
)
from lgvit.models import get_model_config, is_model
from lgvit.run.config import TrainConfig
from lgvit.run.engine import Prepared
from lgvit.tasks.segmentation.evaluate import evaluate_segmentation, normalise


def segmentation_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per pixel, 255 ignored, averaged over all pixels (ignored ones count 0):
    mmseg 0.13's ``CrossEntropyLoss`` (no ``avg_non_ignore``)."""
    loss = F.cross_entropy(logits.float(), mask, ignore_index=IGNORE, reduction="none")
    return loss.mean()


def build_segmenter(cfg: TrainConfig, num_classes: int, d: Dist) -> tuple[nn.Module, int]:
    """Semantic FPN on ``cfg.model`` (a pyramid), checked to run at the crop size."""
    from lgvit.dense.semfpn import create_segmenter

    if not is_model(cfg.model):
        raise LgvitError(f"unknown model {cfg.model!r} (`lgvit info` lists the registered ones)")
    crop = cfg.img_size or SEG_CROP
    sync_bn = d.world_size > 1 and d.device.type == "cuda"  # SyncBatchNorm needs CUDA
    try:
        model = create_segmenter(
            cfg.model, num_classes, drop_path_rate=cfg.drop_path, img_size=crop,
            sync_bn=sync_bn, grad_checkpointing=cfg.grad_checkpointing,
        )  # fmt: skip
        with torch.no_grad():
            model.eval()(torch.zeros(1, 3, crop, crop))
    except (ValueError, RuntimeError) as e:
        raise LgvitError(f"Semantic FPN on {cfg.model} at crop {crop}: {first_line(e)}") from None
    model.train()
    return model, crop


def check_seg_scale_memory(cfg: TrainConfig, model: nn.Module, d: Dist) -> None:
    """Refuse, in one line, a ``seg_scale`` whose evaluation forward (a whole 4:3 image at the
    scale, on the run's device) or training resize (one image at the largest ratio, in a
    loader process) needs more memory than is available (:mod:`lgvit.dense.memory`)."""
    from lgvit.dense import memory

    ratio = max(cfg.seg_ratio_range)

    def sizes(scale: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The eval image's (H, W) and the largest training resize's, as the pipelines do."""
        train = (int(scale[0] * ratio), int(scale[1] * ratio))
        return rescale_size(memory.PHOTO_HW, scale), rescale_size(memory.PHOTO_HW, train)

    if all(memory.small_enough(h * w) for h, w in sizes(cfg.seg_scale)):
        return
    model.eval()
    with torch.no_grad():
        forward = memory.measure_secant(lambda s: model(torch.zeros(1, 3, s, s)))
    model.train()
    # resize_pair's bytes per output pixel (float32 image, its rounded and clamped copies, the
    # mask as float32 and int64: 36), measured so that it follows the code.
    side = 128
    image, mask = torch.zeros(3, 4, 4, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.long)
    resize = memory.peak_bytes(lambda: resize_pair(image, mask, (side, side))) / side**2
    half = 1.0 if cfg.amp == "none" else 0.5  # 16-bit activations at the least

    def needs(scale: tuple[int, int]) -> list[memory.Need]:
        (h, w), (th, tw) = sizes(scale)
        return [
            memory.Need(half * forward(h * w), d.device,
                        f"Semantic FPN on {cfg.model} evaluating a 4:3 image at {w}x{h}"),
            memory.Need(resize * th * tw, torch.device("cpu"),
                        f"resizing a 4:3 training image to {tw}x{th} at ratio {ratio:g}"),
        ]  # fmt: skip

    memory.check_scale_fits("seg_scale", cfg.seg_scale, needs)


@dataclass
class SegmentationTask:
    """Semantic segmentation (:class:`lgvit.run.engine.Task`)."""

    # seg_scale sets the training and evaluation input size: a resume keeps it.
    identity_keys: tuple[str, ...] = (
        "task", "model", "data", "img_size", "num_classes", "seg_scale",
    )  # fmt: skip
    best_metric: str = "mIoU"
    cfg: TrainConfig | None = None
    num_classes: int = 0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def prepare(self, cfg: TrainConfig, d: Dist) -> Prepared:
        self.cfg = cfg
        if d.main:  # rank 0 first: an archive is extracted once
            train = load_seg_split(cfg.data, cfg.data_dir, "train", cfg.cache_dir)
            barrier(d)
        else:
            barrier(d)
            train = load_seg_split(cfg.data, cfg.data_dir, "train", cfg.cache_dir)
        val = load_seg_split(cfg.data, cfg.data_dir, "val", cfg.cache_dir)
        self.num_classes = len(train.classes)
        if cfg.num_classes and cfg.num_classes != self.num_classes:
            raise LgvitError(
                f"num_classes={cfg.num_classes} but {cfg.data} has {self.num_classes} classes"
            )
        model, crop = build_segmenter(cfg, self.num_classes, d)
        check_seg_scale_memory(cfg, model, d)
        pcfg = get_model_config(cfg.model)
        self.mean, self.std = tuple(pcfg.mean), tuple(pcfg.std)
        aug = SegAugment(crop=crop, scale=cfg.seg_scale, ratio_range=cfg.seg_ratio_range,
                         cat_max_ratio=cfg.cat_max_ratio, hflip=cfg.hflip,
                         photometric=cfg.photometric)  # fmt: skip
        train_loader = SegTrainLoader(train, aug, cfg.batch_size, cfg.seed, d.rank,
                                      d.world_size, cfg.workers, d.device)  # fmt: skip
        test_loader = SegEvalLoader(val, cfg.seg_scale, d.rank, d.world_size, cfg.workers,
                                    d.device)  # fmt: skip
        params = sum(p.numel() for p in model.parameters()) / 1e6
        description = (
            f"Semantic FPN on {cfg.model} ({params:.2f}M params), data {cfg.data}: "
            f"{len(train)} train / {len(val)} val images, {self.num_classes} classes, "
            f"crop {crop}px"
        )
        record = CheckpointRecord(
            task="segmentation", model=cfg.model, img_size=crop, num_classes=self.num_classes,
            classes=tuple(train.classes), mean=self.mean, std=self.std, dataset=cfg.data,
            seg_scale=tuple(cfg.seg_scale),
        )  # fmt: skip
        return Prepared(model, train_loader, test_loader, record.to_meta(), description)

    def load_initial(self, model: nn.Module, path: str) -> str:
        """``--initial-checkpoint``: a segmentation checkpoint (lgvit's, or the authors' mmseg
        ``.pth``) fine-tunes the whole model (a classifier of another class count dropped);
        anything else is the backbone's classification weights (lgvit's, the authors'
        ``.pth``, timm's), read as ``create_model`` reads them, head and final norm left out."""
        from lgvit.checkpoints.files import load_into, load_weights
        from lgvit.dense.mmseg import MMSEG_LAYOUT, is_mmseg_layout
        from lgvit.models import create_model
        from lgvit.models.loading import adapt_state_dict

        weights = load_weights(path)
        flag = f"--initial-checkpoint {path}"
        if is_mmseg_layout(weights) or any(k.startswith("decode_head.") for k in weights):
            weights = adapt_state_dict(model, weights, path, (MMSEG_LAYOUT,))
            own = model.state_dict()
            head = [k for k in weights if k.startswith("decode_head.conv_seg.")
                    and k in own and weights[k].shape != own[k].shape]  # fmt: skip
            for k in head:
                weights[k] = own[k]
            load_into(model, weights, flag, f"Semantic FPN on {self.cfg.model}")
            dropped = " (its classifier for another class count dropped)" if head else ""
            return f"started from the Semantic FPN weights of {path}{dropped}"
        try:
            cls = create_model(self.cfg.model, checkpoint_path=path)
        except LgvitError as e:
            raise LgvitError(f"--initial-checkpoint: {e}") from None
        inner = model.backbone.model
        sd = {k: v for k, v in cls.state_dict().items() if k in inner.state_dict()}
        load_into(inner, {**inner.state_dict(), **sd}, flag, self.cfg.model)
        return f"backbone started from the classification weights of {path} ({len(sd)} tensors)"

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        # LIT's segmentation configs: AdamW with one weight decay for every parameter.
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": params, "weight_decay": cfg.weight_decay}]

    def loss(
        self, model: nn.Module, batch: Any, epoch: int, d: Dist, amp: torch.dtype | None
    ) -> tuple[torch.Tensor, int]:
        image, mask = batch
        x = normalise(image.to(d.device, non_blocking=True), self.mean, self.std)
        mask = mask.to(d.device, non_blocking=True)
        with autocast(d.device, amp):
            logits = model(x)
        return segmentation_loss(logits, mask), len(x)

    def evaluate(
        self, model: nn.Module, loader: Any, d: Dist, amp: torch.dtype | None, desc: str
    ) -> dict[str, Any]:
        return evaluate_segmentation(model, loader, self.num_classes, d, amp, self.mean,
                                     self.std, desc, flip=self.cfg.eval_tta == "flip")  # fmt: skip

    def summary(self, result: dict[str, Any]) -> str:
        parts = [f"{k} {result[k]:.2f}%" for k in ("mIoU", "mAcc", "aAcc") if k in result]
        return " ".join(parts)

    def epoch_info(self, epoch: int) -> dict[str, Any]:
        return {}

    def epoch_cost(self, epoch: int) -> float:
        return 1.0


def make_task() -> SegmentationTask:
    """The task the engine runs (:data:`lgvit.tasks.run.MAKE_TASK` names it)."""
    return SegmentationTask()
