"""Released weights downloaded once into a cache: atomic, shared safely between processes, checked.

Where: ``$LGVIT_WEIGHTS_DIR`` if set, else torch hub's checkpoint folder
(``torch.hub.get_dir()/checkpoints``, i.e. ``$TORCH_HOME/hub/checkpoints``), under the released
file's own name -- so a file copied there by hand (an offline machine) is found. From where:
the authors' release URL, or ``$LGVIT_WEIGHTS_MIRROR/<file name>`` when that is set (a mirror
holding the files flat, ``https://`` or ``file://``).

How a file becomes the cached file:

1. one process at a time per file (an ``fcntl.flock`` on ``.<name>.lock`` beside it); another
   process asking for the same file waits, then finds it there and downloads nothing;
2. the bytes stream into ``.<name>.tmp-<pid>`` in the same folder (tqdm bar on stderr when stderr
   is a terminal), hashed on the way; a short body (the connection closed before
   ``Content-Length``), an HTTP error or no network is one line naming the URL, and the temp file
   is removed;
3. the file is loaded strictly into its model through lgvit's loader (``torch.load`` with
   ``weights_only=True``; objects that are not plain data are never imported or run); a file
   that does not fit, or whose pickle would call a function on loading (code: the authors'
   files hold only weights and data such as their training script's ``argparse.Namespace``),
   is refused and removed;
4. it is fsynced and renamed onto its name, and its sha256 is recorded in ``<name>.lgvit.json``.
   A later file under that name (replaced in the cache, or served anew after the cached one was
   deleted) must have the recorded hash, or it is refused in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lgvit.core.atomic import atomic_write_json, commit, temp_path
from lgvit.core.errors import LgvitError, first_line
from lgvit.core.safe_pickle import LeftOutWarning, PickledCodeWarning
from lgvit.models.weights import Weights

ENV_DIR = "LGVIT_WEIGHTS_DIR"
ENV_MIRROR = "LGVIT_WEIGHTS_MIRROR"
RECORD_SUFFIX = ".lgvit.json"
TIMEOUT_S = 60  # per socket operation, not for the whole file
_CHUNK = 1 << 20


def weights_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``override``, else ``$LGVIT_WEIGHTS_DIR``, else torch hub's."""
    if override:
        return Path(override).expanduser()
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    import torch.hub

    return Path(torch.hub.get_dir()) / "checkpoints"


def source_url(w: Weights) -> str:
    """Where ``w`` is downloaded from: the mirror's copy when ``$LGVIT_WEIGHTS_MIRROR`` is set."""
    mirror = os.environ.get(ENV_MIRROR)
    return f"{mirror.rstrip('/')}/{w.filename}" if mirror else w.url


def cached_file(w: Weights, cache_dir: str | os.PathLike | None = None) -> Path:
    """The path ``w`` has (or will have) in the cache."""
    return weights_dir(cache_dir) / w.filename


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def read_record(path: Path) -> dict[str, Any] | None:
    """What was recorded of the cached file ``path`` (url, sha256, size, mtime_ns), if anything."""
    try:
        rec = json.loads(record_path(path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("sha256"), str) else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Fetched:
    """A cached file; ``built``: what ``verify`` returned when this call checked the file (it
    was downloaded or found unrecorded now), else None."""

    path: Path
    built: Any = None
    downloaded: bool = False


def fetch(
    w: Weights,
    verify: Callable[[Path], Any],
    cache_dir: str | os.PathLike | None = None,
) -> Fetched:
    """``w``'s file in the cache, downloaded and checked first if it is not there.

    ``verify(path)`` loads the file strictly into its model (raising LgvitError if it does not
    fit); it runs on a fresh download before the file takes its name, and on a file found in the
    cache without a record (copied there by hand). Every failure is one LgvitError line.
    """
    folder = weights_dir(cache_dir)
    _check_folder(folder, cache_dir)
    dest = folder / w.filename
    with _locked(dest):
        if dest.is_file():
            return Fetched(dest, _check_cached(w, dest, verify))
        url = source_url(w)
        hint = f"pass the file by hand (checkpoint_path=FILE) or copy it to {dest}"
        tmp = temp_path(dest)
        try:
            sha = _download(url, tmp, dest.name, hint)
            _check_hash(w, dest, sha, url)
            built = _verify(
                verify, tmp, url, f"the download was not kept; {hint}", "the download was not kept"
            )  # copying it in would be refused too
            commit(tmp, dest)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()  # gone already after a commit
        _write_record(dest, url, sha)
        return Fetched(dest, built, downloaded=True)


def _check_folder(folder: Path, cache_dir: str | os.PathLike | None) -> None:
    """The cache folder (or the nearest path above it that exists) must be a folder: one line
    naming where it was set (``$LGVIT_WEIGHTS_DIR``, when it was) and the file in the way."""
    there = folder
    while not there.exists() and there != there.parent:
        there = there.parent
    if there.is_dir():
        return
    where = (f"{ENV_DIR}={folder}" if not cache_dir and os.environ.get(ENV_DIR)
             else f"the weights cache {folder}")  # fmt: skip
    what = "a file" if there == folder else f"{there} is a file"
    raise LgvitError(f"{where}: {what}, not a folder; set {ENV_DIR} to a folder for the "
                     "released weights, or pass checkpoint_path=FILE")  # fmt: skip


def _check_cached(w: Weights, dest: Path, verify: Callable[[Path], Any]) -> Any:
    """A cache hit: unchanged since recorded (size and mtime), or the same sha256; a file with
    no record is checked by ``verify`` and recorded."""
    rec = read_record(dest)
    st = dest.stat()
    want = w.sha256 or (rec or {}).get("sha256")
    if rec and (rec.get("size"), rec.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
        if w.sha256 is None or rec["sha256"] == w.sha256:
            return None
    sha = file_sha256(dest)
    if want is not None and sha != want:
        whose = "pinned for" if w.sha256 else "recorded at the first download of"
        raise LgvitError(
            f"{dest}: sha256 {sha[:16]}... differs from the {want[:16]}... {whose} {w.name}; "
            f"delete it to download it again, or pass checkpoint_path=FILE"
        )
    built = None
    if rec is None:  # copied in by hand: it must fit before it is trusted
        built = _verify(verify, dest, str(dest), "remove it or pass checkpoint_path=FILE")
    with contextlib.suppress(OSError):  # a read-only shared cache stays as it is
        _write_record(dest, (rec or {}).get("url"), sha)
    return built


def _check_hash(w: Weights, dest: Path, sha: str, url: str) -> None:
    rec = read_record(dest)  # the file was deleted but its record kept
    want = w.sha256 or (rec or {}).get("sha256")
    if want is not None and sha != want:
        whose = "pinned in lgvit" if w.sha256 else f"recorded in {record_path(dest)}"
        raise LgvitError(
            f"{url}: the file served (sha256 {sha[:16]}...) is not the one {whose} "
            f"({want[:16]}...); not kept. If its authors replaced it, delete the record to "
            "accept the new one, or pass checkpoint_path=FILE"
        )


def _verify(
    verify: Callable[[Path], Any], path: Path, where: str, after: str, code_after: str = ""
) -> Any:
    """``verify(path)``; a failure is one line naming ``where`` (the URL, not the temp file).
    A file whose pickle would run code is refused: it is not the authors' file, whatever it
    holds beside (``code_after``: what follows then, where ``after``'s advice would not do)."""
    try:
        with quiet_left_out():
            warnings.simplefilter("error", PickledCodeWarning)  # raised where it is found
            return verify(path)
    except PickledCodeWarning as e:
        raise LgvitError(f"{where}: refused: the file holds code that would run when loaded "
                         f"({e.shown}), which lgvit did not run; released weights hold none "
                         f"({code_after or after})") from None  # fmt: skip
    except LgvitError as e:
        raise LgvitError(f"{str(e).replace(str(path), where)} ({after})") from None
    except (RuntimeError, ValueError, KeyError, IndexError) as e:  # a layout the mapping rejects
        raise LgvitError(f"{where}: not weights this model can load ({type(e).__name__}: "
                         f"{first_line(e)}) ({after})") from None  # fmt: skip


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """The process's random streams (torch's CPU generator, numpy's and Python's global ones)
    as they were before the block: checking a download builds a model, whose initial draw
    would otherwise shift a seeded run that fetches its weights against one that finds them
    cached."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


@contextlib.contextmanager
def quiet_left_out() -> Iterator[None]:
    """Loading an authors' file: without the warning that its objects that are only data (a
    training script's argparse Namespace) were left out (the docs say so once). Code the file
    would run is still a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeftOutWarning)
        yield


def _write_record(dest: Path, url: str | None, sha: str) -> None:
    st = dest.stat()
    atomic_write_json(record_path(dest), dict(
        url=url, sha256=sha, size=st.st_size, mtime_ns=st.st_mtime_ns,
        recorded=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    ))  # fmt: skip


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Hold ``dest``'s lock; remove the temp files of downloads that died (no one else holds the
    lock, so no one is writing them)."""
    try:
        import fcntl
    except ImportError:  # Windows: two downloads may both run; each renames a whole file
        dest.parent.mkdir(parents=True, exist_ok=True)
        yield
        return
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        f = open(dest.with_name(f".{dest.name}.lock"), "a+b")  # noqa: SIM115
    except OSError as e:
        if dest.is_file():  # a read-only cache holding the file: reading needs no lock
            yield
            return
        raise LgvitError(
            f"cannot write the weights cache {dest.parent} ({e.strerror or e}); set {ENV_DIR} "
            "to a writable folder or pass checkpoint_path=FILE"
        ) from None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"lgvit: waiting for another process downloading {dest.name}", file=sys.stderr)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
                with contextlib.suppress(OSError):
                    stale.unlink()
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _download(url: str, tmp: Path, name: str, hint: str) -> str:
    """Stream ``url`` into ``tmp`` (fsynced); its sha256. Errors: one line naming ``url``."""
    print(f"lgvit: downloading {url} to {tmp.parent}", file=sys.stderr, flush=True)
    req = urllib.request.Request(url, headers={"User-Agent": "lgvit (urllib)"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp, open(tmp, "wb") as out:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            sha, n = _stream(resp, out, total, name)
            out.flush()
            os.fsync(out.fileno())
    except urllib.error.HTTPError as e:
        raise LgvitError(f"could not download {url} (HTTP {e.code} {e.reason}); {hint}") from None
    except urllib.error.URLError as e:
        raise LgvitError(f"could not download {url} ({e.reason}); {hint}") from None
    except (OSError, http.client.HTTPException) as e:  # reset, timeout, IncompleteRead
        raise LgvitError(f"could not download {url} (interrupted: {type(e).__name__}: "
                         f"{first_line(e)}); nothing was kept; {hint}") from None  # fmt: skip
    if total is not None and n != total:
        raise LgvitError(f"could not download {url} (the connection closed after {n} of "
                         f"{total} bytes); nothing was kept; {hint}")  # fmt: skip
    return sha


def _stream(resp: IO[bytes], out: IO[bytes], total: int | None, name: str) -> tuple[str, int]:
    from tqdm import tqdm

    h, n = hashlib.sha256(), 0
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
              file=sys.stderr, disable=not sys.stderr.isatty()) as bar:  # fmt: skip
        for chunk in iter(lambda: resp.read(_CHUNK), b""):
            out.write(chunk)
            h.update(chunk)
            n += len(chunk)
            bar.update(len(chunk))
    return h.hexdigest(), n
