"""The training loop: the DeiT recipe of the papers, on one CPU, one GPU or many (torchrun).

Read top to bottom: set-up (processes, data, model, optimizer), the per-step schedule, one epoch of
training, evaluation, checkpoints, and ``train()`` tying them together.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import signal
import time
import warnings
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
    TTA_MODES,
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
from lgvit.models import create_model, get_model_config, is_model, list_models
from lgvit.progress import RunClock, StepProgress, format_duration, on_terminal
from lgvit.rundir import RunLock, remove_stale_temps
from lgvit.runtime import autocast, resolve_amp

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


def setup_distributed(device_name: str = "auto") -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: gloo on CPU, nccl on CUDA. ``device_name``:
    ``auto`` (CUDA when there is one), ``cpu`` or ``cuda`` (each process its local GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_name == "auto" else device_name == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise LgvitError("--device cuda: no CUDA device is available here (use --device cpu)")
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
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


# --------------------------------------------------------------------------------- schedule


def lr_at(
    step: int,
    total_steps: int,
    warmup_steps: int,
    cfg: TrainConfig,
    base_lr: float,
    steps_per_epoch: int = 1,
) -> float:
    """Linear warm-up from warmup_lr, then (``sched``) per-step cosine decay from base_lr to
    min_lr, a per-step linear decay from base_lr to min_lr, a step decay by ``decay_rate``
    every ``decay_epochs``, or a constant base_lr."""
    if step < warmup_steps:
        return cfg.warmup_lr + (base_lr - cfg.warmup_lr) * step / warmup_steps
    if cfg.sched == "none":
        return base_lr
    if cfg.sched == "step":
        epochs = step / max(steps_per_epoch, 1)
        return max(base_lr * cfg.decay_rate ** math.floor(epochs / cfg.decay_epochs), cfg.min_lr)
    t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if cfg.sched == "linear":
        return cfg.min_lr + (base_lr - cfg.min_lr) * (1.0 - min(t, 1.0))
    return cfg.min_lr + 0.5 * (base_lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


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


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020): Adam's update with decoupled weight decay, scaled per tensor by
    the trust ratio ``||w|| / ||update||`` (1 where either norm is zero), as timm's ``lamb``."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["m"] / (1 - b1 ** st["step"])
                v_hat = st["v"] / (1 - b2 ** st["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.add_(update * trust, alpha=-group["lr"])
        return None


def build_optimizer(
    cfg: TrainConfig, groups: list[dict[str, Any]], lr: float, device: torch.device
) -> torch.optim.Optimizer:
    """``opt``: AdamW (the papers'), SGD with Nesterov momentum, or LAMB."""
    if cfg.opt == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=True)
    if cfg.opt == "lamb":
        return Lamb(groups, lr=lr, betas=tuple(cfg.opt_betas), eps=cfg.opt_eps)
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.opt_betas), eps=cfg.opt_eps, **fused)


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
        probe = torch.zeros(1, getattr(model, "in_chans", 3), size, size)
        try:
            with torch.no_grad():
                model.eval()(probe)
        except (ValueError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LgvitError(f"model {cfg.model} cannot run at {what}: {first}") from None
    model.train()
    return model, img_size


def load_initial_weights(model: nn.Module, path: str) -> str:
    """Fine-tuning start: weights only from ``path`` (an lgvit checkpoint, ``.safetensors`` or
    ``.pth``); a classifier of another class count is dropped (the new head stays freshly
    initialised), position embeddings of another grid are resized by the model's load hooks.
    Anything else that does not fit is a one-line error. Returns a line for the log."""
    from lgvit.checkpoint import load_weights

    sd = load_weights(path)
    if hasattr(model, "checkpoint_filter_fn"):
        sd = model.checkpoint_filter_fn(sd)
    own = model.state_dict()
    head = getattr(model, "pretrained_cfg", {}).get("classifier", "head")
    dropped = [
        k for k in sd if k.startswith(head + ".") and k in own and sd[k].shape != own[k].shape
    ]
    for k in dropped:
        del sd[k]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in dropped]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise LgvitError(f"--initial-checkpoint {path} does not fit {model.model_name}: {what}")
    note = f" (its {head} for another class count dropped)" if dropped else ""
    return f"started from the weights of {path}{note}"


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


# --------------------------------------------------------------------------------- training


class NonFiniteLoss(LgvitError):
    pass


class Preempted(LgvitError):
    """Training stopped by SIGTERM/SIGINT after saving; ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class RunControl:
    """What may interrupt an epoch: SIGTERM/SIGINT (finish the step, save, stop) and the
    periodic mid-epoch checkpoint (``save_every_steps`` / ``save_every_min``)."""

    def __init__(self, cfg: TrainConfig, d: Dist) -> None:
        self.cfg, self.d = cfg, d
        self.signum: int | None = None
        self.last_save = time.perf_counter()
        self._old: dict[int, Any] = {}
        self.test_signals = [
            (sig, int(os.environ[f"LGVIT_{sig.name}_AT_STEP"]))
            for sig in (signal.SIGTERM, signal.SIGINT)
            if os.environ.get(f"LGVIT_{sig.name}_AT_STEP")
        ]

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def due(self, batch: int, last_batch: bool, step: int = -1) -> tuple[bool, bool]:
        """``(save now, then stop)`` after ``batch`` steps of the epoch (same on every rank)."""
        cfg = self.cfg
        for sig, at in self.test_signals:  # test hook: a preemption at a known step
            if step == at:
                os.kill(os.getpid(), sig)
        minutes = (time.perf_counter() - self.last_save) / 60
        periodic = not last_batch and (
            (cfg.save_every_steps and batch % cfg.save_every_steps == 0)
            or (cfg.save_every_min and minutes > cfg.save_every_min)
        )
        stop, periodic = bool(self.signum), bool(periodic)
        if self.d.world_size > 1:  # every rank must stop (and save) at the same step
            if batch % AGREE_EVERY and not last_batch:
                # Agreeing reads an all-reduce on the host (a GPU sync): only every few steps.
                # A step-count save is the same on every rank without it.
                steps_due = bool(cfg.save_every_steps and batch % cfg.save_every_steps == 0)
                return steps_due, False
            flags = torch.tensor([float(stop), float(periodic)], device=self.d.device)
            flags = all_reduce_sum(flags, self.d).cpu()
            stop, periodic = bool(flags[0]), bool(flags[1])
            if stop and not self.signum:
                self.signum = signal.SIGTERM
        return stop or periodic, stop


AGREE_EVERY = 8  # multi-process runs agree on a signal or a timed save every this many steps


@dataclass
class EpochProgress:
    """Where an epoch stands: batches done, loss sum, images seen (saved mid-epoch)."""

    batch: int = 0
    loss_sum: float = 0.0
    images: int = 0


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
    ctl: RunControl | None = None,
    save_mid_epoch: Any = None,
    start: EpochProgress | None = None,
) -> tuple[float, int, int]:
    """One pass over the training split (from ``start.batch`` when resuming mid-epoch);
    returns (mean loss, images seen, global step).

    Progress: a bar on a terminal (rank 0), else a plain line every ``cfg.log_every`` steps
    (lines go to ``train.log`` either way). After each step ``ctl`` may ask for a mid-epoch
    checkpoint (``save_mid_epoch(progress, step)``) and, on SIGTERM/SIGINT, to stop.

    On a GPU no step waits for the host: the loss is summed on the device and read only for a
    progress refresh or a log line; a non-finite loss skips the fused AdamW step on the device
    (the count is checked at log lines and at the epoch's end; such a step still advances the
    schedule and moves the EMA toward the unchanged weights); multi-process runs agree on
    signals every ``AGREE_EVERY`` steps. So the host prepares batch n+1 while step n runs.

    Progressive resizing: each batch is downscaled (bilinear, antialiased) to
    :func:`train_size_at` for this epoch after its augmentation."""
    model.train()
    start = start or EpochProgress()
    # Summed on the device: reading a GPU loss every step would make the host wait for it.
    sum_dtype = torch.float32 if d.device.type == "mps" else torch.float64
    loss_sum = torch.tensor(start.loss_sum, dtype=sum_dtype, device=d.device)
    images = start.images
    nonfinite = 0
    skip_on_device = skips_on_device(optimizer, scaler, d.device)
    nonfinite_dev = torch.zeros((), dtype=torch.int64, device=d.device)
    bar = d.main and on_terminal()
    progress = StepProgress(len(loader) - start.batch, f"epoch {epoch + 1}/{cfg.epochs}", bar)
    for i, (x, y) in enumerate(loader, start=start.batch):
        lr = lr_at(step, **schedule)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        x, y = x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True)
        size = train_size_at(epoch, cfg, x.shape[-1])
        if size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
        with autocast(d.device, amp):
            logits = model(x)
        logits = logits.float()
        if y.ndim == 2:  # soft targets from mixup/cutmix/label smoothing
            loss = soft_target_cross_entropy(logits, y)
        else:
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        if skip_on_device:
            # The fused step reads `found_inf` in its kernel and leaves the weights and its
            # state alone when it is set, as under a GradScaler; the host checks the count
            # only at log lines and the epoch's end.
            bad = ~torch.isfinite(loss)
            optimizer.found_inf = bad.float()
            nonfinite_dev += bad
        elif not torch.isfinite(loss):
            nonfinite += 1
            where = f"loss is {loss.item()} at epoch {epoch + 1} step {i + 1}"
            if nonfinite > cfg.max_nonfinite:
                _stop_nonfinite(cfg, where)
            warnings.warn(f"{where}: skipped", stacklevel=2)
            continue
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
        if skip_on_device:
            del optimizer.found_inf
            loss_sum += torch.where(bad, 0.0, loss.detach()).to(sum_dtype)
        else:
            loss_sum += loss.detach().to(sum_dtype)
        if ema is not None:
            ema.update(unwrap(model))
        images += len(x)
        step += 1
        if progress.wants_postfix():  # figures (and the loss's device sync) twice a second
            run_eta = format_duration((clock.eta(step) if clock else None) or 0)
            progress.update(len(x) * d.world_size, loss=f"{loss.item():.4f}", lr=f"{lr:.3g}",
                            run_ETA=run_eta)  # fmt: skip
        else:
            progress.update(len(x) * d.world_size)
        if cfg.log_every and (i + 1) % cfg.log_every == 0:
            if skip_on_device and int(nonfinite_dev) > cfg.max_nonfinite:
                where = f"by epoch {epoch + 1} step {i + 1}"
                _stop_nonfinite(cfg, f"{int(nonfinite_dev)} non-finite losses {where}")
            run_eta = clock.eta(step) if clock else None
            eta = f", run ETA {format_duration(run_eta)}" if run_eta is not None else ""
            line = (
                f"epoch {epoch + 1} step {i + 1}/{len(loader)} loss {loss.item():.4f} lr {lr:.3g}, "
                f"{progress.img_per_s:.0f} img/s, epoch ETA {format_duration(progress.eta())}{eta}"
            )
            log(line, console=not bar)
        if ctl is not None and save_mid_epoch is not None:
            save, stop = ctl.due(i + 1, i + 1 == len(loader), step)
            if save:
                progress.close()
                save_mid_epoch(EpochProgress(i + 1, float(loss_sum), images), step)
                ctl.last_save = time.perf_counter()
            if stop:
                raise Preempted(
                    f"stopped by {signal.Signals(ctl.signum).name} at epoch {epoch + 1} step "
                    f"{i + 1}/{len(loader)}; saved {Path(cfg.out) / 'last'}. Continue with: "
                    f"lgvit train --out {cfg.out} --resume auto",
                    ctl.signum or signal.SIGTERM,
                )
    progress.close()
    if skip_on_device and int(nonfinite_dev) > cfg.max_nonfinite:
        _stop_nonfinite(cfg, f"{int(nonfinite_dev)} non-finite losses in epoch {epoch + 1}")
    steps = torch.tensor(float(len(loader)), dtype=sum_dtype, device=d.device)
    stats = torch.stack([loss_sum, steps])
    stats = all_reduce_sum(stats, d)
    mean_loss = (stats[0] / stats[1].clamp(min=1)).item()
    return mean_loss, images * d.world_size, step


def skips_on_device(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, device: torch.device
) -> bool:
    """Whether a non-finite loss skips the step on the device, with no host sync per step: on
    a GPU, for fused optimizers (AdamW here), which take ``found_inf`` as a GradScaler passes
    it. Elsewhere the host checks each loss (on a CPU that costs nothing)."""
    return (
        device.type == "cuda"
        and scaler is None
        and getattr(optimizer, "_step_supports_amp_scaling", False)
    )


def _stop_nonfinite(cfg: TrainConfig, what: str) -> None:
    kept = (
        f"the last good checkpoint is kept in {cfg.out}"
        if checkpoint_paths(Path(cfg.out) / "last")[0].exists()
        else "no checkpoint had been saved yet"
    )
    raise NonFiniteLoss(f"{what}; stopping. {kept} (lower --set lr=... or try --amp none)")


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


# Keys that define what a run trains: a resume may not change them.
_RUN_IDENTITY = ("model", "data", "img_size", "patch_size", "window_size", "num_classes")


def _check_resume(saved: TrainConfig, cfg: TrainConfig, explicit: Any, stem: Path) -> None:
    """A resume that would change the model, the data or the input size: one line, nothing
    written (the checkpoint's shapes would not fit, or the run would silently change)."""
    for key in _RUN_IDENTITY:
        if key in explicit and getattr(cfg, key) != getattr(saved, key):
            was, now = getattr(saved, key), getattr(cfg, key)
            raise LgvitError(
                f"--resume {stem}: the run trained with {key}={was!r}, not {now!r}; continue "
                f"it without changing {key}, or start a new run (another --out) from its "
                f"weights with --initial-checkpoint {stem}"
            )


def train(cfg: TrainConfig, explicit: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """Run (or resume) a training run as configured; returns the last epoch's metrics.

    When resuming, the run's saved config is used; only ``out``, ``resume`` and the keys named
    in ``explicit`` (what this invocation set: flags, ``--set``, the YAML file) override it.
    The run directory is locked for the run's duration (:mod:`lgvit.rundir`).
    """
    d = setup_distributed(cfg.device)
    out = Path(cfg.out)
    lock = RunLock(out)
    created = not out.exists()
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    ctl = RunControl(cfg, d)
    try:
        barrier(d)
        ctl.install()
        return _train(cfg, explicit, d, out, lock, ctl)
    finally:
        ctl.restore()
        lock.release()
        if created and d.main and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a refused start leaves no trace


def _train(
    cfg: TrainConfig,
    explicit: Any,
    d: Dist,
    out: Path,
    lock: RunLock,
    ctl: RunControl,
) -> dict[str, Any]:
    log = RunLog(out, d.main)
    resume_stem = _find_resume(cfg)
    if resume_stem is None and checkpoint_paths(out / "last")[0].exists():
        raise LgvitError(
            f"{out} already holds a run; pass --resume auto to continue it, or another --out"
        )
    state: dict[str, Any] | None = None
    weights: dict[str, torch.Tensor] | None = None
    if resume_stem is not None:
        weights, state = load_checkpoint_pair(resume_stem, repair=d.main)
        saved = config_from_dict(state["config"], source=f"{resume_stem}")
        _check_resume(saved, cfg, explicit, resume_stem)
        now = config_to_dict(cfg)
        keep = {k: now[k] for k in {"out", "resume", *explicit} - {"initial_checkpoint"}}
        cfg = config_from_dict({**config_to_dict(saved), **keep}, source="resume")
        ctl.cfg = cfg
    if d.main:
        if lock.note:
            log(f"{out}: {lock.note}", console=True)
        stale = remove_stale_temps(out)
        if stale:
            log(f"removed {len(stale)} temp file(s) of interrupted saves: {', '.join(stale[:3])}")
    seed_everything(cfg.seed + d.rank)

    model, img_size = build_model(cfg, num_classes=cfg.num_classes or 1)
    splits = build_data(cfg, img_size, d)
    num_classes = cfg.num_classes or len(splits.train.classes)
    if num_classes != model.num_classes:
        model.reset_classifier(num_classes)
    if weights is not None:
        model.load_state_dict(weights)
    elif cfg.initial_checkpoint:
        log(load_initial_weights(model, cfg.initial_checkpoint))
    model.to(d.device)
    amp = resolve_amp(cfg.amp, d.device)
    world = d.world_size
    global_batch = cfg.batch_size * world
    if d.main:  # written once the run is known to start: a refused start changes nothing
        if resume_stem is None:  # a fresh run: no stale lines from a run that never saved
            for name in ("metrics.jsonl", "train.log"):
                (out / name).unlink(missing_ok=True)
        save_config(cfg, out / "config.yaml")
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
    groups = param_groups(model, cfg.weight_decay, cfg.offset_lr_factor)
    optimizer = build_optimizer(cfg, groups, base_lr, d.device)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema else None
    steps_per_epoch = len(train_loader)
    schedule = dict(
        total_steps=cfg.epochs * steps_per_epoch,
        warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
        cfg=cfg,
        base_lr=base_lr,
        steps_per_epoch=steps_per_epoch,
    )
    if cfg.warmup_epochs >= cfg.epochs and cfg.warmup_epochs > 0 and resume_stem is None:
        final = lr_at(schedule["total_steps"] - 1, **schedule)
        warnings.warn(
            f"warmup_epochs {cfg.warmup_epochs:g} >= epochs {cfg.epochs}: the learning rate "
            f"rises for the whole run and ends at {final:.3g}, below its peak {base_lr:.3g} "
            "(lower --set warmup_epochs=...)",
            stacklevel=2,
        )
    start_epoch, step, best = 0, 0, None
    resume_in_epoch: EpochProgress | None = None
    history: list[dict[str, Any]] = []  # metrics.jsonl, also kept in every checkpoint
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema"):
            ema.shadow = {k: v.to(d.device) for k, v in state["ema"].items()}
        start_epoch, step, best = state["epoch"] + 1, state["global_step"], state["best_metric"]
        extra = state.get("extra", {})
        rngs = extra.get("rng_per_rank") or []
        if len(rngs) == world:  # same process count: continue every rank's random stream
            restore_rng_state(rngs[d.rank])
        history = list(extra.get("history", []))
        mid = extra.get("mid_epoch")
        if mid is not None:  # saved inside an epoch: continue that epoch at the next batch
            start_epoch = state["epoch"]
            resume_in_epoch = EpochProgress(mid["batch"], mid["loss_sum"], mid["images"])
            aug_states = mid.get("aug_rng_per_rank") or []
            train_loader.set_epoch(
                start_epoch, mid["batch"], aug_states[d.rank] if len(aug_states) == world else None
            )
        if d.main:  # metrics.jsonl as of the checkpoint: no lost or doubled epochs
            atomic_write_bytes(
                out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history).encode()
            )
        where = (
            f"at epoch {start_epoch + 1} step {resume_in_epoch.batch}/{steps_per_epoch}"
            if resume_in_epoch
            else f"after epoch {state['epoch'] + 1}"
        )
        log(f"resumed from {resume_stem} {where}")

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
    # Progressive resizing's small epochs are cheaper: cost ~ (size ratio)^1.5, between the
    # MLPs' linear and attention's quadratic growth in tokens. Measured: lsa_micro_cifar's 16px
    # and 24px epochs (with evaluation) took 0.34 and 0.63 of a 32px one; ^1.5 gives 0.35, 0.65.
    clock = RunClock(
        cfg.epochs * steps_per_epoch, step, steps_per_epoch,
        lambda e: (train_size_at(e, cfg, img_size) / img_size) ** 1.5,
    )  # fmt: skip

    def save(epoch: int, step: int, is_best: bool, mid: EpochProgress | None = None) -> None:
        extra: dict[str, Any] = {"history": history}
        if mid is not None:
            extra["mid_epoch"] = {
                "batch": mid.batch, "loss_sum": mid.loss_sum, "images": mid.images,
                "aug_rng": train_loader.aug_state(),
            }  # fmt: skip
        try:
            _save(model, optimizer, scaler, ema, cfg, epoch, step, best, meta, out, is_best, d,
                  extra)  # fmt: skip
        except LgvitError:
            raise
        except Exception as e:  # noqa: BLE001 -- disk full, permissions, a vanished directory
            cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise LgvitError(
                f"saving the checkpoint to {out} failed: {cause}; the previous checkpoint "
                "there is kept and still loads"
            ) from None

    for epoch in range(start_epoch, cfg.epochs):
        if resume_in_epoch is None:
            train_loader.set_epoch(epoch)
        t0 = time.time()

        def save_mid_epoch(progress: EpochProgress, step: int, epoch: int = epoch) -> None:
            save(epoch, step, False, progress)
            log(f"saved a mid-epoch checkpoint at epoch {epoch + 1} step {progress.batch}")

        done_before = resume_in_epoch.images if resume_in_epoch else 0
        train_loss, seen, step = train_one_epoch(
            net, train_loader, optimizer, scaler, ema, cfg, d, amp, step, schedule, epoch, log,
            clock, ctl, save_mid_epoch, resume_in_epoch,
        )  # fmt: skip
        resume_in_epoch = None
        train_time = time.time() - t0
        last = epoch + 1 == cfg.epochs
        metrics = {
            "epoch": epoch,
            "train_loss": round(train_loss, 6),
            "lr": optimizer.param_groups[0]["lr"],
            "img_per_s": round((seen - done_before * world) / train_time, 2),
        }
        if cfg.train_size_start:
            metrics["train_size"] = train_size_at(epoch, cfg, img_size)
        evaluated = last or (epoch + 1) % cfg.eval_every == 0
        is_best = False
        if evaluated:
            ev = evaluate(net, test_loader, num_classes, d, amp, tta=cfg.eval_tta)
            if ema is not None:
                ev_model = _ema_model(model, ema)
                ema_ev = evaluate(
                    ev_model, test_loader, num_classes, d, amp, "eval EMA", cfg.eval_tta
                )
                metrics["test_ema_acc1"] = round(ema_ev["acc1"], 4)
            metrics.update(
                test_acc1=round(ev["acc1"], 4), test_acc5=round(ev["acc5"], 4),
                test_loss=round(ev["loss"], 6),
            )  # fmt: skip
            is_best = best is None or ev["acc1"] > best
            best = ev["acc1"] if is_best else best
        metrics["epoch_time_s"] = round(time.time() - t0, 3)
        history.append(metrics)
        if d.main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
        timed_out = bool(cfg.time_limit_min and (time.time() - t_start) / 60 > cfg.time_limit_min)
        if last or timed_out or ctl.signum or (epoch + 1) % cfg.save_every == 0 or is_best:
            save(epoch, step, is_best)
            ctl.last_save = time.perf_counter()
        tested = (
            f", test top-1 {metrics['test_acc1']:.2f}% top-5 {metrics['test_acc5']:.2f}%"
            if evaluated
            else ""
        )
        if "test_ema_acc1" in metrics:
            tested += f" (EMA top-1 {metrics['test_ema_acc1']:.2f}%)"
        eta = f", run ETA {format_duration(clock.eta(step) or 0)}" if not last else ""
        at_size = f" at {metrics['train_size']}px" if "train_size" in metrics else ""
        log(
            f"epoch {epoch + 1}/{cfg.epochs}{at_size}: train loss {train_loss:.4f}{tested}, "
            f"{metrics['img_per_s']:.0f} img/s, {metrics['epoch_time_s']:.1f}s{eta}"
        )
        _fault_injection(epoch)
        if ctl.signum:
            raise Preempted(
                f"stopped by {signal.Signals(ctl.signum).name} after epoch {epoch + 1}; saved "
                f"{out / 'last'}. Continue with: lgvit train --out {out} --resume auto",
                ctl.signum,
            )
        if timed_out:
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
    extra: dict[str, Any],
) -> None:
    """Atomic checkpoints by rank 0; every rank's RNG state (and, mid-epoch, augmentation
    stream) is gathered so resume is exact."""
    rng = build_train_state(rng=True)["rng"]
    aug = extra.get("mid_epoch", {}).pop("aug_rng", None)
    rngs: list[Any] = [None] * d.world_size
    augs: list[Any] = [None] * d.world_size
    if d.world_size > 1:
        dist.all_gather_object(rngs, rng)
        dist.all_gather_object(augs, aug)
    else:
        rngs, augs = [rng], [aug]
    if not d.main:
        return
    if "mid_epoch" in extra:
        extra["mid_epoch"]["aug_rng_per_rank"] = augs
    state = build_train_state(
        optimizer=optimizer, scaler=scaler, ema=ema, epoch=epoch, global_step=step,
        best_metric=best, config=config_to_dict(cfg), rng=True,
        extra={"rng_per_rank": rngs, **extra},
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
