"""Object detection and instance segmentation on the shared run (:mod:`lgvit.run.engine`):
torchvision's RetinaNet and Mask R-CNN on any pyramid model, LIT's COCO 1x recipe
(the shipped configs coco_*).

The task brings the detector (:mod:`lgvit.dense.detection`), COCO data read with pycocotools
(:mod:`lgvit.data.coco`), the detector's own losses and COCOeval
(:mod:`lgvit.tasks.detection.evaluate`); the run, its checkpoints, resume, preemption, DDP
and logs are the engine's. Images stay uint8 until the device: the detector's transform
resizes them to ``det_scale``, normalises and pads them to a multiple of 32 there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lgvit.checkpoints.kinds import detector_spec
from lgvit.checkpoints.record import CheckpointRecord
from lgvit.core.errors import LgvitError, first_line
from lgvit.core.runtime import Dist, autocast, barrier
from lgvit.data.segmentation import rescale_size
from lgvit.models import is_model
from lgvit.run.config import TrainConfig
from lgvit.run.engine import Prepared


def build_detector(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """``cfg.detector`` on ``cfg.model``, checked to run on a small image before data loads."""
    from lgvit.dense.detection import create_detector

    if not is_model(cfg.model):
        raise LgvitError(f"unknown model {cfg.model!r} (`lgvit info` lists the registered ones)")
    long, short = max(cfg.det_scale), min(cfg.det_scale)
    try:
        model = create_detector(
            cfg.detector, cfg.model, num_classes, min_size=short, max_size=long,
            img_size=cfg.img_size or short, drop_path_rate=cfg.drop_path,
            grad_checkpointing=cfg.grad_checkpointing,
        )  # fmt: skip
        # A small probe (the transform set to 64 px for it): building is what is checked, and a
        # full 800 px forward of LIT-S costs seconds on a CPU.
        sizes = model.transform.min_size, model.transform.max_size
        model.transform.min_size, model.transform.max_size = (64,), 64
        with torch.no_grad():
            model.eval()([torch.zeros(3, 64, 64)])
        model.transform.min_size, model.transform.max_size = sizes
    except (ValueError, RuntimeError) as e:
        raise LgvitError(f"{cfg.detector} on {cfg.model}: {first_line(e)}") from None
    return model.train()


def check_det_scale_memory(cfg: TrainConfig, model: nn.Module, d: Dist) -> None:
    """Refuse, in one line, a ``det_scale`` whose training batch (``batch_size`` 4:3 images
    resized to the scale and padded, forward and backward through the backbone and its FPN
    alone, on the run's device) needs more memory than is available
    (:mod:`lgvit.dense.memory`)."""
    from lgvit.dense.memory import PHOTO_HW, Need, check_scale_fits, measure_secant, small_enough

    def padded(scale: tuple[int, int]) -> tuple[int, int]:  # the transform pads to 32
        h, w = rescale_size(PHOTO_HW, scale)
        return -(-h // 32) * 32, -(-w // 32) * 32

    b, (h, w) = cfg.batch_size, padded(cfg.det_scale)
    if small_enough(b * h * w):
        return
    backbone = model.backbone

    def step(s: int) -> None:
        # Eval mode (no drop path: no random draws) with gradients: the activations training
        # keeps for the backward pass (fewer where activation checkpointing is on), then it.
        # The backbone only: the heads' memory depends on the detections a random model makes.
        out = backbone(torch.zeros(1, 3, s, s))
        sum(o.sum() for o in out.values()).backward()

    backbone.eval()
    try:
        fwd_bwd = measure_secant(step)
    finally:
        backbone.train()
        for p in backbone.parameters():
            p.grad = None
    half = 1.0 if cfg.amp == "none" else 0.5  # 16-bit activations at the least

    def needs(scale: tuple[int, int]) -> list[Need]:
        h, w = padded(scale)
        return [Need(half * fwd_bwd(h * w, b), d.device, f"{cfg.detector} on {cfg.model}: "
                     f"its backbone alone, training on a batch of {b} images of {w}x{h} "
                     "(4:3)")]  # fmt: skip

    check_scale_fits("det_scale", cfg.det_scale, needs)


def detection_loss(losses: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of the detector's losses (classification, boxes, RPN, masks), float32."""
    return sum(v.float() for v in losses.values())  # type: ignore[return-value]


@dataclass
class DetectionTask:
    """Object detection / instance segmentation (:class:`lgvit.run.engine.Task`)."""

    # det_scale and img_size set the input size (and LIT-S's bias tables): a resume keeps them.
    identity_keys: tuple[str, ...] = (
        "task", "detector", "model", "data", "num_classes", "img_size", "det_scale",
    )  # fmt: skip
    best_metric: str = "bbox_AP"
    cfg: TrainConfig | None = None
    val: Any = None
    train_loader: Any = None
    label_offset: int = 0

    def prepare(self, cfg: TrainConfig, d: Dist) -> Prepared:
        from lgvit.data.coco import DetEvalLoader, DetTrainLoader, load_coco_split, require_masks

        self.cfg = cfg
        if d.main:  # rank 0 first: an archive is extracted once
            train = load_coco_split(cfg.data_dir, "train", cfg.cache_dir)
            barrier(d)
        else:
            barrier(d)
            train = load_coco_split(cfg.data_dir, "train", cfg.cache_dir)
        self.val = load_coco_split(cfg.data_dir, "val", cfg.cache_dir)
        n = len(train.classes)
        if cfg.num_classes and cfg.num_classes != n:
            raise LgvitError(f"num_classes={cfg.num_classes} but {cfg.data} has {n} classes")
        if self.val.cat_ids != train.cat_ids:
            raise LgvitError(f"{self.val.ann_file}: its categories differ from the training "
                             f"split's ({train.ann_file})")  # fmt: skip
        spec = detector_spec(cfg.detector)
        masks = spec.masks
        if masks:  # before the model is built: a file without masks is one line, at once
            require_masks(train)
            require_masks(self.val)
        model = build_detector(cfg, n)
        check_det_scale_memory(cfg, model, d)
        self.label_offset = spec.label_offset
        train_loader = DetTrainLoader(train, cfg.batch_size, cfg.seed, d.rank, d.world_size,
                                      cfg.workers, with_masks=masks,
                                      hflip=0.5 if cfg.hflip else 0.0,
                                      max_bad_fraction=cfg.max_bad_fraction,
                                      device=d.device)  # fmt: skip
        test_loader = DetEvalLoader(self.val, d.rank, d.world_size, cfg.workers,
                                    max_bad_fraction=cfg.max_bad_fraction,
                                    device=d.device)  # fmt: skip
        self.train_loader = train_loader
        params = sum(p.numel() for p in model.parameters()) / 1e6
        long, short = max(cfg.det_scale), min(cfg.det_scale)
        description = (
            f"{cfg.detector} on {cfg.model} ({params:.2f}M params), data {cfg.data}: "
            f"{len(train)} train / {len(self.val)} val images, {n} classes, images at "
            f"most {long}x{short}"
        )
        meta = CheckpointRecord(
            task="detection", detector=cfg.detector, model=cfg.model,
            img_size=cfg.img_size or short, num_classes=n, classes=tuple(train.classes),
            cat_ids=tuple(train.cat_ids), dataset=cfg.data, det_scale=(long, short),
        ).to_meta()  # fmt: skip
        notes = train_loader.notes + test_loader.notes
        for note in notes if d.main else []:  # the log has them; stderr too, as any warning
            warnings.warn(note, stacklevel=2)
        return Prepared(model, train_loader, test_loader, meta, description, notes)

    def load_initial(self, model: nn.Module, path: str) -> str:
        """``--initial-checkpoint``: a detection checkpoint (lgvit's, or the authors' mmdet
        ``.pth``) fine-tunes the whole detector; anything else is the backbone's
        classification weights (lgvit's, the authors' ``.pth``, timm's), head left out."""
        from lgvit.checkpoints.files import load_into, load_weights
        from lgvit.dense.mmdet import MMDET_LAYOUT, is_mmdet_layout
        from lgvit.models import create_model
        from lgvit.models.loading import adapt_state_dict

        weights = load_weights(path)
        flag = f"--initial-checkpoint {path}"
        what = f"{self.cfg.detector} on {self.cfg.model}"
        if is_mmdet_layout(weights) or any(k.startswith("backbone.body.") for k in weights):
            weights = adapt_state_dict(model, weights, path, (MMDET_LAYOUT,))
            load_into(model, weights, flag, what)
            return f"started from the {what} weights of {path}"
        try:
            cls = create_model(self.cfg.model, checkpoint_path=path)
        except LgvitError as e:
            raise LgvitError(f"--initial-checkpoint: {e}") from None
        inner = model.backbone.body.model
        sd = {k: v for k, v in cls.state_dict().items() if k in inner.state_dict()}
        load_into(inner, {**inner.state_dict(), **sd}, flag, self.cfg.model)
        return f"backbone started from the classification weights of {path} ({len(sd)} tensors)"

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        # LIT's detection configs: AdamW on every parameter; LIT-S's also leave names holding
        # 'norm', 'relative_position_bias_table', 'absolute_pos_embed' undecayed (mmdet's
        # paramwise custom_keys with decay_mult 0): ``no_decay_keys``.
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if any(k in name for k in cfg.no_decay_keys) else decay).append(p)
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
        return groups + ([{"params": no_decay, "weight_decay": 0.0}] if no_decay else [])

    def loss(
        self, model: nn.Module, batch: Any, epoch: int, d: Dist, amp: torch.dtype | None
    ) -> tuple[torch.Tensor, int]:
        images, targets = batch
        dev = d.device
        x = [im.to(dev, non_blocking=True).float().div_(255) for im in images]
        t = [{k: v.to(dev, non_blocking=True) for k, v in tg.items()} for tg in targets]
        for tg in t:
            tg["labels"] = tg["labels"] + self.label_offset
        with autocast(dev, amp):
            losses = model(x, t)
        return detection_loss(losses), len(x)

    def evaluate(
        self, model: nn.Module, loader: Any, d: Dist, amp: torch.dtype | None, desc: str
    ) -> dict[str, Any]:
        from lgvit.tasks.detection.evaluate import evaluate_detection

        masks = detector_spec(self.cfg.detector).masks
        result = evaluate_detection(model, loader, self.val, self.label_offset, d, amp, desc,
                                    masks=masks)  # fmt: skip
        if result["unreadable"] and d.main:
            examples = "".join(f", e.g. {m}" for m in result.get("unreadable_examples", [])[:1])
            warnings.warn(f"{desc}: {result['unreadable']} unreadable validation image(s) "
                          f"counted as without detections{examples}", stacklevel=2)  # fmt: skip
        return result

    def summary(self, result: dict[str, Any]) -> str:
        keys = ("bbox_AP", "bbox_AP50", "segm_AP")
        return " ".join(f"{k} {result[k]:.2f}" for k in keys if k in result)

    def epoch_info(self, epoch: int) -> dict[str, Any]:
        # This process's share: the training images of the epoch that could not be used.
        return {"skipped_images": len(self.train_loader.skipped)}

    def epoch_cost(self, epoch: int) -> float:
        return 1.0


def make_task() -> DetectionTask:
    """The task the engine runs (:data:`lgvit.tasks.run.MAKE_TASK` names it)."""
    return DetectionTask()
