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
from pathlib import Path
from typing import Any

from lgvit.errors import LgvitError

LOCK_NAME = ".lock"


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
        self.path = Path(out) / LOCK_NAME
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


# What a training run writes into its directory besides the resumable ``last`` checkpoint.
RUN_FILES = (
    "last.state.pt", "best.safetensors", "best.state.pt", "last_ema.safetensors",
    "metrics.jsonl", "train.log", "config.yaml",
)  # fmt: skip


def check_resumable(out: Path, checkpoint: Path) -> None:
    """``--resume auto`` with no ``checkpoint`` to resume: refused (one line) when the directory
    holds another run's files, which a fresh run would overwrite (and whose config it would
    ignore); an empty or new directory starts a run."""
    found = [name for name in RUN_FILES if (Path(out) / name).exists()]
    if found and not checkpoint.exists():
        raise LgvitError(
            f"--resume auto: {out} holds a run ({', '.join(found[:3])}) but not {checkpoint.name},"
            " the checkpoint to resume; restore it, resume another checkpoint with --resume "
            "PATH, or start over in another --out"
        )


def check_mid_epoch_batch(
    state: dict, batch_size: int | None, stem: Path, world_size: int | None = None
) -> None:
    """A checkpoint saved inside an epoch counts its position in batches of its processes:
    resuming it with another batch size or process count would skip (or repeat) the rest of
    that epoch's images."""
    mid = (state.get("extra") or {}).get("mid_epoch")
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
        self.path = out / "train.log"

    def __call__(self, msg: str, console: bool = True) -> None:
        if not self.main:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if console:
            print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
