"""Checkpoints: model weights in safetensors, training state in a ``weights_only`` torch file.

A checkpoint is two files sharing a stem::

    runs/x/last.safetensors   model weights only (safetensors: no pickle, loads anywhere)
    runs/x/last.state.pt      training state: optimizer, scheduler, scaler, EMA, epoch, RNG,
                              config, extra metadata; loads with torch.load(weights_only=True)

Every file is written atomically (:mod:`lgvit.core.atomic`: a temp file, fsynced, then
``os.replace``-d onto the final name), so a reader sees either the old file or the new one.

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
import errno
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

# The type tests: re-exported for models/hub.py and the registry.
from lgvit.checkpoints.record import (
    CheckpointRecord,
    is_img_size,
    is_names,
    is_number,
    is_rgb,
    is_size,
)
from lgvit.checkpoints.run_layout import STATE_SUFFIX, WEIGHTS_SUFFIX, RunLayout, checkpoint_paths
from lgvit.core.atomic import (
    atomic_save,
    atomic_save_safetensors,
    atomic_write_bytes,
    check_metadata,
    fsync_dir,
    safetensors_ready,
    temp_path,
    write_temp,
    writing_to,
)
from lgvit.core.errors import LgvitError, error_lines, first_line, last_line
from lgvit.core.safe_pickle import (
    Inert,
    LeftOutWarning,
    PickledCodeWarning,
    refused_pickle_error,
    torch_load_data_only,
)

__all__ = [
    "PAIR_ID_KEY",
    "STATE_SUFFIX",
    "WEIGHTS_SUFFIX",
    "atomic_save",
    "atomic_save_safetensors",
    "atomic_write_bytes",
    "build_train_state",
    "capture_rng_state",
    "check_finite_weights",
    "check_same_classes",
    "check_weight_dtypes",
    "checkpoint_paths",
    "clean_state_dict",
    "is_img_size",
    "is_names",
    "is_number",
    "is_rgb",
    "is_size",
    "load_checkpoint_pair",
    "load_metadata",
    "load_record",
    "load_train_state",
    "load_weights",
    "load_weights_and_metadata",
    "restore_rng_state",
    "save_checkpoint",
    "save_error",
    "short_reason",
    "state_dict_to_cpu",
]

PAIR_ID_KEY = "lgvit_pair_id"  # safetensors metadata key; also a top-level key of the state file
_STATE_FORMAT_KEY = "lgvit_state_format"
_STATE_FORMAT = 1


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
        raise LgvitError(f"rng state: cannot restore ({short_reason(e)})") from None


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
    meta = dict(check_metadata(metadata) or {})
    meta[PAIR_ID_KEY] = pair_id
    meta.setdefault("format", "pt")  # the safetensors convention other tools look for
    tensors = safetensors_ready(model_state)

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
            write_temp(weights_path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
        )
        if state_obj is not None:
            temps.append(write_temp(state_path, writing_to(lambda f: torch.save(state_obj, f))))
        os.replace(temps[0], weights_path)
        # From here on the state temp file is the only state matching the weights on disk: if
        # the next replace fails (or we are killed), keep it, so load_checkpoint_pair can roll
        # forward to it instead of rejecting the pair.
        temps = []
        if state_obj is not None:
            os.replace(temp_path(state_path), state_path)
    except BaseException:
        for tmp in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    if state_obj is None:
        with contextlib.suppress(FileNotFoundError):
            state_path.unlink()
    fsync_dir(weights_path.parent)
    # Temp files left by earlier killed saves (other pids) are obsolete now that a full pair
    # is in place.
    for path in (weights_path, state_path):
        for stale in path.parent.glob(f".{_glob_escape(path.name)}.tmp-*"):
            with contextlib.suppress(OSError):
                stale.unlink()


def save_error(out: Path, e: BaseException) -> LgvitError:
    """The one line of a failed checkpoint save into ``out``: the OS error behind it (torch's
    zip writer reports a failed write as ``[enforce fail at inline_container.cc]``, the
    ``ENOSPC`` only in its context) and what is left (there may be no previous checkpoint)."""
    cause, seen = None, set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen and cause is None:
        seen.add(id(err))
        cause = err if isinstance(err, OSError) and err.strerror else None
        err = err.__cause__ or err.__context__
    if cause is not None:
        reason = cause.strerror.lower() if cause.errno == errno.ENOSPC else cause.strerror
    elif "(os error 28)" in str(e) or ("inline_container" in str(e) and _free(out) < 1 << 20):
        reason = "no space left on device"
    else:
        reason = last_line(e)
    kept = (
        "the previous checkpoint there is kept and still loads"
        if RunLayout(out).last_weights.exists()
        else "no checkpoint had been saved there yet"
    )
    return LgvitError(f"saving the checkpoint to {out} failed: {reason}; {kept}")


def _free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


def _glob_escape(name: str) -> str:
    """Escape glob metacharacters in a literal file name."""
    return re.sub(r"([*?\[])", r"[\1]", name)


# --------------------------------------------------------------------------- loading


def short_reason(e: BaseException) -> str:
    """A library error as a short clause: its first line, first sentence, 200 characters."""
    line = re.split(r"(?<=\.)\s", first_line(e))[0]  # torch appends paragraphs of advice
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
            f"{path}: not a valid safetensors file, corrupt or truncated ({short_reason(e)})"
        ) from None
    return tensors, meta


def load_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata stored in a checkpoint's safetensors header."""
    return _read_safetensors(_resolve_weights_path(Path(path)))[1]


def load_record(
    path: str | Path, task: str | None = None, *, strict: bool = False
) -> CheckpointRecord:
    """The :class:`~lgvit.checkpoints.record.CheckpointRecord` of a checkpoint, every value checked:
    a malformed one is one line naming ``path`` and the key. ``task``: the task the caller loads
    (see :meth:`~lgvit.checkpoints.record.CheckpointRecord.from_meta`). Not ``strict``: a file
    without a safetensors header (a ``.pth``; a missing or broken file, which loading its weights
    then reports) has an empty one, every key at its default."""
    try:
        meta = load_metadata(path)
    except LgvitError:
        if strict:
            raise
        meta = {}
    return CheckpointRecord.from_meta(meta, path, task)


def check_same_classes(
    stem: Path, meta: dict[str, str], record: CheckpointRecord | None = None
) -> None:
    """The data must give the classes (names and order: the label indices) the run trained
    with; otherwise every label would silently mean another class. ``record``: the stem's, when
    the caller has read it already."""
    if record is None:
        record = load_record(checkpoint_paths(stem)[0], strict=True)  # names the file
    was = record.classes
    new = CheckpointRecord.from_meta(meta, stem).classes
    if was is None or new is None or was == new:
        return
    diff = next((i for i, (a, b) in enumerate(zip(was, new, strict=False)) if a != b), None)
    where = (
        f"class {diff} was {was[diff]!r}, is now {new[diff]!r}"
        if diff is not None
        else f"{len(was)} classes then, {len(new)} now"
    )
    from lgvit.data.sources import DATA_SOURCES  # lazily: import lgvit never loads the data

    source = DATA_SOURCES.get(CheckpointRecord.from_meta(meta, stem).dataset or "")
    why = source.classes_from if source is not None else ""
    raise LgvitError(
        f"--resume {stem}: the data's classes differ from the run's ({where}"
        f"{'; ' + why if why else ''}); start a new run from its weights with "
        f"--initial-checkpoint {stem}"
    )


def _torch_load(path: Path) -> Any:
    _require_file(path)
    try:
        with warnings.catch_warnings():
            # Pickle-protocol chatter from the weights_only unpickler; errors still raise.
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused_pickle_error(path, e) from None
    except Exception as e:
        raise LgvitError(
            f"{path}: not a valid PyTorch checkpoint, corrupt or truncated ({short_reason(e)})"
        ) from None


def _resolve_weights_path(path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(p.name for p in path.glob(f"*{WEIGHTS_SUFFIX}"))
        if found:  # name what is there, not a run's last/best it may not have
            raise LgvitError(f"{path}: is a directory; pass one of the files it holds: "
                             f"{', '.join(found)}")  # fmt: skip
        raise LgvitError(
            f"{path}: is a directory with no checkpoint in it (pass a run's {RunLayout(path).last} "
            f"or {RunLayout(path).best}, a weights file, or a save_pretrained folder)"
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
    return _read_weights(Path(path))[0]


def load_weights_and_metadata(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """:func:`load_weights`'s tensors and the string metadata of the same file's safetensors
    header (empty for a ``.pt``/``.pth``), the path resolved and the file read once: a
    checkpoint's record (``CheckpointRecord.from_meta``) comes from the bytes its weights do."""
    return _read_weights(Path(path))


def _read_weights(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    resolved = _resolve_weights_path(path)
    if resolved.name.endswith(WEIGHTS_SUFFIX):
        tensors, meta = _read_safetensors(resolved)
        if not tensors:
            raise LgvitError(f"{resolved}: holds no tensors")
        return clean_state_dict(tensors), meta
    try:
        obj = _torch_load(resolved)
    except LgvitError as refused:
        if "refusing to load" not in str(refused):
            raise
        calls: list[str] = []
        try:
            obj = torch_load_data_only(resolved, calls)
            tensors = _as_state_dict(obj, resolved)
        except Exception:
            raise refused from None
        # stacklevel 3: the warning names the caller of load_weights / load_weights_and_metadata
        warnings.warn(_left_out(resolved, obj, calls), stacklevel=3)
        return clean_state_dict(tensors), {}
    return clean_state_dict(_as_state_dict(obj, resolved)), {}


def _left_out(path: Path, obj: Any, calls: list[str]) -> UserWarning:
    """The warning of a ``.pth`` whose weights were read beside objects that are not plain
    data: code the pickle would have run on loading (a REDUCE of a function it names) is
    said to be code, not merely an object left out, and is a warning of another kind."""
    if calls:
        return PickledCodeWarning(path, calls)
    skipped = sorted(
        {str(k) for k, v in obj.items() if isinstance(v, Inert)} if isinstance(obj, Mapping)
        else set()
    )  # fmt: skip
    return LeftOutWarning(
        f"{path}: read its weights only; left out objects that are not plain data"
        + (f" ({', '.join(skipped)})" if skipped else "")
    )


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
                fsync_dir(state_path.parent)
            return state
    return None


def check_weight_dtypes(
    weights: Mapping[str, Tensor], own: Mapping[str, Tensor], path: str | Path
) -> None:
    """A float parameter or buffer of the model must get float values: load_state_dict would
    silently cast an int (or bool) tensor into it."""
    for k, v in weights.items():
        want = own.get(k)
        if want is not None and want.is_floating_point() and not v.is_floating_point():
            raise LgvitError(
                f"{path}: {k} is {str(v.dtype).removeprefix('torch.')}, not floating point "
                "like the model's; not weights this model can use"
            )


def check_finite_weights(model: nn.Module, path: str | Path) -> None:
    """Weights to evaluate, predict with or export must be finite: NaN or inf in a parameter
    (a diverged run's checkpoint) would only give NaN outputs. An error naming the first."""
    for k, v in model.named_parameters():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise LgvitError(
                f"{path}: {k} holds non-finite values (NaN or inf); the checkpoint of a run "
                "that diverged? evaluate an earlier one"
            )


def load_into(model: nn.Module, weights: dict[str, Tensor], source: str, what: str) -> None:
    """``model.load_state_dict(weights)`` (strict); a misfit is one line: ``source`` (the file,
    or the flag and the file) does not fit ``what``, and the first key that does not. Integer
    values for float weights are refused too (load_state_dict would cast them silently)."""
    check_weight_dtypes(weights, model.state_dict(), source)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        detail = (error_lines(e)[1:] or [first_line(e)])[0]
        raise LgvitError(f"{source} does not fit {what}: {detail}") from None
