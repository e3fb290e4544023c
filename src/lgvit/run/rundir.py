"""A run directory is owned by one training run at a time.

``RunLock`` creates ``<out>/.lock`` exclusively (``O_CREAT | O_EXCL``) holding the owner's pid,
host and start time. A second run into the same directory is refused in one line naming the
owner; a lock left by a process that no longer exists on this host is taken over, with a note.
A lock from another host cannot be checked: it is refused, and the message says how to remove
it. While the lock is held, temp files of interrupted saves (``.<name>.tmp-<pid>``) can only
be leftovers, and :func:`remove_stale_temps` deletes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgvit.checkpoints.files import checkpoint_paths, load_record, load_train_state
from lgvit.checkpoints.record import CheckpointRecord
from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.errors import LgvitError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # no such process; no such pid
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Exclusive ownership of a run directory; ``note`` says what happened to a stale lock."""

    def __init__(self, out: Path) -> None:
        self.path = RunLayout(out).lock
        self.note: str | None = None
        self.held = False

    def acquire(self) -> RunLock:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        for _ in range(3):  # a stale lock is removed and creation retried
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing(me["host"])
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise LgvitError(f"{self.path}: could not take the run directory's lock")

    def _handle_existing(self, host: str) -> None:
        if self.path.is_dir() or self.path.is_symlink():
            kind = "link" if self.path.is_symlink() else "folder"
            raise LgvitError(f"{self.path} is not a lock file (a {kind}); remove it or use "
                             "another --out")  # fmt: skip
        try:
            owner = json.loads(self.path.read_text())
            pid, where = int(owner["pid"]), str(owner["host"])
        except FileNotFoundError:
            return  # released meanwhile: retry
        except (ValueError, KeyError, TypeError, OSError):
            owner, pid, where = {}, -1, host  # unreadable (a crash while writing it): stale
        if where != host:
            raise LgvitError(
                f"{self.path.parent} is in use by pid {pid} on host {where}; if that run is "
                f"gone, delete {self.path} (or use another --out)"
            )
        if pid > 0 and _alive(pid) and pid != os.getpid():
            started = owner.get("started")
            since = time.strftime(" since %H:%M:%S", time.localtime(started)) if started else ""
            raise LgvitError(
                f"{self.path.parent} is in use by another run (pid {pid}{since}); wait for it to "
                "finish or use another --out"
            )
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.note = f"took over the lock of pid {pid}, which no longer runs"

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.held = False


def remove_stale_temps(out: Path) -> list[str]:
    """Delete temp files of interrupted saves in ``out`` (call with the lock held); returns
    their names."""
    removed = []
    for tmp in sorted(Path(out).glob(".*.tmp-*")):
        with contextlib.suppress(OSError):
            tmp.unlink()
            removed.append(tmp.name)
    return removed


def run_files(out: Path) -> list[str]:
    """The files of a run that ``out`` holds (its ``last`` checkpoint first); [] for a new or
    empty directory."""
    return [path.name for path in RunLayout(out).files if path.exists()]


def holds_run(out: Path) -> bool:
    """``out`` holds a run's files or its kept epochs (``keep_best``)."""
    return bool(run_files(out)) or RunLayout(out).kept_index.exists()


def check_resumable(out: Path, checkpoint: Path, given: Iterable[str] | None = None) -> None:
    """``--resume auto`` with no ``checkpoint`` to resume: refused (one line) when the directory
    holds another run's files, which a fresh run would overwrite (and whose config it would
    ignore). An empty or new directory starts the run the command describes (a preemption
    script's first launch), unless it describes none: ``given``, the run-defining keys (a task's
    ``identity_keys``) this invocation set, is empty (a mistyped ``--out``, most likely)."""
    found = run_files(out)
    if found and not checkpoint.exists():
        raise LgvitError(
            f"--resume auto: {out} holds a run ({', '.join(found[:3])}) but not {checkpoint.name},"
            " the checkpoint to resume; restore it, resume another checkpoint with --resume "
            "PATH, or start over in another --out"
        )
    if not found and given is not None and not list(given):
        raise LgvitError(
            f"--resume auto: {out} holds no run to resume (no {checkpoint.name}), and nothing "
            "says what to train (--config, --model, --data); check --out, or give the run's "
            "settings to start it there"
        )


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumes, read once where the run is resolved (its record says the
    task): the engine takes its record instead of opening the file again."""

    stem: Path
    record: CheckpointRecord


def read_resumed(resume: str | None, out: Path | str) -> Resumed | None:
    """The checkpoint ``--resume`` names and its record; None when not resuming or when there
    is no readable checkpoint there (the engine reports that, with the run's words)."""
    if not resume:
        return None
    stem = RunLayout(out).last if resume == "auto" else _stem_named(resume)
    try:
        return Resumed(stem, load_record(checkpoint_paths(stem)[0], strict=True))
    except LgvitError:
        return None


def _stem_named(resume: str) -> Path:
    """The stem ``--resume PATH`` names: a checkpoint's, or a run directory's ``last``."""
    stem = Path(resume)
    return RunLayout(stem).last if stem.is_dir() else stem


def find_resume(resume: str | None, out: Path, given: Iterable[str]) -> Path | None:
    """The checkpoint stem ``--resume`` names (``auto``: ``<out>/last``; None when there is none
    yet: :func:`check_resumable`). Another run's checkpoint may start a new directory but not
    go into one holding a run: its metrics and checkpoints would be replaced by the other
    run's."""
    if not resume:
        return None
    if resume == "auto":
        stem = RunLayout(out).last
        check_resumable(stem.parent, checkpoint_paths(stem)[0], given)
        return stem if checkpoint_paths(stem)[0].exists() else None
    stem = _stem_named(resume)
    if not checkpoint_paths(stem)[0].exists():
        raise LgvitError(f"--resume {resume}: no checkpoint found there")
    found = run_files(out)
    if found and stem.parent.resolve() != Path(out).resolve():
        raise LgvitError(_from_elsewhere(resume, stem, out, found))
    return stem


def _from_elsewhere(resume: str, stem: Path, out: Path, found: list[str]) -> str:
    """Why ``--resume`` of a checkpoint in another folder may not go into ``out``, which holds
    a run: that folder's run, or (a checkpoint copied away from its run) the run its config
    says it was started in."""
    holds = f"{out} holds a run of its own ({', '.join(found[:3])})"
    started = None
    if not any(path.exists() for path in RunLayout(stem.parent).records):  # copied away
        try:
            started = (load_train_state(stem).get("config") or {}).get("out")
        except LgvitError:  # unreadable: refused in the run's words when resumed elsewhere
            started = None
    if not isinstance(started, str) or Path(started).resolve() == stem.parent.resolve():
        return (
            f"--resume {resume}: a checkpoint of another run ({stem.parent}), and {holds}; "
            f"continue that run with --out {stem.parent}, this one with --resume auto, or "
            "resume into a new --out"
        )
    return (
        f"--resume {resume}: the checkpoint of a run started in {started} (its config says), "
        f"copied to {stem.parent}, and {holds}; start a new run from its weights with "
        f"--initial-checkpoint {resume} (another --out), continue that run where it was "
        f"started (--out {started} --resume auto), or resume it into a new --out"
    )


def check_mid_epoch_batch(
    state: dict, batch_size: int | None, stem: Path, world_size: int | None = None,
    grad_accum_steps: int | None = None,
) -> None:  # fmt: skip
    """A checkpoint saved inside an epoch counts its position in batches of its processes and
    its schedule in steps of its accumulation windows: resuming it with another batch size,
    process count or ``grad_accum_steps`` would skip (or repeat) the rest of that epoch's
    images, or shift its schedule."""
    mid = (state.get("extra") or {}).get("mid_epoch")
    accum = (state.get("config") or {}).get("grad_accum_steps", 1)
    if mid is not None and grad_accum_steps not in (None, accum):
        raise LgvitError(
            f"--resume {stem}: saved inside epoch {state.get('epoch', 0) + 1} with "
            f"grad_accum_steps={accum}; resume it with --grad-accum-steps {accum} (it may "
            "change at an epoch boundary, from a checkpoint saved after an epoch)"
        )
    ranks = len((state.get("extra") or {}).get("rng_per_rank") or []) or None
    if mid is not None and None not in (ranks, world_size) and ranks != world_size:
        raise LgvitError(
            f"--resume {stem}: saved inside epoch {state.get('epoch', 0) + 1} by {ranks} "
            f"process(es); resume it with {ranks} (torchrun --nproc_per_node {ranks}); the "
            "process count may change from a checkpoint saved after an epoch"
        )
    saved = (state.get("config") or {}).get("batch_size")
    if mid is not None and None not in (saved, batch_size) and saved != batch_size:
        raise LgvitError(
            f"--resume {stem}: saved inside epoch {state.get('epoch', 0) + 1} at batch "
            f"{mid.get('batch')} of {saved} images; resume it with --batch-size {saved} (the "
            "batch size may change at an epoch boundary, from a checkpoint saved after an epoch)"
        )


def rescale_resume(state: dict, cfg: Any, steps_per_epoch: int, world_size: int) -> str | None:
    """A resume after an epoch with another global batch (``--batch-size``, or the process
    count): an epoch takes another number of steps, so the schedule's position
    (``state["global_step"]``, changed here) moves to the same epoch counted in the new steps,
    and the base lr follows the batch (``scaled_lr``); returns that note (None: same batch). An
    iteration budget counts steps of the run's batch: such a resume is refused (one line)."""
    from lgvit.run.config import config_from_dict, global_batch, scaled_lr

    saved = config_from_dict(state.get("config") or {}, source="the checkpoint's config")
    ranks = len((state.get("extra") or {}).get("rng_per_rank") or []) or world_size
    was, now = global_batch(saved, ranks), global_batch(cfg, world_size)
    if was == now:
        return None
    if cfg.iters:
        accum = f" x {saved.grad_accum_steps} accumulated" if saved.grad_accum_steps > 1 else ""
        raise LgvitError(
            f"--resume {cfg.resume}: the run's budget of {cfg.iters} iterations counts steps of "
            f"{was} images (--batch-size {saved.batch_size} on {ranks} process(es){accum}), not "
            f"{now}; resume it with that global batch"
        )
    done, old_step = state["epoch"] + 1, state["global_step"]
    state["global_step"] = done * steps_per_epoch
    return (
        f"the global batch is {now} images, not {was} as the run trained: {steps_per_epoch} "
        f"steps an epoch, the lr schedule continues after epoch {done} at step "
        f"{state['global_step']} (was {old_step}), its base lr scaled with the batch to "
        f"{scaled_lr(cfg, world_size):.3g} (was {scaled_lr(saved, ranks):.3g})"
    )


def global_batch_text(cfg: Any, world_size: int) -> str:
    """The global batch for the run's log line, with its factors when it accumulates."""
    from lgvit.run.config import global_batch

    total = global_batch(cfg, world_size)
    if cfg.grad_accum_steps == 1:
        return str(total)
    factors = f"{cfg.batch_size} x {world_size} process(es) x {cfg.grad_accum_steps} accumulated"
    return f"{total} ({factors})"


def check_resume_keys(
    saved: Any, cfg: Any, explicit: Any, stem: Path, keys: tuple[str, ...]
) -> None:
    """A resume that would change the model, the data or the input size (a task's
    ``identity_keys``): one line, nothing written (the checkpoint's shapes would not fit, or
    the run would silently change)."""
    for key in keys:
        if key in explicit and getattr(cfg, key) != getattr(saved, key):
            was, now = getattr(saved, key), getattr(cfg, key)
            raise LgvitError(
                f"--resume {stem}: the run trained with {key}={was!r}, not {now!r}; continue "
                f"it without changing {key}, or start a new run (another --out) from its "
                f"weights with --initial-checkpoint {stem}"
            )


class RunLog:
    """Rank 0 prints and appends to ``<out>/train.log``; other ranks stay quiet."""

    def __init__(self, out: Path, main: bool) -> None:
        self.main = main
        self.path = RunLayout(out).log

    def __call__(self, msg: str, console: bool = True) -> None:
        if not self.main:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if console:
            print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
