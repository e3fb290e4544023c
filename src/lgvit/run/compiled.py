"""``lgvit train --compile [MODE]``: the model compiled once, for training and evaluation alike
(as timm does), the host out of the step.

A task that knows its input shapes (classification: one per progressive-resizing size, and
evaluation's) has them compiled statically (``dynamic=False``): a graph per shape, each new one
logged in ``train.log`` once, dynamo's recompile limit raised to the run's count so that none
falls back to eager silently (its default, 8, is less than a long resizing schedule needs). A
task whose shapes vary (dense images) keeps dynamo's automatic dynamic shapes.

``reduce-overhead`` replays CUDA graphs: each call marks a new step (the previous call's
outputs may then be overwritten, so evaluation's outputs are copied: test-time augmentation
holds one across the next call); on another device it compiles in default mode, said in one
line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from lgvit.core.runtime import COMPILE_MODES

CUDA_GRAPHS = COMPILE_MODES[-1]  # reduce-overhead: the mode that replays CUDA graphs


def compile_mode(value: bool | str | None) -> str | None:
    """The config's ``compile`` as a ``torch.compile`` mode: false or None -> None (eager),
    true -> the default mode, a mode's name -> itself (the config validated it)."""
    if value is None or value is False:
        return None
    return COMPILE_MODES[0] if value is True else str(value)


def raise_recompile_limit(graphs: int) -> int:
    """Dynamo keeps at least ``graphs`` graphs per function before it falls back to eager (it
    only raises the limit: another run in the process may need more); returns the limit."""
    from torch._dynamo import config

    limit = graphs
    for key in ("cache_size_limit", "recompile_limit"):  # the newer name, and the older
        if hasattr(config, key):
            limit = max(getattr(config, key), graphs)
            setattr(config, key, limit)
    return limit


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape)


class CompiledNet(nn.Module):
    """The run's network (the model, or its DDP wrapper) compiled once in ``mode``.

    ``graphs``: the number of input shapes the run feeds it (None: they vary, dynamo's dynamic
    shapes). With it, each new shape is logged once, before its graph compiles. ``_orig_mod``
    is what ``torch.compile``'s module holds: the engine's ``unwrap`` and DDP's ``no_sync``
    find the network through it, and checkpoints save the model itself (no prefix)."""

    def __init__(
        self, net: nn.Module, mode: str, graphs: int | None, log: Callable[[str], None],
        cuda_graphs: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.mode, self.graphs, self.log, self.cuda_graphs = mode, graphs, log, cuda_graphs
        self.compiled = torch.compile(net, mode=mode, dynamic=False if graphs else None)
        self.limit = raise_recompile_limit(graphs) if graphs else None
        self.seen: set[tuple[Any, ...]] = set()

    @property
    def _orig_mod(self) -> nn.Module:
        return self.compiled._orig_mod

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.graphs and isinstance(x, torch.Tensor):
            self._note(x)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled(x, *args, **kwargs)
        if self.cuda_graphs and not torch.is_grad_enabled():
            out = tree_map_only(torch.Tensor, torch.Tensor.clone, out)
        return out

    def _note(self, x: torch.Tensor) -> None:
        """A shape (and mode: training and evaluation are separate graphs) not seen before:
        the call compiles, which takes a while; say so, once."""
        key = (tuple(x.shape), self.training, torch.is_grad_enabled())
        if key in self.seen:
            return
        self.seen.add(key)
        verb = "compiling" if len(self.seen) == 1 else "recompiling"
        self.log(
            f"torch.compile ({self.mode}): {verb} for input {shape_text(key[0])} "
            f"({'training' if self.training else 'eval'}), graph {len(self.seen)} of at most "
            f"{self.graphs} (dynamo's limit {self.limit})"
        )


def compile_net(
    net: nn.Module, value: bool | str | None, device: torch.device, graphs: int | None,
    log: Callable[[str], None],
) -> nn.Module:  # fmt: skip
    """``net`` compiled as the config's ``compile`` asks (``net`` itself when it does not);
    ``graphs``: the task's count of input shapes (None: they vary)."""
    mode = compile_mode(value)
    if mode is None:
        return net
    if mode == CUDA_GRAPHS and device.type != "cuda":
        log(f"compile {mode}: CUDA graphs run on CUDA only; compiling in {COMPILE_MODES[0]} "
            f"mode on {device.type}")  # fmt: skip
        mode = COMPILE_MODES[0]
    return CompiledNet(net, mode, graphs, log, cuda_graphs=mode == CUDA_GRAPHS)
