"""The run's checkpoint history (``keep_best: N``): the weights of its N best epochs.

timm's ``--checkpoint-hist`` keeps the best few epochs so that ``avg_checkpoints.py`` can average
them (a few tenths of a point for nothing). Here the kept epochs live in ``<out>/kept/``: each
one's weights (``epoch-0012.safetensors``, with the run's metadata, so each loads in ``lgvit
eval`` by itself) and, with an EMA, its EMA weights (``epoch-0012_ema.safetensors``), listed
best first in ``kept.json``: ranked by the EMA's top-1 when the run evaluates an EMA (timm's
choice: those are the weights ``lgvit average`` takes by default), else the model's, each row
naming the metric that ranked it (``ranked_by``). A new epoch's files are on disk before the
index names them, and the ones that fell out are removed only after the new index is in place:
a kill at any moment leaves an index whose files all exist (at worst a file no index names,
removed next time).
``lgvit average RUN --best N`` reads the index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.atomic import atomic_save_safetensors, atomic_write_bytes
from lgvit.core.errors import LgvitError


def kept_checkpoints(out: str | Path) -> list[dict[str, Any]]:
    """The kept epochs of run directory ``out``, best first: ``epoch`` (from 0), ``metric``,
    ``weights`` and ``ema`` (paths; ``ema`` None without an EMA). A run without them, an
    empty or a damaged index, is one line."""
    index = RunLayout(out).kept_index
    if not index.is_file():
        raise LgvitError(
            f"{out}: no kept checkpoints ({index} is missing): train with --set keep_best=N "
            "to keep the N best epochs, or name the checkpoint files to average"
        )
    try:
        rows = json.loads(index.read_text())
        kept = [
            {
                "epoch": int(r["epoch"]),
                "metric": float(r["metric"]),
                "weights": index.parent / str(r["weights"]),
                "ema": index.parent / str(r["ema"]) if r.get("ema") else None,
            }
            for r in rows
        ]
    except (ValueError, TypeError, KeyError) as e:
        raise LgvitError(f"{index}: not a kept-checkpoint index ({e})") from None
    if not kept:  # written by hand, or emptied: "no checkpoints given" would blame the command
        raise LgvitError(f"{index} lists no epochs: the run kept none to average; name the "
                         "checkpoint files to average instead")  # fmt: skip
    return kept


def kept_score(metrics: Mapping[str, Any], best_metric: str) -> tuple[str, float | None]:
    """(the metrics key that ranks an epoch, its score; None: not evaluated). The EMA's
    ``best_metric`` when the run evaluates an EMA, as timm ranks its checkpoint history: those
    are the weights ``lgvit average`` averages by default. Else the model's own."""
    for key in (f"test_ema_{best_metric}", f"test_{best_metric}"):
        if metrics.get(key) is not None:
            return key, float(metrics[key])
    return f"test_{best_metric}", None


def keep_epoch(
    out: Path,
    n: int,
    epoch: int,
    metric: float,
    weights: Mapping[str, Tensor],
    ema: Mapping[str, Tensor] | None,
    metadata: Mapping[str, str],
    ranked_by: str | None = None,
) -> list[int]:
    """Add ``epoch`` (scored ``metric``, higher is better; ``ranked_by``: the metric's key, as
    :func:`kept_score` names it, recorded in the index) to the ``n`` best kept when it is among
    them; returns the kept epochs, best first."""
    folder, index = RunLayout(out).kept_dir, RunLayout(out).kept_index
    try:
        rows = json.loads(index.read_text())
    except (OSError, ValueError):  # none yet (a damaged index restarts the history)
        rows = []
    rows = [r for r in rows if r.get("epoch") != epoch]  # an epoch evaluated again on resume
    row = {"epoch": epoch, "metric": metric, **({"ranked_by": ranked_by} if ranked_by else {})}
    ranked = sorted([*rows, row], key=lambda r: -r["metric"])
    keep = ranked[:n]
    if all(r["epoch"] != epoch for r in keep):
        return [r["epoch"] for r in keep]
    own, own_ema = RunLayout.kept_name(epoch, False), RunLayout.kept_name(epoch, True)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(weights, folder / own, metadata)
    if ema is not None:
        atomic_save_safetensors(ema, folder / own_ema, metadata)
    for r in keep:
        if r["epoch"] == epoch:
            r.update(weights=own, ema=own_ema if ema else None)
    atomic_write_bytes(index, json.dumps(keep, indent=1).encode())
    named = {r["weights"] for r in keep} | {r["ema"] for r in keep if r.get("ema")}
    for f in folder.glob(RunLayout.KEPT_GLOB):  # fell out of the best n (or never indexed)
        if f.name not in named:
            f.unlink(missing_ok=True)
    return [r["epoch"] for r in keep]
