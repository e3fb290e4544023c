"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Every write goes to ``.<name>.tmp-<pid>`` in the target's directory (``os.replace`` is only
atomic within one filesystem), is flushed and fsynced, then replaces the target; the directory
is fsynced too where the OS allows, so the rename itself survives a power cut. A failed write
removes its temp file, and its error names the file being written, never the temp file.
(``rundir.remove_stale_temps`` relies on the ``.*.tmp-*`` name.)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from lgvit.core.errors import LgvitError

__all__ = [
    "atomic_save",
    "atomic_save_safetensors",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_metadata",
    "check_writable",
    "commit",
    "fsync_dir",
    "naming",
    "safetensors_ready",
    "temp_path",
    "write_temp",
    "writing_to",
]


def temp_path(path: Path) -> Path:
    """The temp file a write of ``path`` goes to (same directory, this process's id)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_file(path: Path) -> None:
    # Reopened read-write: Windows' fsync needs a writable handle; save_file gives us none.
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable; a no-op where a directory cannot be opened
    (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_writable(path: str | Path, what: str, folder: bool = False) -> Path:
    """Before long work whose result goes to ``path`` (``what``: the flag): a directory there
    (a file, when ``folder``: the result is a folder written in place), an ancestor that is a
    file, or a folder that cannot be written is one line now, not a failure after the work
    naming a temp file. Missing folders are fine: writes create them."""
    p = Path(path)
    if p.is_dir() and not folder:
        raise LgvitError(f"{what} {p}: a directory; name the file to write")
    if folder and p.exists() and not p.is_dir():
        raise LgvitError(f"{what} {p}: a file; name a folder to write")
    parent = p if folder and p.is_dir() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise LgvitError(f"{what} {p}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LgvitError(f"{what} {p}: cannot write in {parent} (permission denied)")
    return p


@contextlib.contextmanager
def naming(tmp: Path, path: Path) -> Iterator[None]:
    """An OSError about the temp file ``tmp`` raised inside is raised again about ``path``, the
    file being written (same kind and errno): the user never named the temp file."""
    try:
        yield
    except OSError as e:
        names = {os.fspath(f) for f in (e.filename, e.filename2) if isinstance(f, str | Path)}
        if os.fspath(tmp) not in names:
            raise
        try:
            again = type(e)(e.errno, e.strerror, os.fspath(path))
        except Exception:  # noqa: BLE001 -- an OSError subclass built otherwise: keep it
            raise e from None
        raise again from e


def write_temp(path: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)``, fsync ``tmp`` and return it; remove it if anything fails.

    The first half of an atomic write: :func:`commit` is the second. Split so that a caller can
    prepare several files before renaming any (the checkpoint pair).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with naming(tmp, path):
            write(tmp)
            os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it (some writers use 0600)
            _fsync_file(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def commit(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` onto ``path`` and fsync the directory; on failure remove
    ``tmp``."""
    try:
        with naming(tmp, path):
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def writing_to(fn: Callable[[IO[bytes]], None]) -> Callable[[Path], None]:
    """Adapt ``fn(file_handle)`` to the ``write(path)`` that :func:`write_temp` calls."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            fn(f)
            f.flush()

    return write


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Create ``path`` atomically with ``write(tmp)``, which writes the whole file at ``tmp``.

    If ``write`` raises, ``path`` is left as it was and the exception propagates.
    """
    path = Path(path)
    commit(write_temp(path, write), path)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, ``os.replace``)."""
    atomic_write(path, writing_to(lambda f: f.write(data)))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """``json.dumps(obj)`` to ``path`` (UTF-8), atomically."""
    atomic_write_bytes(path, json.dumps(obj).encode("utf-8"))


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, atomically."""
    atomic_write(path, writing_to(lambda f: torch.save(obj, f)))


def atomic_save_safetensors(
    tensors: Mapping[str, Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, atomically; tensors are made savable first."""
    ready = safetensors_ready(tensors)
    meta = check_metadata(metadata)
    atomic_write(path, lambda tmp: save_file(ready, str(tmp), metadata=meta))


def safetensors_ready(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """CPU tensors safetensors accepts: contiguous, and no two sharing storage."""
    # safetensors refuses non-contiguous tensors and tensors sharing storage (tied weights,
    # views); a contiguous copy of the second and later users of a storage fixes both.
    out: dict[str, Tensor] = {}
    seen: set[tuple[str, int]] = set()
    for k, v in tensors.items():
        if not isinstance(k, str) or not isinstance(v, Tensor):
            raise TypeError(f"weights[{k!r}]: expected a str key and a Tensor, got {type(v)}")
        t = v.detach().cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        storage = (t.device.type, t.untyped_storage().data_ptr())
        if storage in seen and t.numel() > 0:
            t = t.clone()
            storage = (t.device.type, t.untyped_storage().data_ptr())
        seen.add(storage)
        out[k] = t
    return out


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    """A copy of safetensors header ``metadata``; TypeError unless it maps str to str."""
    if metadata is None:
        return None
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str; got {k!r}: {v!r}")
    return dict(metadata)
