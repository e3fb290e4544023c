"""A segmentation_models_pytorch model on an lgvit encoder, trained on the CIFAR-mosaic set with
lgvit's own Semantic FPN CPU run's recipe (the shipped config cifar_mosaic_semfpn_lit_ti_cpu, read
here): lgvit's loaders and augmentation, loss, AdamW, poly schedule, autocast and mIoU/mAcc/aAcc
evaluation, the same functions the engine calls. Only the model differs, so this run's mIoU
stands beside lgvit's Semantic FPN one (docs/results.md).

    python benchmarks/make_cifar_mosaic.py PATH/cifar10-jpeg.tar.gz /tmp/cifar_mosaic
    python benchmarks/train_smp_mosaic.py --data-dir /tmp/cifar_mosaic [--arch FPN|Unet]
        [--encoder lit_ti] [--iters 2000] [--batch-size 16] [--amp auto|bf16|fp32]
        [--eval-every-epochs 2] [--seed 0] [--out DIR]

Wall time counts training and the evaluations (not data loading into memory or model
building); img/s counts the training steps only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import segmentation_models_pytorch as smp
import torch
import torch.nn as nn

import lgvit  # noqa: F401  (registers every lgvit model in timm, where smp's tu- finds it)
from lgvit.core.runtime import (
    autocast,
    resolve_amp,
    seed_everything,
    setup_distributed,
    tune_cpu_allocator,
)
from lgvit.data.segmentation import SegAugment, SegEvalLoader, SegTrainLoader, load_seg_split
from lgvit.dense.backbone import built_for_dense_size
from lgvit.models import get_model_config
from lgvit.run.config import TrainConfig, load_config, resolve_config, scaled_lr
from lgvit.run.optim import build_optimizer, lr_at, run_epochs, total_steps, warmup_steps
from lgvit.tasks.segmentation.evaluate import evaluate_segmentation, normalise
from lgvit.tasks.segmentation.train import SegmentationTask, segmentation_loss
from lgvit.tools.measure import describe_machine

METRICS = ("mIoU", "mAcc", "aAcc")  # lgvit.tasks.segmentation.evaluate.SegMetrics, as mmseg
RECIPE = resolve_config("cifar_mosaic_semfpn_lit_ti_cpu")  # a shipped config


def build_model(arch: str, cfg: TrainConfig, num_classes: int) -> nn.Module:
    """smp's ``arch`` on the ``tu-`` encoder, built with the backbone arguments lgvit's
    Semantic FPN gets (create_backbone): its drop path, and the crop as the input size only
    for Swin-skeleton models (LIT-Ti keeps its 224 px position embeddings, resized per input)."""
    size = {"img_size": cfg.img_size} if built_for_dense_size(cfg.model) else {}
    return getattr(smp, arch)(
        f"tu-{cfg.model}", encoder_weights=None, classes=num_classes,
        drop_path_rate=cfg.drop_path, **size,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--arch", default="FPN", choices=["FPN", "Unet"])
    p.add_argument("--encoder", default="lit_ti")
    # None: the recipe's value (2000 iterations at batch 16, evaluation every 2 epochs, seed 0).
    p.add_argument("--iters", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--eval-every-epochs", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="folder for summary.json")
    args = p.parse_args()

    tune_cpu_allocator()  # as the `lgvit` command line does before a run
    cfg = load_config(
        RECIPE, model=args.encoder, data_dir=args.data_dir, iters=args.iters,
        batch_size=args.batch_size, amp={"fp32": "none"}.get(args.amp, args.amp),
        eval_every=args.eval_every_epochs, seed=args.seed,
    )  # fmt: skip
    d = setup_distributed(cfg.device)  # one process: its device (CUDA when there is one)
    seed_everything(cfg.seed)  # before the model, as the engine: the same initial draws

    # Data: SegmentationTask.prepare's loaders, built from the same config keys.
    train = load_seg_split(cfg.data, cfg.data_dir, "train", cfg.cache_dir)
    val = load_seg_split(cfg.data, cfg.data_dir, "val", cfg.cache_dir)
    num_classes = len(train.classes)
    aug = SegAugment(crop=cfg.img_size, scale=cfg.seg_scale, ratio_range=cfg.seg_ratio_range,
                     cat_max_ratio=cfg.cat_max_ratio, hflip=cfg.hflip,
                     photometric=cfg.photometric)  # fmt: skip
    train_loader = SegTrainLoader(train, aug, cfg.batch_size, cfg.seed, workers=cfg.workers)
    test_loader = SegEvalLoader(val, cfg.seg_scale, workers=cfg.workers)
    mcfg = get_model_config(cfg.model)  # normalisation: the encoder's own mean/std
    mean, std = tuple(mcfg.mean), tuple(mcfg.std)

    model = build_model(args.arch, cfg, num_classes).to(d.device).train()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    amp = resolve_amp(cfg.amp, d.device)
    amp_name = {torch.bfloat16: "bf16", None: "fp32"}.get(amp, str(amp))

    # Optimisation: the task's parameter groups (one weight decay for all), the engine's
    # optimizer and per-step schedule (lr scaled by batch / lr_base_batch, poly to min_lr).
    base_lr = scaled_lr(cfg, d.world_size)
    optimizer = build_optimizer(cfg, SegmentationTask().param_groups(model, cfg), base_lr, d.device)
    spe = len(train_loader)
    schedule = dict(total_steps=total_steps(cfg, spe), warmup_steps=warmup_steps(cfg, spe),
                    cfg=cfg, base_lr=base_lr, steps_per_epoch=spe)  # fmt: skip
    epochs = run_epochs(cfg, spe)
    print(f"smp.{args.arch} on tu-{cfg.model}: {params:.2f}M params; {len(train)} train / "
          f"{len(val)} val images, {num_classes} classes, crop {cfg.img_size}px; "
          f"{schedule['total_steps']} iterations at batch {cfg.batch_size} ({epochs} epochs), "
          f"lr {base_lr:g}; amp {amp_name}")  # fmt: skip

    step, images, train_time, history = 0, 0, 0.0, []
    t_run = time.perf_counter()
    for epoch in range(epochs):
        train_loader.set_epoch(epoch)  # per-epoch order and crops, as in lgvit's run
        model.train()
        t0, loss_sum, batches = time.perf_counter(), 0.0, 0
        for image, mask in train_loader:
            if step >= schedule["total_steps"]:  # an iteration budget may end mid-epoch
                break
            lr = lr_at(step, **schedule)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = normalise(image.to(d.device), mean, std)
            with autocast(d.device, amp):
                logits = model(x)  # smp: at the input's size, as Semantic FPN's
            loss = segmentation_loss(logits, mask.to(d.device))
            if not torch.isfinite(loss):  # the engine stops too (max_nonfinite 0)
                raise SystemExit(f"loss is {loss.item()} at step {step + 1}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_grad:  # None in the recipe
                nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            optimizer.step()
            loss_sum += loss.item()
            batches, images, step = batches + 1, images + len(x), step + 1
        train_time += time.perf_counter() - t0
        if epoch + 1 == epochs or (epoch + 1) % cfg.eval_every == 0:  # the engine's rule
            result = evaluate_segmentation(model, test_loader, num_classes, d, amp, mean, std,
                                           "eval", flip=cfg.eval_tta == "flip")  # fmt: skip
            history.append({"epoch": epoch + 1, "step": step,
                            "train_loss": round(loss_sum / batches, 4),
                            **{k: round(result[k], 2) for k in METRICS}})  # fmt: skip
            print(" ".join(f"{k} {v}" for k, v in history[-1].items()), flush=True)
    wall = time.perf_counter() - t_run

    summary: dict[str, Any] = {
        "arch": args.arch, "encoder": cfg.model, "params_M": round(params, 2),
        "iterations": step, "batch_size": cfg.batch_size, "wall_s": round(wall, 1),
        "train_img_per_s": round(images / train_time, 2), **{k: history[-1][k] for k in METRICS},
        "amp": amp_name, "torch": torch.__version__,
        "machine": describe_machine(d.device).rsplit(", torch ", 1)[0],  # CPU model, threads
    }  # fmt: skip
    print("summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    summary |= {"per_class_iou": result["per_class_iou"], "history": history}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
