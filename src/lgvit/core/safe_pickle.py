"""Pickles lgvit did not write: one restricted unpickler, and what a pickle would import.

:class:`RestrictedUnpickler` imports only the globals its caller allows and hands every other
one to the caller, which raises or returns an inert stand-in. Callers and what they allow:

* CIFAR batches (:mod:`lgvit.data.cifar`): numpy's array reconstruction only; anything else
  raises.
* A training script's ``.pth`` (:mod:`lgvit.checkpoints.files`): torch's ``weights_only`` allowlist;
  anything else becomes an :class:`Inert` placeholder, so the file's tensors can still be read.
  What was left out is a warning of one of two kinds: :class:`LeftOutWarning` (objects that are
  only data of a class: a training script's ``argparse.Namespace``, expected) or
  :class:`PickledCodeWarning` (calls the pickle would make on loading: code, never expected).

:func:`pickle_globals` lists what a pickle would import without running it, for error messages.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import contextvars
import io
import pickle
import pickletools
import re
import reprlib
import types
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from lgvit.core.errors import LgvitError

__all__ = [
    "Inert",
    "LeftOutWarning",
    "PickledCodeWarning",
    "RestrictedUnpickler",
    "pickle_globals",
    "refused_pickle_error",
    "torch_allowed_globals",
    "torch_load_data_only",
]

# A dotted Python name; keeps text that merely starts with a pickle opcode byte (a YAML file
# beginning with "c") from being reported as code.
_DOTTED_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_GLOBAL_RE = re.compile(r"GLOBAL (\S+)")
_NUMPY_MULTIARRAY = ("numpy.core.multiarray", "numpy._core.multiarray")


def _numpy_reconstruct() -> object:
    # numpy 2 moved numpy.core to numpy._core; look it up directly so that old pickles naming
    # numpy.core.multiarray do not trigger numpy 2's deprecation shim.
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that imports only the globals ``allowed(module, name)`` accepts.

    For any other global ``refused(module, name)`` is called: it raises, or returns what to use
    instead (never the real object). Other keywords go to :class:`pickle.Unpickler`.
    """

    def __init__(
        self,
        file: IO[bytes],
        allowed: Callable[[str, str], bool],
        refused: Callable[[str, str], Any],
        **kwargs: Any,
    ) -> None:
        super().__init__(file, **kwargs)
        self._allowed = allowed
        self._refused = refused

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            return self._refused(module, name)
        if module in _NUMPY_MULTIARRAY and name == "_reconstruct":
            return _numpy_reconstruct()
        return super().find_class(module, name)


# --------------------------------------------------------------------------- torch files


def torch_allowed_globals() -> set[str]:
    """``module.name`` of every global ``torch.load(weights_only=True)`` accepts."""
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


class LeftOutWarning(UserWarning):
    """Weights read from a pickle beside objects that are only data of classes lgvit does not
    import (a training script's ``argparse.Namespace``), which were left out: harmless."""


class PickledCodeWarning(UserWarning):
    """Weights read from the pickle ``path`` that would call functions on loading
    (``posix.system(...)``): code, which was not run. ``calls``: each call, as
    ``name(arguments)``; ``shown``: the first three, for a message."""

    def __init__(self, path: Path, calls: list[str]) -> None:
        self.path, self.calls = path, calls
        self.shown = ", ".join(list(dict.fromkeys(calls))[:3])
        super().__init__(
            f"{path}: read its weights only; the file also holds code that would run when "
            f"loaded ({self.shown}), which lgvit did not run"
        )


# The calls a pickle being read by torch_load_data_only makes (REDUCE): code that would run.
_CALLS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "lgvit_calls", default=None
)
# Calls that rebuild plain values (what pickle and numpy use for objects, bytes, arrays,
# scalars; paths, dates, numbers): data, not code.
_REBUILDERS = {
    *(f"copyreg.{n}" for n in ("_reconstructor", "__newobj__", "__newobj_ex__")),
    "_codecs.encode",
    *(f"numpy.{c}.multiarray.{n}" for c in ("core", "_core") for n in ("scalar", "_reconstruct")),
    "numpy.dtype",
    *(f"pathlib.{n}" for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath",
                               "PureWindowsPath")),  # fmt: skip
    *(f"datetime.{n}" for n in ("date", "time", "datetime", "timedelta", "timezone")),
    "collections.OrderedDict", "collections.defaultdict", "decimal.Decimal", "fractions.Fraction",
    *(f"builtins.{n}" for n in ("set", "frozenset", "complex", "bytearray", "slice", "range")),
}  # fmt: skip


# Arguments of a call shown in a message: enough to see what it would do, on one short line.
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother = 160, 40


class Inert:
    """Stands in for a class or function a checkpoint names that is not plain data (a training
    script's config object, ``argparse.Namespace``, ...): built from the pickle's arguments
    without running anything, so the file's tensors can still be read.

    Pickle rebuilds an object with ``cls.__new__`` (NEWOBJ), and calls a function with its
    arguments (REDUCE, which is how a pickle runs code: ``os.system("...")``); only a call
    reaches ``__init__``, which records the call: the name it stands for and its arguments."""

    lgvit_name = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        calls = _CALLS.get()
        if calls is not None and self.lgvit_name not in _REBUILDERS:
            calls.append(f"{self.lgvit_name}({', '.join(_SHORT.repr(a) for a in args)})")

    def __repr__(self) -> str:
        return f"{self.lgvit_name}(...)"

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:  # dict subclasses (yacs CfgNode)
        pass

    def append(self, item: Any) -> None:  # list subclasses
        pass

    def extend(self, items: Any) -> None:
        pass


def _torch_allows(module: str, name: str) -> bool:
    return f"{module}.{name}" in torch_allowed_globals()


def _py3_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 calls it (pickles of protocol < 3 use Python 2's names:
    ``commands.Popen`` is ``subprocess.Popen``), as :class:`pickle.Unpickler` maps them."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _inert_class(module: str, name: str) -> type:
    return type(name, (Inert,), {"__module__": "lgvit.checkpoints.files.inert",
                                 "lgvit_name": _py3_name(module, name)})  # fmt: skip


class _DataOnlyUnpickler(RestrictedUnpickler):
    """Torch's weights_only allowlist for what it names; an inert placeholder for the rest.
    (``torch.load`` subclasses ``pickle_module.Unpickler`` and calls it with the file only.)"""

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
        super().__init__(file, _torch_allows, _inert_class, **kwargs)


_DATA_ONLY_PICKLE = types.SimpleNamespace(
    Unpickler=_DataOnlyUnpickler,
    load=lambda f, **kw: _DataOnlyUnpickler(f, **kw).load(),
    __name__="lgvit_data_only_pickle",
)


def torch_load_data_only(path: Path, calls: list[str] | None = None) -> Any:
    """The file's plain data and tensors, any other object replaced by an inert placeholder
    (never imported, never called). For weights inside a training script's checkpoint.

    ``calls``, when given, receives the calls the pickle would have made on loading
    (``posix.system('...')``, ``builtins.eval('...')``): code it holds, which was not run."""
    token = _CALLS.set([] if calls is None else calls)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(
                path, map_location="cpu", weights_only=False, pickle_module=_DATA_ONLY_PICKLE
            )
    finally:
        _CALLS.reset(token)


# --------------------------------------------------------------------------- inspection


def _pickle_bytes(path: Path) -> bytes:
    """A plain pickle's bytes, or the data.pkl inside a torch zip file."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
            return zf.read(name)
    return path.read_bytes()


def pickle_globals(path: Path) -> list[str]:
    """Globals a pickle (plain, or the data.pkl in a torch zip) would import; never executes it.

    Best effort: reads opcodes with pickletools and tracks the strings STACK_GLOBAL consumes.
    """
    try:
        data = _pickle_bytes(path)
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


def refused_pickle_error(path: Path, e: BaseException) -> LgvitError:
    """The one-line error for a file ``torch.load(weights_only=True)`` refused with ``e``:
    the code it would import, when there is any, else that it is not a checkpoint."""
    allowed = torch_allowed_globals()
    names = [g for g in pickle_globals(path) if g not in allowed]
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
