"""Whether a dense task's input scale (``seg_scale``, ``det_scale``) fits in memory, checked
before any image is decoded or the model runs at that scale: an 8000x8000 scale passes the
config's 8192 px bound and the model's small probe, then a worker or an evaluation asks the
kernel for tens of GB and is killed without a word.

The estimate is a lower bound, so only a scale that cannot fit is refused. The bytes a model
needs are measured, not guessed: it runs at two small sizes (64 and 128 px, square) under
:class:`LiveBytes`, which counts the bytes of every tensor created and still alive (the peak of
their sum), and the secant through the two points is extended to the scale's size. Memory that
grows faster than the pixels (global attention's score matrices) is under-counted by the
secant, never over-counted: for Semantic FPN on LIT-Ti and on LSA's CIFAR model the secant gave
the 256 px peak exactly. The size a scale gives is that of a 4:3 photo (:data:`PHOTO_HW`,
ADE20K's and COCO's commonest shape); 16-bit autocast is counted as halving every activation.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lgvit.core.errors import LgvitError

# The image whose rescaled size stands for a scale's inputs: a 4:3 photo, (H, W).
PHOTO_HW = (480, 640)
# The square sizes a model's memory is measured at (the detection probe's 64 px and twice it).
PROBE_SIZES = (64, 128)


def small_enough(pixels: int) -> bool:
    """Whether a batch of ``pixels`` input pixels in all is not worth measuring: no more than
    the larger probe's own (its fwd+bwd peak is 0.25 GB or less for the models measured)."""
    return pixels <= PROBE_SIZES[-1] ** 2


class LiveBytes(TorchDispatchMode):
    """Inside it, the bytes of the tensors created there and still alive (``live``) and the
    most at once (``peak``). A storage is counted once, when an op first returns it; it stops
    counting when it is freed. Tensors that existed before (weights, inputs) do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)  # torch keeps one Python object per live storage
            if key in self._refs:
                continue
            nbytes = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._freed(k, n))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The most bytes of tensors ``fn()`` had alive at once (:class:`LiveBytes`)."""
    tracker = LiveBytes()
    with tracker:
        fn()
    return tracker.peak


class Secant(NamedTuple):
    """Bytes alive at once for ``pixels`` input pixels: ``base + per_pixel * pixels``."""

    base: float
    per_pixel: float

    def __call__(self, pixels: float, batch: int = 1) -> float:
        # ``base`` (allocations that do not grow with the input) once per forward, not per
        # image; a negative one (memory growing faster than the pixels) is left out.
        return max(self.base, 0.0) + batch * self.per_pixel * pixels


def measure_secant(run: Callable[[int], Any]) -> Secant:
    """The secant of :func:`peak_bytes` of ``run(size)`` (a ``size`` x ``size`` input) through
    :data:`PROBE_SIZES`."""
    (a, b) = PROBE_SIZES
    fa, fb = peak_bytes(lambda: run(a)), peak_bytes(lambda: run(b))
    per_pixel = max(fb - fa, 0) / (b * b - a * a)
    return Secant(fb - per_pixel * b * b, per_pixel)


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """Bytes the device can still allocate and what says so: a CUDA device's free memory
    (``torch.cuda.mem_get_info``), else Linux's ``MemAvailable``; None where neither is
    readable (the check is skipped)."""
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError, AssertionError):
            return torch.cuda.mem_get_info(device)[0], f"free on {device}"
        return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available (MemAvailable)"
    except (OSError, ValueError, IndexError):
        return None
    return None


class Need(NamedTuple):
    """One part of a run that must fit: its bytes, the device holding them, what it is."""

    nbytes: float
    device: torch.device
    what: str


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_scale_fits(
    key: str, scale: Sequence[int], needs: Callable[[tuple[int, int]], list[Need]]
) -> None:
    """One line naming ``key``, its value, the estimate and the memory available when a part
    of ``needs(scale)`` exceeds its device's available memory; the line suggests a smaller
    scale (the same shape) whose every part fits, where one does."""
    free: dict[str, tuple[int, str] | None] = {}

    def over(s: tuple[int, int]) -> tuple[Need, tuple[int, str]] | None:
        for need in needs(s):
            dev = str(need.device)
            if dev not in free:
                free[dev] = available_memory(need.device)
            if free[dev] is not None and need.nbytes > free[dev][0]:
                return need, free[dev]
        return None

    value = (int(scale[0]), int(scale[1]))
    found = over(value)
    if found is None:
        return
    need, (avail, source) = found
    # The bytes grow with the scale's area: shrink both sides by the square root of the excess
    # (to multiples of 32), then further until every part fits.
    f = math.sqrt(avail / need.nbytes)
    hint = ""
    for _ in range(20):
        smaller = tuple(max(32, int(v * f) // 32 * 32) for v in value)
        if over(smaller) is None:
            hint = f", e.g. --set {key}=[{smaller[0]},{smaller[1]}]"
            break
        if smaller == (32, 32):
            break
        f *= 0.8
    raise LgvitError(
        f"{key}={value} needs at least {_gb(need.nbytes)} ({need.what}) but {_gb(avail)} is "
        f"{source}; lower {key}{hint}"
    )
