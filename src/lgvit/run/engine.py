"""The run, for any task: run directory and lock, resume, the epoch loop, mid-epoch saves and
preemption, DDP, progress, logs and checkpoints. What is trained comes from a :class:`Task`.

A task (one of :mod:`lgvit.tasks`: ``tasks/<name>/train.py``) brings what is its own: the
model and data (:meth:`Task.prepare`; its loaders keep :mod:`lgvit.data.protocol`'s
contract), the loss of a batch, an evaluation and the config keys a resume may not change.
Everything else lives here once.

Read top to bottom: the task interface, what may interrupt an epoch, one epoch, the run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from lgvit.checkpoints.files import (
    build_train_state,
    check_same_classes,
    restore_rng_state,
    save_checkpoint,
    save_error,
    state_dict_to_cpu,
)
from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.atomic import atomic_save_safetensors, atomic_write_bytes
from lgvit.core.errors import LgvitError
from lgvit.core.progress import RunClock, StepProgress, format_duration, on_terminal
from lgvit.core.runtime import (
    Dist,
    all_reduce_sum,
    barrier,
    resolve_amp,
    restore_numerics,
    seed_everything,
    set_numerics,
)
from lgvit.data.device_decode import cpu_decoded_in_pass
from lgvit.data.protocol import Loader, TrainLoader, check_loaders, skipped_in_pass, skipped_text
from lgvit.inference import initial_weights_file
from lgvit.models.download import random_state_kept
from lgvit.models.layers.attention import fuse_older_qkv
from lgvit.models.loading import load_initial_weights
from lgvit.run.compiled import compile_net
from lgvit.run.config import TrainConfig, config_to_dict, save_config, scaled_lr
from lgvit.run.kept import keep_epoch, kept_score
from lgvit.run.loggers import RunLoggers, check_loggers, epoch_scalars
from lgvit.run.nonfinite import NonFiniteGuard
from lgvit.run.nonfinite import NonFiniteLoss as NonFiniteLoss  # where callers import it
from lgvit.run.optim import (
    ModelEma,
    build_optimizer,
    fit_older_optimizer_state,
    lr_at,
    steps_per_epoch,
    total_steps,
    warmup_steps,
    warn_long_warmup,
)
from lgvit.run.preempt import RunControl
from lgvit.run.rundir import Resumed, RunLock, RunLog, global_batch_text, remove_stale_temps
from lgvit.run.startup import (
    EPOCH_STEPS,
    TRAIN_IMAGES,
    check_accum_window,
    resume_notes,
    resumed_config,
)

# --------------------------------------------------------------------------------- the task


@dataclass
class Prepared:
    """What a task builds before training: the model (on the CPU), the loaders, the metadata
    every checkpoint carries, and the run's description for the log."""

    model: nn.Module
    train_loader: TrainLoader  # set_epoch and aug_state: a mid-epoch resume continues exactly
    test_loader: Loader
    metadata: dict[str, str]
    description: str
    notes: list[str] = field(default_factory=list)  # extra log lines (e.g. skipped images)
    train_images: int | None = None  # the training split's size (a resume compares it)


class Task(Protocol):
    """What one kind of training brings to the shared run."""

    identity_keys: tuple[str, ...]  # config keys a resume may not change
    best_metric: str  # key of evaluate()'s result; the best checkpoint maximises it

    def prepare(self, cfg: TrainConfig, d: Dist) -> Prepared: ...

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]: ...

    def loss(
        self, model: nn.Module, batch: Any, epoch: int, d: Dist, amp: Any
    ) -> tuple[torch.Tensor, int]:
        """The batch's loss (a float32 scalar) and its number of samples; the batch is moved to
        the device here."""
        ...

    def evaluate(
        self, model: nn.Module, loader: Loader, d: Dist, amp: Any, desc: str
    ) -> dict[str, float]: ...

    def summary(self, result: dict[str, float]) -> str:
        """The evaluation's part of an epoch's log line."""
        ...

    def epoch_info(self, epoch: int) -> dict[str, Any]:
        """Extra per-epoch metrics (``train_size``: the epoch's input size)."""
        ...

    def epoch_cost(self, epoch: int) -> float:
        """The relative cost of the epoch's steps (for the run's ETA)."""
        ...


# --------------------------------------------------------------------------------- interruptions


def unwrap(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(model, "module", model)  # DDP


# --------------------------------------------------------------------------------- one epoch


@dataclass
class EpochProgress:
    """Where an epoch stands: batches done, loss sum, images seen (saved mid-epoch)."""

    batch: int = 0
    loss_sum: float = 0.0
    images: int = 0


@dataclass
class Optimisation:
    """The optimizer and what steps with it: the scaler (fp16), the EMA, the lr schedule."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    ema: ModelEma | None
    schedule: dict[str, Any]

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, **self.schedule)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        return lr

    def backward(self, loss: torch.Tensor, micro_batches: int = 1) -> None:
        """Add a micro-batch's gradients: its mean loss / the window's micro-batches, so the
        window's sum is the mean over its samples (each loss scaled under fp16's scaler)."""
        loss = loss / micro_batches if micro_batches > 1 else loss
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(
        self, model: nn.Module, loss: torch.Tensor | None, clip_grad: float | None,
        skip: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """The optimizer step on the accumulated gradients (``loss``: its backward first, a
        window of one), unscaled once and clipped; the EMA follows the updated weights
        (``skip``: a device flag, set when the step is skipped on the device, which the EMA
        skips too)."""
        scaler = self.scaler
        if loss is not None:
            self.backward(loss)
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update(unwrap(model), skip)


def _sync(net: nn.Module, last: bool) -> Any:
    """DDP all-reduces the gradients in the backward of a window's last micro-batch only (the
    forward must be inside ``no_sync`` too)."""
    ddp = getattr(net, "_orig_mod", net)  # torch.compile
    return contextlib.nullcontext() if last or not hasattr(ddp, "no_sync") else ddp.no_sync()


def train_one_epoch(
    run: Run, epoch: int, step: int, start: EpochProgress | None = None
) -> tuple[float, int, int]:
    """One pass over the training split (from ``start.batch`` when resuming mid-epoch, always
    a window's start); returns (mean loss, images seen, global step). A step is an optimizer
    step: ``grad_accum_steps`` micro-batches (batches of the loader) each.

    Progress: a bar on a terminal (rank 0), else a plain line every ``cfg.log_every`` steps
    (lines go to ``train.log`` either way). After each step the run may save a mid-epoch
    checkpoint and, on SIGTERM/SIGINT, stop. On a GPU no step waits for the host: the loss is
    summed on the device and read only for a progress refresh or a log line; multi-process runs
    agree on signals every ``AGREE_EVERY`` steps, so the host prepares batch n+1 while step n
    runs."""
    cfg, d, loader = run.cfg, run.d, run.prepared.train_loader
    run.net.train()
    start = start or EpochProgress()
    # Summed on the device: reading a GPU loss every step would make the host wait for it.
    sum_dtype = torch.float32 if d.device.type == "mps" else torch.float64
    loss_sum = torch.tensor(start.loss_sum, dtype=sum_dtype, device=d.device)
    images = start.images
    nonfinite = NonFiniteGuard(run.opt.optimizer, run.opt.scaler, cfg, d.device, d.world_size > 1)
    bar = d.main and on_terminal()
    budget = run.opt.schedule["total_steps"]  # an iteration budget may end inside the epoch
    accum, spe = cfg.grad_accum_steps, run.steps_per_epoch
    progress = StepProgress(min(spe - start.batch // accum, budget - step),
                            f"epoch {epoch + 1}/{run.epochs}", bar)  # fmt: skip
    batches, window = start.batch, (0.0, 0)  # the window's summed loss and images
    for i, batch in enumerate(loader, start=start.batch):
        if step >= budget:
            break
        batches += 1
        first, last = i % accum == 0, (i + 1) % accum == 0 or i + 1 == len(loader)
        if first:
            lr, window = run.opt.set_lr(step), (0.0, 0)
        with _sync(run.net, last):
            loss, n = run.task.loss(run.net, batch, epoch, d, run.amp)
            if nonfinite.before_step(loss, epoch, i // accum, first, last):
                continue
            size = min(accum, len(loader) - i // accum * accum)  # a last window may be short
            run.opt.backward(nonfinite.backward_loss(loss), size)
        if last:
            run.opt.step(run.net, None, cfg.clip_grad, nonfinite.bad)
        loss_sum += nonfinite.finite_part(loss).to(sum_dtype)
        images += n
        window = (window[0] + loss.detach(), window[1] + n)
        if not last:
            continue
        step, done = step + 1, -(-(i + 1) // accum)  # done: the epoch's steps so far
        _report_step(run, progress, window[0] / size, lr, window[1], step, epoch, done, bar,
                     nonfinite)  # fmt: skip
        save, stop = run.ctl.due(done, i + 1 == len(loader) or step == budget, step)
        if save:
            progress.close()
            run.save(epoch, step, False, EpochProgress(i + 1, float(loss_sum), images))
            run.log(f"saved a mid-epoch checkpoint at epoch {epoch + 1} step {done}")
            run.ctl.last_save = time.perf_counter()
        if stop:
            raise run.ctl.preempted(f"at epoch {epoch + 1} step {done}/{spe}", cfg.out)
    progress.close()
    nonfinite.check(f"in epoch {epoch + 1}")
    steps = torch.tensor(float(batches), dtype=sum_dtype, device=d.device)
    stats = all_reduce_sum(torch.stack([loss_sum, steps]), d)
    mean_loss = (stats[0] / stats[1].clamp(min=1)).item()
    return mean_loss, images * d.world_size, step


def _report_step(
    run: Run, progress: StepProgress, loss: torch.Tensor, lr: float, n: int, step: int,
    epoch: int, done: int, bar: bool, nonfinite: NonFiniteGuard,
) -> None:  # fmt: skip
    """The progress bar (figures twice a second), and a log line every ``log_every`` steps
    (``done``: the epoch's steps so far)."""
    cfg, world = run.cfg, run.d.world_size
    if progress.wants_postfix():  # the loss's device sync only when figures are shown
        run_eta = format_duration(run.clock.eta(step) or 0)
        progress.update(n * world, loss=f"{loss.item():.4f}", lr=f"{lr:.3g}", run_ETA=run_eta)
    else:
        progress.update(n * world)
    if not cfg.log_every or done % cfg.log_every:
        return
    nonfinite.check(f"by epoch {epoch + 1} step {done}")
    run_eta = run.clock.eta(step)
    eta = f", run ETA {format_duration(run_eta)}" if run_eta is not None else ""
    run.loggers.scalars(step, {"train/step_loss": loss.item(), "train/lr": lr,
                               "train/img_per_s": progress.img_per_s})  # fmt: skip
    run.log(
        f"epoch {epoch + 1} step {done}/{run.steps_per_epoch} loss {loss.item():.4f} lr {lr:.3g}, "
        f"{progress.img_per_s:.0f} img/s, epoch ETA {format_duration(progress.eta())}{eta}",
        console=not bar,
    )


# --------------------------------------------------------------------------------- the run


@dataclass
class Run:
    """One training run's live state; :func:`run` builds it, the loop advances it."""

    cfg: TrainConfig
    task: Task
    d: Dist
    out: Path
    log: RunLog
    ctl: RunControl
    prepared: Prepared
    amp: Any
    opt: Optimisation
    net: nn.Module
    clock: RunClock
    loggers: RunLoggers = field(default_factory=lambda: RunLoggers((), Path(), False, {}, ""))
    history: list[dict[str, Any]] = field(default_factory=list)
    best: float | None = None
    last_metrics: dict[str, Any] = field(default_factory=dict)
    origin: tuple[int, int] = (0, 0)  # (epoch, its first step) the budget's epochs count from

    @property
    def model(self) -> nn.Module:
        return self.prepared.model

    @property
    def steps_per_epoch(self) -> int:  # optimizer steps
        return steps_per_epoch(self.cfg, len(self.prepared.train_loader))

    @property
    def epochs(self) -> int:
        """``epochs``, or the epochs an iteration budget takes (counted from where a resume
        starts: its data may have another size than the checkpoint's)."""
        if not self.cfg.iters:
            return self.cfg.epochs
        epoch, step = self.origin
        return epoch + -(-max(self.cfg.iters - step, 0) // self.steps_per_epoch)

    def save(
        self, epoch: int, step: int, is_best: bool, mid: EpochProgress | None = None,
        pending: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Atomic checkpoints by rank 0 (``last``, and ``best``); every rank's RNG state (and,
        mid-epoch, augmentation stream) is gathered so resume is exact. A failed write is one
        line (:func:`~lgvit.checkpoints.files.save_error`), and the previous checkpoint stays.
        ``pending``: the epoch's training metrics, saved before its evaluation."""
        extra: dict[str, Any] = {"history": self.history}
        if mid is not None:
            extra["mid_epoch"] = {"batch": mid.batch, "loss_sum": mid.loss_sum,
                                  "images": mid.images}  # fmt: skip
        if pending is not None:
            extra["pending_eval"] = pending
        try:
            self._write(epoch, step, is_best, extra)
        except LgvitError:
            raise
        except Exception as e:  # noqa: BLE001 -- disk full, permissions, a vanished directory
            raise save_error(self.out, e) from None

    def _write(self, epoch: int, step: int, is_best: bool, extra: dict[str, Any]) -> None:
        d = self.d
        rng = build_train_state(rng=True)["rng"]
        aug = self.prepared.train_loader.aug_state() if "mid_epoch" in extra else None
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
        o = self.opt
        state = build_train_state(
            optimizer=o.optimizer, scaler=o.scaler, ema=o.ema, epoch=epoch, global_step=step,
            best_metric=self.best, config=config_to_dict(self.cfg), rng=True,
            extra={"rng_per_rank": rngs, EPOCH_STEPS: self.steps_per_epoch,
                   TRAIN_IMAGES: self.prepared.train_images, **extra},
        )  # fmt: skip
        meta = self.prepared.metadata
        weights = state_dict_to_cpu(self.model.state_dict())
        save_checkpoint(RunLayout(self.out).last, weights, state, metadata=meta)
        if is_best:
            save_checkpoint(RunLayout(self.out).best, weights, state, metadata=meta)
        if o.ema is not None:  # the EMA weights alone: `lgvit eval --checkpoint <out>/last_ema`
            ema_sd = state_dict_to_cpu(o.ema.shadow)
            atomic_save_safetensors(ema_sd, RunLayout(self.out).last_ema, meta)


def run(
    cfg: TrainConfig,
    task: Task,
    explicit: set[str] | frozenset[str] = frozenset(),
    resumed: Resumed | None = None,
) -> dict[str, Any]:
    """Run (or resume) a training run of ``task`` as configured; returns the last epoch's
    metrics.

    When resuming, the run's saved config is used; only ``out``, ``resume`` and the keys named
    in ``explicit`` (what this invocation set: flags, ``--set``, the YAML file) override it.
    The run directory is locked for the run's duration (:mod:`lgvit.run.rundir`). ``resumed``:
    the checkpoint's record as the caller read it to choose the task (not read again).
    """
    from lgvit.core.runtime import setup_distributed

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
        return _run(cfg, task, explicit, d, out, lock, ctl, resumed)
    finally:
        ctl.restore()
        restore_numerics()
        lock.release()
        if created and d.main and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a refused start leaves no trace


def _optimisation(
    cfg: TrainConfig, task: Task, prepared: Prepared, d: Dist, amp: Any
) -> Optimisation:
    model, spe = prepared.model, steps_per_epoch(cfg, len(prepared.train_loader))
    base_lr = scaled_lr(cfg, d.world_size)
    optimizer = build_optimizer(cfg, task.param_groups(model, cfg), base_lr, d.device)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema else None
    schedule = dict(
        total_steps=total_steps(cfg, spe), warmup_steps=warmup_steps(cfg, spe),
        cfg=cfg, base_lr=base_lr, steps_per_epoch=spe,
    )  # fmt: skip
    return Optimisation(optimizer, scaler, ema, schedule)


@dataclass
class _Position:
    epoch: int = 0
    step: int = 0
    in_epoch: EpochProgress | None = None
    pending: dict[str, Any] | None = None  # the last epoch's metrics, its evaluation not done


def _restore(run: Run, state: dict[str, Any], stem: Path) -> _Position:
    """Optimizer, scaler, EMA, RNG streams, history and where to continue (mid-epoch too);
    ``metrics.jsonl`` rewritten as of the checkpoint (no lost or doubled epochs)."""
    o, d = run.opt, run.d
    model = run.prepared.model  # an older run's q + kv states fitted to the fused qkv
    o.optimizer.load_state_dict(fit_older_optimizer_state(state["optimizer"], o.optimizer, model))
    if o.scaler is not None and state.get("scaler"):
        o.scaler.load_state_dict(state["scaler"])
    if o.ema is not None and state.get("ema"):
        o.ema.shadow = {k: v.to(d.device) for k, v in fuse_older_qkv(model, state["ema"]).items()}
    pos = _Position(state["epoch"] + 1, state["global_step"])
    run.origin = (pos.epoch, pos.step)
    run.best = state["best_metric"]
    extra = state.get("extra", {})
    rngs = extra.get("rng_per_rank") or []
    if len(rngs) == d.world_size:  # same process count: continue every rank's random stream
        restore_rng_state(rngs[d.rank])
    run.history = list(extra.get("history", []))
    pos.pending = extra.get("pending_eval")
    mid = extra.get("mid_epoch")
    if mid is not None:  # saved inside an epoch: continue that epoch at the next batch
        pos.epoch = state["epoch"]
        pos.in_epoch = EpochProgress(mid["batch"], mid["loss_sum"], mid["images"])
        run.origin = (pos.epoch, pos.step - -(-mid["batch"] // run.cfg.grad_accum_steps))
        augs = mid.get("aug_rng_per_rank") or []
        run.prepared.train_loader.set_epoch(
            pos.epoch, mid["batch"], augs[d.rank] if len(augs) == d.world_size else None
        )
    if d.main:
        lines = "".join(json.dumps(h) + "\n" for h in run.history)
        atomic_write_bytes(RunLayout(run.out).metrics, lines.encode())
    accum = run.cfg.grad_accum_steps  # a mid-epoch checkpoint is at a window's end
    where = (
        f"at epoch {pos.epoch + 1} step {-(-pos.in_epoch.batch // accum)}/{run.steps_per_epoch}"
        if pos.in_epoch
        else f"after epoch {state['epoch'] + 1}"
    )
    run.log(f"resumed from {stem} {where}")
    return pos


def _start(
    cfg: TrainConfig, task: Task, explicit: Any, d: Dist, out: Path, lock: RunLock,
    ctl: RunControl, resumed: Resumed | None,
) -> tuple[Run, _Position]:  # fmt: skip
    """Everything before the first step: config (resumed or not), model and data, weights,
    run files, optimisation, restored state, DDP and compile."""
    log = RunLog(out, d.main)
    cfg, stem, weights, state = resumed_config(cfg, task.identity_keys, explicit, out, d.main,
                                               d.world_size)  # fmt: skip
    ctl.cfg = cfg
    set_numerics(d.device, cfg.tf32, cfg.deterministic)  # before the run's first matmul
    if d.main:
        check_loggers(cfg.log_to, out)  # refused before anything is written
    if d.main:
        if lock.note:
            log(f"{out}: {lock.note}", console=True)
        stale = remove_stale_temps(out)
        if stale:
            log(f"removed {len(stale)} temp file(s) of interrupted saves: {', '.join(stale[:3])}")
    seed_everything(cfg.seed + d.rank)
    prepared = task.prepare(cfg, d)
    check_loaders(prepared.train_loader, prepared.test_loader)  # before hours of training
    check_accum_window(cfg, len(prepared.train_loader), d.world_size, explicit)
    model, spe = prepared.model, steps_per_epoch(cfg, len(prepared.train_loader))
    notes: list[str | None] = []  # a resume rescaled, or the fine-tuning start: logged later
    if stem is not None:  # refused before anything is written, then noted once it starts
        # read before the lock was taken: used only when it is of the checkpoint resumed
        known = resumed.record if resumed is not None and resumed.stem == stem else None
        check_same_classes(stem, prepared.metadata, known)
        notes = resume_notes(state, cfg, prepared.train_images, spe, d.world_size, stem)
    if weights is not None:
        model.load_state_dict(weights)
    elif cfg.initial_checkpoint:  # a task may read other layouts (a backbone's weights)
        load = getattr(task, "load_initial", None) or load_initial_weights
        with random_state_kept():  # a download's check builds a model: none of the run's draws
            path = initial_weights_file(cfg.initial_checkpoint, cfg.model)
        notes = [load(model, path)]
    model.to(d.device)
    if cfg.channels_last:  # the convolutions' weights in NHWC (the task converts its batches)
        model.to(memory_format=torch.channels_last)
    amp = resolve_amp(cfg.amp, d.device)
    if d.main:  # written once the run is known to start: a refused start changes nothing
        if stem is None:  # a fresh run: no stale lines from a run that never saved
            for path in (RunLayout(out).metrics, RunLayout(out).log):
                path.unlink(missing_ok=True)
        save_config(cfg, RunLayout(out).config)
    log(
        f"{prepared.description}; {d.world_size} process(es) on {d.device.type}, "
        f"global batch {global_batch_text(cfg, d.world_size)}; amp {amp or 'none'}"
    )
    for note in [*prepared.notes, *(n for n in notes if n)]:
        log(note)
    opt = _optimisation(cfg, task, prepared, d, amp)
    if stem is None:
        warn_long_warmup(cfg, opt.schedule)
    net = _wrap(model, cfg, d, task, log)
    clock_start = state["global_step"] if state is not None else 0
    clock = RunClock(total_steps(cfg, spe), clock_start, spe, task.epoch_cost)
    run = Run(cfg, task, d, out, log, ctl, prepared, amp, opt, net, clock)
    run.loggers = RunLoggers(
        cfg.log_to, out, d.main, config_to_dict(cfg), RunLayout(out).config.read_text()
        if d.main else "", state["global_step"] if state is not None else None,
        cfg.wandb_project,
    )  # fmt: skip
    pos = _restore(run, state, stem) if state is not None else _Position()
    return run, pos


def _wrap(model: nn.Module, cfg: TrainConfig, d: Dist, task: Task, log: RunLog) -> nn.Module:
    """DDP, then ``torch.compile`` (:mod:`lgvit.run.compiled`: a task that counts its input
    shapes, ``compiled_graphs``, gets one static graph per shape)."""
    net: nn.Module = model
    if d.world_size > 1:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[d.device.index] if d.device.type == "cuda" else None
        )
    graphs = getattr(task, "compiled_graphs", None)
    return compile_net(net, cfg.compile, d.device, graphs() if graphs else None, log)


def _evaluate(run: Run, metrics: dict[str, Any]) -> tuple[bool, str]:
    """Test the model (and its EMA); the metrics under ``test_*``; (best so far, log text)."""
    task, d, amp, loader = run.task, run.d, run.amp, run.prepared.test_loader
    ev = task.evaluate(run.net, loader, d, amp, "eval")
    skipped = skipped_in_pass(loader, d)
    text = f"test {task.summary(ev)}"
    if skipped is not None:  # a streamed split: what was scored, and what was left out
        metrics["test_skipped"] = skipped[0]
        scored = f" of {ev['count']} images" if skipped[0] and "count" in ev else ""
        text += scored + skipped_text(skipped)
    if run.opt.ema is not None:
        ema_model = copy.deepcopy(run.model)
        ema_model.load_state_dict(run.opt.ema.shadow)
        ema_ev = task.evaluate(ema_model, loader, d, amp, "eval EMA")
        metrics[f"test_ema_{task.best_metric}"] = round(ema_ev[task.best_metric], 4)
        text += f" (EMA {task.summary({task.best_metric: ema_ev[task.best_metric]})})"
    for key, value in ev.items():
        if isinstance(value, float):
            metrics[f"test_{key}"] = round(value, 6 if key == "loss" else 4)
    score = ev[task.best_metric]
    is_best = run.best is None or score > run.best
    run.best = score if is_best else run.best
    return is_best, text


def _epoch(run: Run, epoch: int, pos: _Position, t_start: float) -> bool:
    """Train one epoch, test it when due, log and save; True when the run should stop."""
    cfg, out, ctl = run.cfg, run.out, run.ctl
    if pos.in_epoch is None:
        run.prepared.train_loader.set_epoch(epoch)
    t0 = time.time()
    done_before = pos.in_epoch.images if pos.in_epoch else 0
    train_loss, seen, pos.step = train_one_epoch(run, epoch, pos.step, pos.in_epoch)
    pos.in_epoch = None
    skipped = skipped_in_pass(run.prepared.train_loader, run.d)
    on_cpu = cpu_decoded_in_pass(run.prepared.train_loader, run.d)  # --decode-device's fallback
    train_time = time.time() - t0
    last = epoch + 1 == run.epochs
    metrics: dict[str, Any] = {
        "epoch": epoch,
        "train_loss": round(train_loss, 6),
        "lr": run.opt.optimizer.param_groups[0]["lr"],
        "img_per_s": round((seen - done_before * run.d.world_size) / train_time, 2),
        **run.task.epoch_info(epoch),
        **({"train_skipped": skipped[0]} if skipped is not None else {}),
        **({"train_cpu_decoded": on_cpu} if on_cpu is not None else {}),
    }
    evaluated = last or (epoch + 1) % cfg.eval_every == 0
    saving = last or ctl.signum or (epoch + 1) % cfg.save_every == 0
    if evaluated and saving:  # saved before it is evaluated: a failing evaluation keeps it
        run.save(epoch, pos.step, False, pending=metrics)
    is_best, tested = _evaluate(run, metrics) if evaluated else (False, "")
    metrics["epoch_time_s"] = round(time.time() - t0, 3)
    _record(run, metrics, pos.step)
    timed_out = bool(cfg.time_limit_min and (time.time() - t_start) / 60 > cfg.time_limit_min)
    if saving or timed_out or is_best:
        run.save(epoch, pos.step, is_best)
        ctl.last_save = time.perf_counter()
    eta = f", run ETA {format_duration(run.clock.eta(pos.step) or 0)}" if not last else ""
    at_size = f" at {metrics['train_size']}px" if "train_size" in metrics else ""
    tested = f", {tested}" if tested else ""
    run.log(
        f"epoch {epoch + 1}/{run.epochs}{at_size}: train loss {train_loss:.4f}"
        f"{skipped_text(skipped, ' sample(s)')}{tested}"
        f"{f', {on_cpu} decoded by PIL (not JPEG)' if on_cpu else ''}, "
        f"{metrics['img_per_s']:.0f} img/s, {metrics['epoch_time_s']:.1f}s{eta}"
    )
    run.last_metrics = metrics
    ctl.after_epoch(epoch, last, out, run.log)  # a signal stops the run, unless it is done
    if timed_out:
        run.log(f"time limit of {cfg.time_limit_min} min reached after epoch {epoch + 1}")
    return timed_out


def _record(run: Run, metrics: dict[str, Any], step: int) -> None:
    """An epoch's row: ``metrics.jsonl`` (the record), the loggers, and with ``keep_best`` the
    weights of an evaluated epoch among the best (``<out>/kept``, what ``lgvit average``
    reads)."""
    run.history.append(metrics)
    if not run.d.main:
        return
    with open(RunLayout(run.out).metrics, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    run.loggers.scalars(step, epoch_scalars(metrics))
    ranked_by, score = kept_score(metrics, run.task.best_metric)  # the EMA's, when evaluated
    if run.cfg.keep_best and score is not None:
        ema = state_dict_to_cpu(run.opt.ema.shadow) if run.opt.ema is not None else None
        weights = state_dict_to_cpu(run.model.state_dict())
        meta = run.prepared.metadata
        keep_epoch(run.out, run.cfg.keep_best, metrics["epoch"], score, weights, ema, meta,
                   ranked_by)  # fmt: skip


def _evaluate_pending(run: Run, pos: _Position) -> None:
    """Resuming a checkpoint saved before its epoch's evaluation, which never finished (it
    raised, or the run was killed): evaluate that epoch now, record and save it."""
    t0, metrics, epoch = time.time(), dict(pos.pending or {}), pos.epoch - 1
    is_best, tested = _evaluate(run, metrics)
    metrics["epoch_time_s"] = round(time.time() - t0, 3)  # the evaluation's time alone
    _record(run, metrics, pos.step)
    run.save(epoch, pos.step, is_best)
    run.log(f"epoch {epoch + 1}/{run.epochs}, evaluated on resuming: {tested}")
    run.last_metrics = metrics  # the run's result when that epoch was its last


def _run(
    cfg: TrainConfig, task: Task, explicit: Any, d: Dist, out: Path, lock: RunLock,
    ctl: RunControl, resumed: Resumed | None,
) -> dict[str, Any]:  # fmt: skip
    run, pos = _start(cfg, task, explicit, d, out, lock, ctl, resumed)
    try:
        if pos.pending is not None:
            _evaluate_pending(run, pos)
        t_start, budget = time.time(), run.opt.schedule["total_steps"]
        if pos.epoch >= run.epochs:  # resuming a finished run: say so
            run.log(f"{out}: the run is finished (epoch {pos.epoch} of {run.epochs}); "
                    "nothing to do")  # fmt: skip
        elif pos.step >= budget:
            run.log(f"{out}: the run is finished (its {budget} steps are done, at epoch "
                    f"{pos.epoch} of {run.epochs}); nothing to do")  # fmt: skip
        for epoch in range(pos.epoch, run.epochs):
            if pos.step >= budget or _epoch(run, epoch, pos, t_start):  # never a 0-step epoch
                break
    finally:
        run.loggers.close()
    barrier(d)
    if d.world_size > 1:
        dist.destroy_process_group()
    return run.last_metrics
