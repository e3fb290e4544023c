"""``lgvit average``: the mean of several checkpoints' weights, as timm's ``avg_checkpoints.py``.

The sources are a run directory's kept epochs (``--best N`` of them; their EMA weights when the
run kept an EMA, unless ``--no-ema``) or checkpoint files named one by one (``save_pretrained``
folders too, as eval takes them: ``local-dir:DIR``, ``hf-hub:ORG/NAME``). Floating-point
tensors (weights, and BatchNorm's running mean and variance) are averaged in float64 and stored
in their own dtype; integer tensors (BatchNorm's ``num_batches_tracked``) are taken from the last
source. The result keeps the metadata (model, classes, preprocessing) of the first source that
has a record (a folder's weights and a ``.pth`` have none), so it loads wherever a checkpoint
does: ``lgvit eval``, ``predict``, ``export`` and ``create_model(name, checkpoint_path=...)``.
``--out`` may not be a file it averages, a run's own checkpoint (``last``, ``best``,
``last_ema`` in a folder holding a run) or a file in a run's ``kept/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from lgvit.checkpoints.files import (
    PAIR_ID_KEY,
    WEIGHTS_SUFFIX,
    checkpoint_paths,
    load_metadata,
    load_weights,
)
from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.atomic import atomic_save_safetensors, check_writable
from lgvit.core.errors import LgvitError
from lgvit.inference import folder_weights_file
from lgvit.run.kept import kept_checkpoints
from lgvit.run.rundir import holds_run

__all__ = ["average_files", "average_weights", "check_out", "sources"]


def average_weights(states: Sequence[dict[str, Tensor]], names: Sequence[str]) -> dict[str, Tensor]:
    """The mean of ``states`` (named ``names`` in errors): float tensors in float64, then their
    dtype; integer and bool tensors from the last state. Every state must hold the same keys
    with the same shapes."""
    if not states:
        raise LgvitError("nothing to average: no checkpoints given")
    states = _one_qkv_layout(states)
    first, sums = states[0], {}
    for state, name in zip(states, names, strict=True):
        if state.keys() != first.keys():
            extra = sorted(set(state) ^ set(first))
            raise LgvitError(f"{name}: its weights differ from {names[0]}'s in {extra[:3]} (all "
                             "averaged checkpoints must be of one model)")  # fmt: skip
        for k, v in state.items():
            if v.shape != first[k].shape:
                raise LgvitError(f"{name}: {k} has shape {tuple(v.shape)}, {names[0]} "
                                 f"{tuple(first[k].shape)}")  # fmt: skip
            if v.is_floating_point():
                sums[k] = sums.get(k, 0) + v.to(torch.float64)
    out = {}
    for k, v in states[-1].items():
        out[k] = (sums[k] / len(states)).to(v.dtype) if k in sums else v.clone()
    return out


def _one_qkv_layout(states: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """A run resumed across the q/k/v fusion keeps epochs of both layouts: an older state's
    ``q`` + ``kv`` rows are stacked into ``qkv`` where another state holds that ``qkv`` (as the
    models' load hook does; spatial-reduction attention keeps ``q`` and ``kv`` everywhere)."""
    fused = {k for state in states for k in state if k.endswith((".qkv.weight", ".qkv.bias"))}
    out = []
    for state in states:
        state = dict(state)
        for k in fused:
            head, _, part = k.rpartition(".qkv.")
            q, kv = f"{head}.q.{part}", f"{head}.kv.{part}"
            if k not in state and q in state and kv in state:
                state[k] = torch.cat([state.pop(q), state.pop(kv)])
        out.append(state)
    return out


def sources(paths: Sequence[str], best: int | None, ema: bool = True) -> list[Path]:
    """The files to average: a single run directory's ``best`` kept epochs (EMA weights when
    kept and ``ema``), or the checkpoint files themselves."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        kept = kept_checkpoints(paths[0])
        n = best or len(kept)
        if n > len(kept):
            raise LgvitError(f"--best {n}: {paths[0]} kept {len(kept)} epoch(s) "
                             f"({', '.join(str(r['epoch'] + 1) for r in kept)})")  # fmt: skip
        return [r["ema"] if ema and r["ema"] else r["weights"] for r in kept[:n]]
    if best is not None:
        raise LgvitError("--best N takes one run directory (its kept epochs), not files")
    if len(paths) < 2:
        raise LgvitError(f"{paths[0]}: give a run directory with kept epochs, or two or more "
                         "checkpoint files to average")  # fmt: skip
    return [Path(folder_weights_file(p) or p) for p in paths]  # hub folders as eval takes them


def average_files(files: Sequence[Path], out: str | Path) -> dict[str, Tensor]:
    """Average ``files`` into ``out`` (a ``.safetensors`` file, written atomically) with the
    first file's metadata; returns the averaged weights."""
    check_out(out, files)  # the path as given, in its message
    out = Path(out)
    if not out.name.endswith(WEIGHTS_SUFFIX):
        raise LgvitError(f"--out {out}: the average is written as a {WEIGHTS_SUFFIX} file")
    check_writable(out, "--out")
    states = [load_weights(f) for f in files]
    averaged = average_weights(states, [str(f) for f in files])
    meta = _first_record(files)
    meta = {k: v for k, v in meta.items() if k != PAIR_ID_KEY}  # it pairs no train state
    atomic_save_safetensors(averaged, out, meta)
    return averaged


def _same_files(path: Path) -> set[Path]:
    """The files ``path`` may name, resolved: as given, and as a checkpoint stem's weights."""
    return {path.resolve(), checkpoint_paths(path)[0].resolve()}


def check_out(out: str | Path, files: Sequence[Path]) -> None:
    """``--out`` must not replace a file the average reads, a run's checkpoint (its ``last``
    would lose the train state it pairs with, and ``--resume auto`` would fail) or a file in a
    run's ``kept/`` (its index owns that folder): one line, before anything is read."""
    target = checkpoint_paths(out)[0].resolve()
    for f in files:
        if _same_files(Path(out)) & _same_files(Path(f)):
            raise LgvitError(f"--out {out}: {f} is one of the checkpoints averaged; write the "
                             "average to another file")  # fmt: skip
    folder, stem = target.parent, target.name[: -len(WEIGHTS_SUFFIX)]
    average = f"average{WEIGHTS_SUFFIX}"  # the name a message suggests
    if stem in RunLayout.CHECKPOINTS and holds_run(folder):
        raise LgvitError(
            f"--out {out}: {folder} holds a run, and this would replace its {stem} checkpoint; "
            f"write the average to another name (e.g. {folder / average})"
        )
    run = RunLayout(folder.parent)
    if folder == run.kept_dir and (run.kept_index.exists() or holds_run(run.out)):
        raise LgvitError(
            f"--out {out}: inside {folder}, the run's kept epochs ({run.KEPT_INDEX} owns that "
            f"folder); write the average outside it (e.g. {folder.parent / average})"
        )


def _first_record(files: Sequence[Path]) -> dict[str, str]:
    """The metadata of the first file carrying an lgvit record (a model name): a ``.pth`` or a
    ``save_pretrained`` folder's weights carry none, so the average takes the next file's."""
    first = None
    for f in files:
        try:
            meta = load_metadata(f)
        except LgvitError:  # a .pth: no metadata
            continue
        if "model" in meta:
            return meta
        first = meta if first is None else first
    return first or {}
