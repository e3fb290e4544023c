"""The training loop: the DeiT recipe of the papers, on one CPU, one GPU or many (torchrun).

Read top to bottom: set-up (processes, data, model, optimizer), the per-step schedule, one epoch of
training, evaluation, checkpoints, and ``train()`` tying them together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lgvit.checkpoint import (
    atomic_save_safetensors,
    atomic_write_bytes,
    build_train_state,
    checkpoint_paths,
    load_checkpoint_pair,
    restore_rng_state,
    save_checkpoint,
    state_dict_to_cpu,
)
from lgvit.config import (
    TrainConfig,
    config_from_dict,
    config_keys,
    config_to_dict,
    save_config,
    scaled_lr,
)
from lgvit.data.datasets import DatasetSplits, load_dataset
from lgvit.data.loader import AugmentConfig, BatchLoader
from lgvit.data.stream import make_loader
from lgvit.data.transforms import soft_target_cross_entropy
from lgvit.errors import LgvitError
from lgvit.models import create_model, get_model_config, is_model
from lgvit.progress import RunClock, StepProgress, format_duration, on_terminal

# --------------------------------------------------------------------------------- processes


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed() -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: gloo on CPU, nccl on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    return Dist(rank, world, local, device)


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world_size > 1:
        dist.all_reduce(t)
    return t


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------- precision


def cpu_supports_bf16() -> bool:
    """AMX or AVX512-BF16: the CPU has fast bf16 matmuls (oneDNN reports it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """'auto' -> bf16 where the hardware runs it fast, else full precision."""
    if amp == "none":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise LgvitError("--amp fp16 needs a CUDA GPU; use --amp bf16 or none on the CPU")
        return torch.float16
    if amp == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# --------------------------------------------------------------------------------- schedule


def lr_at(
    step: int, total_steps: int, warmup_steps: int, cfg: TrainConfig, base_lr: float
) -> float:
    """Linear warm-up from warmup_lr, then per-step cosine decay from base_lr to min_lr."""
    if step < warmup_steps:
        return cfg.warmup_lr + (base_lr - cfg.warmup_lr) * step / warmup_steps
    t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return cfg.min_lr + 0.5 * (base_lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def param_groups(
    model: nn.Module, weight_decay: float, offset_lr_factor: float = 1.0
) -> list[dict[str, Any]]:
    """Weight decay on weights only: not on position embeddings, norms or biases (DeiT).

    Sampling-offset weights (``*offset_conv.weight``, LIT's deformable token merging) train at
    ``offset_lr_factor`` x the learning rate, with weight decay, as the LIT authors' code does;
    their biases stay at the full rate without decay. ``lr_scale`` carries the factor.
    """
    skip = set(getattr(model, "no_weight_decay", set)())
    decay, no_decay, offsets = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("offset_conv.weight"):
            offsets.append(p)
        elif p.ndim <= 1 or name in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    if offsets:
        groups.append(
            {"params": offsets, "weight_decay": weight_decay, "lr_scale": offset_lr_factor}
        )
    return groups


class ModelEma:
    """Exponential moving average of the weights (off by default, as in the paper)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].lerp_(v.detach(), 1 - self.decay)
            else:
                self.shadow[k].copy_(v)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow


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
    if not is_model(cfg.model):
        raise LgvitError(f"unknown model {cfg.model!r}; `lgvit info` lists the registered ones")
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


# --------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: BatchLoader,
    num_classes: int,
    d: Dist,
    amp: torch.dtype | None,
    desc: str = "eval",
) -> dict[str, Any]:
    """Top-1, top-5, loss and per-class accuracy over the whole test split (all ranks); a
    progress bar on a terminal (rank 0)."""
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
            logits = model(x)
        logits = logits.float()
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


# --------------------------------------------------------------------------------- training


class NonFiniteLoss(LgvitError):
    pass


def train_one_epoch(
    model: nn.Module,
    loader: BatchLoader,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    ema: ModelEma | None,
    cfg: TrainConfig,
    d: Dist,
    amp: torch.dtype | None,
    step: int,
    schedule: dict[str, Any],
    epoch: int,
    log: Any,
    clock: RunClock | None = None,
) -> tuple[float, int, int]:
    """One pass over the training split; returns (mean loss, images seen, global step).

    Progress: a bar on a terminal (rank 0), else a plain line every ``cfg.log_every`` steps
    (lines go to ``train.log`` either way)."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    images = 0
    bar = d.main and on_terminal()
    progress = StepProgress(len(loader), f"epoch {epoch + 1}/{cfg.epochs}", bar)
    for i, (x, y) in enumerate(loader):
        lr = lr_at(step, **schedule)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        with autocast(d.device, amp):
            logits = model(x)
        logits = logits.float()
        if y.ndim == 2:  # soft targets from mixup/cutmix/label smoothing
            loss = soft_target_cross_entropy(logits, y)
        else:
            loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            raise NonFiniteLoss(
                f"loss is {loss.item()} at epoch {epoch} step {i}; stopping. The last good "
                f"checkpoint is kept in {cfg.out} (lower --set lr=... or try --amp none)"
            )
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if cfg.clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if ema is not None:
            ema.update(unwrap(model))
        loss_sum += loss.detach().double().cpu()
        images += len(x)
        step += 1
        run_eta = clock.eta(step) if clock else None
        eta = f", run ETA {format_duration(run_eta)}" if run_eta is not None else ""
        if progress.wants_postfix():
            progress.update(len(x) * d.world_size, loss=f"{loss.item():.4f}", lr=f"{lr:.3g}",
                            run_ETA=format_duration(run_eta or 0))  # fmt: skip
        else:
            progress.update(len(x) * d.world_size)
        if cfg.log_every and (i + 1) % cfg.log_every == 0:
            line = (
                f"epoch {epoch} step {i + 1}/{len(loader)} loss {loss.item():.4f} lr {lr:.3g}, "
                f"{progress.img_per_s:.0f} img/s, epoch ETA {format_duration(progress.eta())}{eta}"
            )
            log(line, console=not bar)
    progress.close()
    stats = torch.stack([loss_sum, torch.tensor(float(len(loader)))]).to(d.device)
    stats = all_reduce_sum(stats, d)
    mean_loss = (stats[0] / stats[1].clamp(min=1)).item()
    return mean_loss, images * d.world_size, step


def unwrap(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(model, "module", model)  # DDP


class RunLog:
    """Rank 0 prints and appends to ``<out>/train.log``; other ranks stay quiet."""

    def __init__(self, out: Path, main: bool) -> None:
        self.main = main
        self.path = out / "train.log"

    def __call__(self, msg: str, console: bool = True) -> None:
        if not self.main:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if console:
            print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def checkpoint_metadata(cfg: TrainConfig, img_size: int, splits: DatasetSplits) -> dict[str, str]:
    """What ``lgvit eval``/``predict`` need to rebuild the model without the run's config."""
    return {
        "model": cfg.model,
        "img_size": str(img_size),
        "num_classes": str(len(splits.train.classes)),
        "classes": json.dumps(list(splits.train.classes)),
        "mean": json.dumps(list(splits.mean)),
        "std": json.dumps(list(splits.std)),
        "dataset": cfg.data,
        "model_kwargs": json.dumps(model_kwargs(cfg)),
    }


def _find_resume(cfg: TrainConfig) -> Path | None:
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        stem = Path(cfg.out) / "last"
        return stem if checkpoint_paths(stem)[0].exists() else None
    stem = Path(cfg.resume)
    if stem.is_dir():
        stem = stem / "last"
    if not checkpoint_paths(stem)[0].exists():
        raise LgvitError(f"--resume {cfg.resume}: no checkpoint found there")
    return stem


def train(cfg: TrainConfig, explicit: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run (or resume) a training run as configured; returns the last epoch's metrics.

    When resuming, the run's saved config is used; only ``out``, ``resume`` and the keys named
    in ``explicit`` (what this invocation set: flags, ``--set``, the YAML file) override it.
    """
    d = setup_distributed()
    out = Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    barrier(d)
    log = RunLog(out, d.main)
    resume_stem = _find_resume(cfg)
    if resume_stem is None and checkpoint_paths(out / "last")[0].exists():
        raise LgvitError(
            f"{out} already holds a run; pass --resume auto to continue it, or another --out"
        )
    state: dict[str, Any] | None = None
    weights: dict[str, torch.Tensor] | None = None
    if resume_stem is not None:
        weights, state = load_checkpoint_pair(resume_stem)
        saved = config_from_dict(state["config"], source=f"{resume_stem}")
        now = config_to_dict(cfg)
        keep = {k: now[k] for k in {"out", "resume", *explicit}}
        cfg = config_from_dict({**config_to_dict(saved), **keep}, source="resume")
    seed_everything(cfg.seed + d.rank)
    if d.main:
        if resume_stem is None:  # a fresh run: no stale lines from a run that never saved
            for name in ("metrics.jsonl", "train.log"):
                (out / name).unlink(missing_ok=True)
        save_config(cfg, out / "config.yaml")

    model, img_size = build_model(cfg, num_classes=cfg.num_classes or 1)
    splits = build_data(cfg, img_size, d)
    num_classes = cfg.num_classes or len(splits.train.classes)
    if num_classes != model.num_classes:
        model.reset_classifier(num_classes)
    if weights is not None:
        model.load_state_dict(weights)
    model.to(d.device)
    amp = resolve_amp(cfg.amp, d.device)
    world = d.world_size
    global_batch = cfg.batch_size * world
    log(
        f"model {cfg.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
        f"data {cfg.data}: {len(splits.train)} train / {len(splits.test)} test images, "
        f"{num_classes} classes, {img_size}px; {world} process(es) on {d.device.type}, "
        f"global batch {global_batch}; amp {amp or 'none'}"
    )
    if splits.skipped:
        log(f"skipped {len(splits.skipped)} unreadable images, e.g. {splits.skipped[:3]}")

    aug = augment_config(cfg, img_size, splits)
    common = dict(
        num_classes=num_classes, aug=aug, seed=cfg.seed, rank=d.rank, world_size=world,
        device=d.device, workers=cfg.workers, max_bad_fraction=cfg.max_bad_fraction,
    )  # fmt: skip
    train_loader = make_loader(
        splits.train, cfg.batch_size, train=True, repeated_aug=cfg.repeated_aug, **common
    )
    test_loader = make_loader(splits.test, max(cfg.batch_size, 64), train=False, **common)
    if len(train_loader) == 0:
        raise LgvitError(
            f"--batch-size {cfg.batch_size} x {world} process(es) is larger than the "
            f"{len(splits.train)} training images"
        )

    base_lr = scaled_lr(cfg, world)
    fused = {"fused": True} if d.device.type in ("cpu", "cuda") else {}
    groups = param_groups(model, cfg.weight_decay, cfg.offset_lr_factor)
    optimizer = torch.optim.AdamW(
        groups, lr=base_lr, betas=tuple(cfg.opt_betas),
        eps=cfg.opt_eps, **fused,
    )  # fmt: skip
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema else None
    steps_per_epoch = len(train_loader)
    schedule = dict(
        total_steps=cfg.epochs * steps_per_epoch,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        cfg=cfg,
        base_lr=base_lr,
    )
    start_epoch, step, best = 0, 0, None
    history: list[dict[str, Any]] = []  # metrics.jsonl, also kept in every checkpoint
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema"):
            ema.shadow = {k: v.to(d.device) for k, v in state["ema"].items()}
        start_epoch, step, best = state["epoch"] + 1, state["global_step"], state["best_metric"]
        rngs = state.get("extra", {}).get("rng_per_rank") or []
        if len(rngs) == world:  # same process count: continue every rank's random stream
            restore_rng_state(rngs[d.rank])
        history = list(state.get("extra", {}).get("history", []))
        if d.main:  # metrics.jsonl as of the checkpoint: no lost or doubled epochs
            atomic_write_bytes(
                out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history).encode()
            )
        log(f"resumed from {resume_stem} after epoch {state['epoch'] + 1}")

    net: nn.Module = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[d.device.index] if d.device.type == "cuda" else None
        )
    if cfg.compile:
        net = torch.compile(net)

    meta = checkpoint_metadata(cfg, img_size, splits)
    metrics: dict[str, Any] = {}
    t_start = time.time()
    clock = RunClock(cfg.epochs * steps_per_epoch, step)
    for epoch in range(start_epoch, cfg.epochs):
        train_loader.set_epoch(epoch)
        t0 = time.time()
        train_loss, seen, step = train_one_epoch(
            net, train_loader, optimizer, scaler, ema, cfg, d, amp, step, schedule, epoch, log,
            clock,
        )  # fmt: skip
        train_time = time.time() - t0
        ev = evaluate(net, test_loader, num_classes, d, amp)
        if ema is not None:
            ev_model = _ema_model(model, ema)
            ev["ema_acc1"] = evaluate(ev_model, test_loader, num_classes, d, amp, "eval EMA")[
                "acc1"
            ]
        metrics = {
            "epoch": epoch,
            "train_loss": round(train_loss, 6),
            "test_acc1": round(ev["acc1"], 4),
            "test_acc5": round(ev["acc5"], 4),
            "test_loss": round(ev["loss"], 6),
            "lr": optimizer.param_groups[0]["lr"],
            "img_per_s": round(seen / train_time, 2),
            "epoch_time_s": round(time.time() - t0, 3),
        }
        if "ema_acc1" in ev:
            metrics["test_ema_acc1"] = round(ev["ema_acc1"], 4)
        is_best = best is None or ev["acc1"] > best
        best = ev["acc1"] if is_best else best
        history.append(metrics)
        if d.main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
        _save(model, optimizer, scaler, ema, cfg, epoch, step, best, meta, out, is_best, d, history)
        log(
            f"epoch {epoch + 1}/{cfg.epochs}: train loss {train_loss:.4f}, test top-1 "
            f"{ev['acc1']:.2f}% top-5 {ev['acc5']:.2f}%, {metrics['img_per_s']:.0f} img/s, "
            f"{metrics['epoch_time_s']:.1f}s"
            + (
                f", run ETA {format_duration(clock.eta(step) or 0)}"
                if epoch + 1 < cfg.epochs
                else ""
            )
        )
        _fault_injection(epoch)
        if cfg.time_limit_min and (time.time() - t_start) / 60 > cfg.time_limit_min:
            log(f"time limit of {cfg.time_limit_min} min reached after epoch {epoch + 1}")
            break
    barrier(d)
    if world > 1:
        dist.destroy_process_group()
    return metrics


def _ema_model(model: nn.Module, ema: ModelEma) -> nn.Module:
    import copy

    m = copy.deepcopy(model)
    m.load_state_dict(ema.shadow)
    return m


def _save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    ema: ModelEma | None,
    cfg: TrainConfig,
    epoch: int,
    step: int,
    best: float | None,
    meta: dict[str, str],
    out: Path,
    is_best: bool,
    d: Dist,
    history: list[dict[str, Any]],
) -> None:
    """Atomic checkpoints by rank 0; every rank's RNG state is gathered so resume is exact."""
    rng = build_train_state(rng=True)["rng"]
    rngs = [None] * d.world_size
    if d.world_size > 1:
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if not d.main:
        return
    state = build_train_state(
        optimizer=optimizer, scaler=scaler, ema=ema, epoch=epoch, global_step=step,
        best_metric=best, config=config_to_dict(cfg), rng=True,
        extra={"rng_per_rank": rngs, "history": history},
    )  # fmt: skip
    weights = state_dict_to_cpu(model.state_dict())
    save_checkpoint(out / "last", weights, state, metadata=meta)
    if is_best:
        save_checkpoint(out / "best", weights, state, metadata=meta)
    if ema is not None:  # the EMA weights on their own: `lgvit eval --checkpoint <out>/last_ema`
        atomic_save_safetensors(state_dict_to_cpu(ema.shadow), out / "last_ema.safetensors", meta)


def _fault_injection(epoch: int) -> None:
    """Test hook: LGVIT_KILL_AFTER_EPOCH=k SIGKILLs the process once epoch k is checkpointed."""
    k = os.environ.get("LGVIT_KILL_AFTER_EPOCH")
    if k is not None and int(k) == epoch:
        os.kill(os.getpid(), signal.SIGKILL)
