"""Checkpoints: model weights in safetensors, training state in a ``weights_only`` torch file.

A checkpoint is two files sharing a stem::

    runs/x/last.safetensors   model weights only (safetensors: no pickle, loads anywhere)
    runs/x/last.state.pt      training state: optimizer, scheduler, scaler, EMA, epoch, RNG,
                              config, extra metadata; loads with torch.load(weights_only=True)

Every file is written atomically: to ``.<name>.tmp-<pid>`` in the same directory, flushed and
fsynced, then ``os.replace``-d onto the final name (and the directory fsynced where the OS
allows), so a reader sees either the old file or the new one, never half of one.

Keeping the *pair* consistent: ``save_checkpoint`` writes both temp files first, then replaces
the weights, then the state. A kill between those two replaces leaves the new weights next to
the old state. To catch that, each save draws a random ``pair_id`` stored both in the
safetensors header metadata and in the state file; ``load_checkpoint_pair`` refuses a pair whose
ids differ. It also recovers the common case: the new state's temp file was complete (fsynced)
before the weights were replaced, so if a ``.<stem>.state.pt.tmp-*`` with the weights' id is
still there, the pair is read from it (roll-forward) instead of failing.

One writer per stem at a time (in DDP, rank 0): a successful save deletes leftover temp files.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import random
import re
import types
import uuid
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from lgvit.errors import LgvitError

__all__ = [
    "PAIR_ID_KEY",
    "STATE_SUFFIX",
    "WEIGHTS_SUFFIX",
    "atomic_save",
    "atomic_save_safetensors",
    "atomic_write_bytes",
    "build_train_state",
    "capture_rng_state",
    "checkpoint_paths",
    "clean_state_dict",
    "load_checkpoint_pair",
    "load_metadata",
    "load_train_state",
    "load_weights",
    "restore_rng_state",
    "save_checkpoint",
    "state_dict_to_cpu",
]

WEIGHTS_SUFFIX = ".safetensors"
STATE_SUFFIX = ".state.pt"
PAIR_ID_KEY = "lgvit_pair_id"  # safetensors metadata key; also a top-level key of the state file
_STATE_FORMAT_KEY = "lgvit_state_format"
_STATE_FORMAT = 1


# --------------------------------------------------------------------------- atomic writes


def _temp_path(path: Path) -> Path:
    # Same directory as the target: os.replace is only atomic within one filesystem.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_file(path: Path) -> None:
    # Reopened read-write: Windows' fsync needs a writable handle; save_file gives us none.
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on Windows (cannot open a directory).
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


def _write_temp(path: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)``, fsync ``tmp`` and return it; remove it if anything fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it (some writers use 0600)
        _fsync_file(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def _write_with_handle(fn: Callable[[IO[bytes]], None]) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            fn(f)
            f.flush()

    return write


def _commit(tmp: Path, path: Path) -> None:
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, ``os.replace``)."""
    path = Path(path)
    _commit(_write_temp(path, _write_with_handle(lambda f: f.write(data))), path)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, atomically."""
    path = Path(path)
    _commit(_write_temp(path, _write_with_handle(lambda f: torch.save(obj, f))), path)


def atomic_save_safetensors(
    tensors: Mapping[str, Tensor], path: str | Path, metadata: Mapping[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, atomically; tensors are made savable first."""
    path = Path(path)
    tensors = _safetensors_ready(tensors)
    meta = _check_metadata(metadata)
    _commit(_write_temp(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta)), path)


# --------------------------------------------------------------------------- state dicts


def state_dict_to_cpu(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Detached CPU copies of a state_dict's tensors (CPU tensors are not copied)."""
    return {k: v.detach().cpu() for k, v in state_dict.items()}


_ORIG_MOD_RE = re.compile(r"(^|\.)_orig_mod\.")


def clean_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Strip wrapper prefixes: DDP's ``module.`` and torch.compile's ``_orig_mod.``.

    ``_orig_mod.`` is removed wherever it appears (compiling a submodule puts it mid-key; no real
    module is called that). ``module.`` is removed only when *every* key starts with it, since a
    model may have a genuine submodule named ``module``.
    """
    out = {_ORIG_MOD_RE.sub(r"\1", k): v for k, v in state_dict.items()}
    while out and all(k.startswith("module.") for k in out):
        out = {k[len("module.") :]: v for k, v in out.items()}
        out = {_ORIG_MOD_RE.sub(r"\1", k): v for k, v in out.items()}
    return out


def _safetensors_ready(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
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


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str; got {k!r}: {v!r}")
    return dict(metadata)


# What torch.load(weights_only=True) accepts besides tensors; checked at save time so a bad
# value (a numpy float, a Path, an object) fails when saving, not months later when resuming.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _loadable(obj: Any, where: str) -> Any:
    """Copy of ``obj`` that loads with ``weights_only=True``: numpy scalars become Python
    numbers, numpy arrays become tensors; anything else unsupported raises TypeError."""
    if isinstance(obj, Tensor) or isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, Mapping):
        return {k: _loadable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_loadable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, set | frozenset):
        return {_loadable(v, where) for v in obj}
    raise TypeError(
        f"{where}: {type(obj).__name__} cannot be loaded with torch.load(weights_only=True); "
        "store plain numbers, strings, lists, dicts or tensors"
    )


# --------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and the current CUDA device), numpy and ``random``, as tensors,
    ints, floats and lists so they load with ``weights_only=True``."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, py_state, gauss_next = random.getstate()
    cuda = None
    # Only the current device: get_rng_state_all() would create a CUDA context on every visible
    # GPU from this process (wasting memory on other ranks' GPUs); each DDP rank owns one device.
    # And only if CUDA is already initialised, so CPU runs never touch it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().cpu()
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": int(version), "state": list(py_state), "gauss_next": gauss_next},
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; missing entries are left alone."""
    try:
        if state.get("torch") is not None:
            torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if isinstance(cuda, list | tuple):  # a per-device list: take this device's entry
                idx = torch.cuda.current_device()
                cuda = cuda[idx] if idx < len(cuda) else None
            if cuda is not None:
                torch.cuda.set_rng_state(cuda.cpu().to(torch.uint8))
        npst = state.get("numpy")
        if npst is not None:
            keys = np.asarray(npst["keys"].cpu().numpy(), dtype=np.uint32)
            np.random.set_state(
                ("MT19937", keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
            )
        py = state.get("python")
        if py is not None:
            random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise LgvitError(f"rng state: cannot restore ({_first_line(e)})") from None


def build_train_state(
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    ema: Any = None,
    epoch: int = 0,
    global_step: int = 0,
    best_metric: float | None = None,
    config: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> dict[str, Any]:
    """The training-state dict ``save_checkpoint`` expects, with the conventional keys.

    ``optimizer``/``scheduler``/``scaler`` may be objects with ``state_dict()`` or dicts; ``ema``
    a module, a state_dict or None. ``rng=True`` captures the RNG states now.
    """

    def sd(x: Any) -> Any:
        return x.state_dict() if hasattr(x, "state_dict") else x

    ema_sd = sd(ema)
    return {
        "optimizer": sd(optimizer),
        "scheduler": sd(scheduler),
        "scaler": sd(scaler),
        "ema": state_dict_to_cpu(ema_sd) if ema_sd is not None else None,
        "epoch": int(epoch),
        "global_step": int(global_step),
        "best_metric": None if best_metric is None else float(best_metric),
        "rng": capture_rng_state() if rng else None,
        "config": dict(config) if config is not None else None,
        "extra": dict(extra) if extra is not None else {},
    }


# --------------------------------------------------------------------------- saving


def _strip_known_suffix(path: str | Path) -> Path:
    path = Path(path)
    for suffix in (WEIGHTS_SUFFIX, STATE_SUFFIX):
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.with_name(path.name[: -len(suffix)])
    return path


def checkpoint_paths(stem: str | Path) -> tuple[Path, Path]:
    """``(weights_path, state_path)`` of a checkpoint stem (a trailing suffix is tolerated)."""
    stem = _strip_known_suffix(stem)
    # String concatenation, not with_suffix: stems like "ep1.5" contain dots.
    return stem.with_name(stem.name + WEIGHTS_SUFFIX), stem.with_name(stem.name + STATE_SUFFIX)


def save_checkpoint(
    stem: str | Path,
    model_state: Mapping[str, Tensor],
    train_state: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Save ``<stem>.safetensors`` (weights + ``metadata``) and ``<stem>.state.pt``.

    Both temp files are written before either is renamed into place, weights first (see the
    module docstring for why the pair stays consistent). With ``train_state=None`` only the
    weights are written and a stale state file of the same stem is removed.
    """
    weights_path, state_path = checkpoint_paths(stem)
    pair_id = uuid.uuid4().hex
    meta = dict(_check_metadata(metadata) or {})
    meta[PAIR_ID_KEY] = pair_id
    meta.setdefault("format", "pt")  # the safetensors convention other tools look for
    tensors = _safetensors_ready(model_state)

    state_obj = None
    if train_state is not None:
        state_obj = {
            _STATE_FORMAT_KEY: _STATE_FORMAT,
            PAIR_ID_KEY: pair_id,
            "train_state": _loadable(dict(train_state), "train_state"),
        }

    temps: list[Path] = []
    try:
        temps.append(
            _write_temp(weights_path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
        )
        if state_obj is not None:
            temps.append(
                _write_temp(state_path, _write_with_handle(lambda f: torch.save(state_obj, f)))
            )
        os.replace(temps[0], weights_path)
        # From here on the state temp file is the only state matching the weights on disk: if
        # the next replace fails (or we are killed), keep it, so load_checkpoint_pair can roll
        # forward to it instead of rejecting the pair.
        temps = []
        if state_obj is not None:
            os.replace(_temp_path(state_path), state_path)
    except BaseException:
        for tmp in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    if state_obj is None:
        with contextlib.suppress(FileNotFoundError):
            state_path.unlink()
    _fsync_dir(weights_path.parent)
    # Temp files left by earlier killed saves (other pids) are obsolete now that a full pair
    # is in place.
    for path in (weights_path, state_path):
        for stale in path.parent.glob(f".{_glob_escape(path.name)}.tmp-*"):
            with contextlib.suppress(OSError):
                stale.unlink()


def _glob_escape(name: str) -> str:
    """Escape glob metacharacters in a literal file name."""
    return re.sub(r"([*?\[])", r"[\1]", name)


# --------------------------------------------------------------------------- loading


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    line = re.split(r"(?<=\.)\s", line)[0]  # torch appends paragraphs of advice
    return line if len(line) <= 200 else line[:197] + "..."


def _require_file(path: Path) -> None:
    if not path.exists():
        raise LgvitError(f"{path}: no such file")
    if path.is_dir():
        raise LgvitError(f"{path}: is a directory, expected a checkpoint file")
    if path.stat().st_size == 0:
        raise LgvitError(f"{path}: file is empty (an interrupted copy or save?)")


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    _require_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise LgvitError(
            f"{path}: not a valid safetensors file, corrupt or truncated ({_first_line(e)})"
        ) from None
    return tensors, meta


def load_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata stored in a checkpoint's safetensors header."""
    return _read_safetensors(_resolve_weights_path(Path(path)))[1]


_GLOBAL_RE = re.compile(r"GLOBAL (\S+)")
# A dotted Python name; keeps text that merely starts with a pickle opcode byte (a YAML file
# beginning with "c") from being reported as code.
_DOTTED_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _allowed_globals() -> set[str]:
    try:  # private, but it is exactly the allowlist weights_only uses
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except Exception:
        allowed = set()
    with contextlib.suppress(Exception):
        for g in torch.serialization.get_safe_globals():
            obj = g[0] if isinstance(g, tuple) else g
            allowed.add(f"{obj.__module__}.{obj.__qualname__}")
    return allowed


def _pickle_globals(path: Path) -> list[str]:
    """Globals a pickle (plain, or the data.pkl in a torch zip) would import; never executes it.

    Best effort: reads opcodes with pickletools and tracks the strings STACK_GLOBAL consumes.
    """
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
                data = zf.read(name)
        else:
            data = path.read_bytes()
    except Exception:
        return []
    found: list[str] = []
    strings: list[Any] = []
    memo: dict[Any, Any] = {}
    last: Any = None
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            name = op.name
            if "UNICODE" in name or name.endswith("STRING"):
                last = arg
                strings.append(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = last
            elif name.endswith("PUT"):
                memo[arg] = last
            elif name.endswith("GET"):
                last = memo.get(arg)
                strings.append(last)
            elif name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            else:
                last = None
    except Exception:
        pass  # a truncated pickle still reveals the globals read so far
    return [g for g in found if _DOTTED_RE.fullmatch(g)]


def _unpickling_error(path: Path, e: BaseException) -> LgvitError:
    allowed = _allowed_globals()
    names = [g for g in _pickle_globals(path) if g not in allowed]
    m = _GLOBAL_RE.search(str(e))
    if m and m.group(1) not in names and _DOTTED_RE.fullmatch(m.group(1)):
        names.insert(0, m.group(1))
    if names:
        shown = ", ".join(dict.fromkeys(names[:3]))
        return LgvitError(
            f"{path}: refusing to load: the file is a pickle that would import/run code "
            f"({shown}); lgvit loads checkpoints with weights_only=True"
        )
    op = re.search(r"Unsupported operand \d+", str(e))
    detail = op.group(0) if op else "unreadable pickle data"
    return LgvitError(f"{path}: not a PyTorch checkpoint, or corrupt ({detail})")


class _Inert:
    """Stands in for a class or function a checkpoint names that is not plain data (a training
    script's config object, ``argparse.Namespace``, ...): built from the pickle's arguments
    without running anything, so the file's tensors can still be read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:  # dict subclasses (yacs CfgNode)
        pass

    def append(self, item: Any) -> None:  # list subclasses
        pass

    def extend(self, items: Any) -> None:
        pass


class _DataOnlyUnpickler(pickle.Unpickler):
    """Torch's weights_only allowlist for what it names; an inert placeholder for the rest."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" in _allowed_globals():
            return super().find_class(module, name)
        return type(name, (_Inert,), {"__module__": "lgvit.checkpoint.inert"})


_DATA_ONLY_PICKLE = types.SimpleNamespace(
    Unpickler=_DataOnlyUnpickler,
    load=lambda f, **kw: _DataOnlyUnpickler(f, **kw).load(),
    __name__="lgvit_data_only_pickle",
)


def _torch_load_data_only(path: Path) -> Any:
    """The file's plain data and tensors, any other object replaced by an inert placeholder
    (never imported, never called). For weights inside a training script's checkpoint."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(
            path, map_location="cpu", weights_only=False, pickle_module=_DATA_ONLY_PICKLE
        )


def _torch_load(path: Path) -> Any:
    _require_file(path)
    try:
        with warnings.catch_warnings():
            # Pickle-protocol chatter from the weights_only unpickler; errors still raise.
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _unpickling_error(path, e) from None
    except Exception as e:
        raise LgvitError(
            f"{path}: not a valid PyTorch checkpoint, corrupt or truncated ({_first_line(e)})"
        ) from None


def _resolve_weights_path(path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(p.name for p in path.glob(f"*{WEIGHTS_SUFFIX}"))
        hint = f"; it holds {', '.join(found)}" if found else ""
        raise LgvitError(
            f"{path}: is a directory; pass a checkpoint such as {path / 'last'} or "
            f"{path / 'best'}{hint}"
        )
    for suffix in (WEIGHTS_SUFFIX, ".pt", ".pth"):
        candidate = path.with_name(path.name + suffix)
        if candidate.is_file():
            return candidate
    raise LgvitError(f"{path}: no such file (also tried {path.name}{WEIGHTS_SUFFIX}, .pt, .pth)")


_WRAPPER_KEYS = ("model", "state_dict", "model_state_dict", "module")


def _as_state_dict(obj: Any, path: Path) -> dict[str, Tensor]:
    if isinstance(obj, Mapping) and PAIR_ID_KEY in obj:
        raise LgvitError(
            f"{path}: is an lgvit training-state file, not weights; "
            f"pass {checkpoint_paths(path)[0].name} instead"
        )
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner:
                obj = inner
                break
    if not isinstance(obj, Mapping) or not obj:
        raise LgvitError(f"{path}: does not contain a state_dict (got {type(obj).__name__})")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        keys = ", ".join(repr(k) for k in list(obj)[:5])
        raise LgvitError(
            f"{path}: does not contain a state_dict of tensors (entry {bad[0]!r} is not a tensor;"
            f" top-level keys: {keys})"
        )
    return dict(obj)


def load_weights(path: str | Path) -> dict[str, Tensor]:
    """Model weights from a ``.safetensors`` file, a checkpoint stem (``runs/x/last``), or a
    ``.pt``/``.pth`` holding a state_dict (optionally under ``model``/``state_dict``), loaded
    with ``weights_only=True``. DDP/torch.compile prefixes are stripped.

    A ``.pth`` written by a training script often also holds objects that ``weights_only``
    refuses (its argparse ``Namespace`` or config object, next to the weights): then the file is
    read again with every such object replaced by an inert placeholder -- nothing it names is
    imported or called -- and its weights are used if they are plain tensors; otherwise the
    refusal stands."""
    resolved = _resolve_weights_path(Path(path))
    if resolved.name.endswith(WEIGHTS_SUFFIX):
        tensors, _ = _read_safetensors(resolved)
        if not tensors:
            raise LgvitError(f"{resolved}: holds no tensors")
    else:
        try:
            obj = _torch_load(resolved)
        except LgvitError as refused:
            if "refusing to load" not in str(refused):
                raise
            try:
                obj = _torch_load_data_only(resolved)
                tensors = _as_state_dict(obj, resolved)
            except Exception:
                raise refused from None
            skipped = sorted(
                {k for k, v in obj.items() if isinstance(v, _Inert)} if isinstance(obj, Mapping)
                else set()
            )  # fmt: skip
            warnings.warn(
                f"{resolved}: read its weights only; left out objects that are not plain data"
                + (f" ({', '.join(map(str, skipped))})" if skipped else ""),
                stacklevel=2,
            )
            return clean_state_dict(tensors)
        tensors = _as_state_dict(obj, resolved)
    return clean_state_dict(tensors)


def _read_state_file(path: Path) -> dict[str, Any]:
    obj = _torch_load(path)
    if not (isinstance(obj, Mapping) and _STATE_FORMAT_KEY in obj and "train_state" in obj):
        raise LgvitError(f"{path}: not an lgvit training-state file")
    if obj[_STATE_FORMAT_KEY] > _STATE_FORMAT:
        raise LgvitError(
            f"{path}: training-state format {obj[_STATE_FORMAT_KEY]} is newer than this lgvit "
            f"understands ({_STATE_FORMAT}); upgrade lgvit"
        )
    return dict(obj)


def _resolve_state_path(path: Path) -> Path:
    if path.name.endswith(WEIGHTS_SUFFIX) or not path.is_file():
        return checkpoint_paths(path)[1]
    return path


def load_train_state(path: str | Path) -> dict[str, Any]:
    """The training state saved with a checkpoint (``<stem>.state.pt`` or the stem)."""
    return _read_state_file(_resolve_state_path(Path(path)))["train_state"]


def load_checkpoint_pair(
    stem: str | Path, repair: bool = False
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(weights, train_state)`` of a checkpoint, checked to come from the same save.

    If the state file is older than the weights (a kill between the two renames), the complete
    state temp file of that save is used when it is still on disk (``repair``: and renamed
    into place, so the pair is whole again); otherwise LgvitError.
    """
    weights_path, state_path = checkpoint_paths(stem)
    tensors, meta = _read_safetensors(weights_path)
    if not state_path.exists():
        raise LgvitError(f"{state_path}: no such file (the training state of {weights_path})")
    wanted = meta.get(PAIR_ID_KEY)
    if wanted is None:
        raise LgvitError(f"{weights_path}: has no {PAIR_ID_KEY}; not saved by save_checkpoint")
    state = _read_state_file(state_path)
    if state.get(PAIR_ID_KEY) != wanted:
        recovered = _roll_forward(state_path, wanted, repair)
        if recovered is None:
            raise LgvitError(
                f"{state_path}: does not belong to {weights_path.name} (pair id "
                f"{state.get(PAIR_ID_KEY)} != {wanted}); the save was interrupted"
            )
        state = recovered
    return clean_state_dict(tensors), state["train_state"]


def _roll_forward(state_path: Path, pair_id: str, repair: bool = False) -> dict[str, Any] | None:
    temps = state_path.parent.glob(f".{_glob_escape(state_path.name)}.tmp-*")
    for tmp in sorted(temps, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            state = _read_state_file(tmp)
        except LgvitError:
            continue  # a temp file another save was still writing
        if state.get(PAIR_ID_KEY) == pair_id:
            warnings.warn(
                f"{state_path}: older than its weights (interrupted save); "
                f"using the complete state from {tmp.name}",
                stacklevel=3,
            )
            if repair:
                os.replace(tmp, state_path)
                _fsync_dir(state_path.parent)
            return state
    return None
