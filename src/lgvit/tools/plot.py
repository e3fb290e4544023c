"""``lgvit plot``: training curves of one or several runs, overlaid, with matplotlib.

The LocalViT paper's Fig. 4 layout: test top-1, test top-5 and training loss per epoch, one line
per run (EMA weights dashed where the run kept them), the best top-1 epoch of each run marked.
Needs matplotlib (``pip install 'lgvit[viz]'``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lgvit.checkpoints.run_layout import RunLayout
from lgvit.core.errors import LgvitError

FORMATS = (".png", ".svg", ".pdf")
DEFAULT_OUT = "curves.png"  # in the run directory for one run, else in the working directory
PANELS = (
    ("test_acc1", "test top-1 (%)"),
    ("test_acc5", "test top-5 (%)"),
    ("train_loss", "training loss"),
)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = RunLayout(run_dir).metrics
    if not path.is_file():
        raise LgvitError(f"{path}: not found (is {run_dir} a training run directory?)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise LgvitError(f"{path}:{n}: not a JSON line") from None
    if not rows:
        raise LgvitError(f"{path}: no epochs recorded yet")
    return rows


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """The runs' directory names; the parent is added where two names are the same."""
    names = [Path(r).resolve().name for r in run_dirs]
    return [
        f"{Path(r).resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for r, n in zip(run_dirs, names, strict=True)
    ]


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
) -> Path:
    """Draw the runs' curves into ``out`` (``.png``, ``.svg`` or ``.pdf``; default
    ``RUN/curves.png`` for one run, ``curves.png`` for several); returns the path."""
    from lgvit.tools.viz import need_matplotlib

    if not run_dirs:
        raise LgvitError("no run directory given")
    path = Path(out) if out else (Path(run_dirs[0]) if len(run_dirs) == 1 else Path()) / DEFAULT_OUT
    if path.suffix.lower() not in FORMATS:
        raise LgvitError(f"--out {path}: the file must end in {', '.join(FORMATS)}")
    if labels is not None and len(labels) != len(run_dirs):
        raise LgvitError(f"--labels gives {len(labels)} names for {len(run_dirs)} runs")
    runs = [read_metrics(r) for r in run_dirs]  # every run checked before anything is drawn
    plt = need_matplotlib()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6), dpi=110,
                             layout="constrained")  # fmt: skip
    colors = plt.get_cmap("tab10").colors
    for i, (rows, label) in enumerate(zip(runs, labels or run_labels(run_dirs), strict=True)):
        color = colors[i % len(colors)]
        epochs = [r["epoch"] + 1 for r in rows]
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            ys = [r.get(key) for r in rows]
            if any(y is not None for y in ys):
                ax.plot(epochs, ys, color=color, marker="." if len(rows) < 40 else None,
                        label=label)  # fmt: skip
            ema = [r.get(key.replace("test_", "test_ema_")) for r in rows]
            if key.startswith("test_") and any(y is not None for y in ema):
                ax.plot(epochs, ema, color=color, linestyle="--", label=f"{label} (EMA)")
        best = max(rows, key=lambda r: r.get("test_acc1", float("-inf")))
        if "test_acc1" in best:
            axes[0].plot(best["epoch"] + 1, best["test_acc1"], marker="*", markersize=13,
                         color=color, markeredgecolor="black", linestyle="none")  # fmt: skip
            axes[0].annotate(
                f"best {best['test_acc1']:.2f}% (epoch {best['epoch'] + 1})",
                (best["epoch"] + 1, best["test_acc1"]), textcoords="offset points",
                xytext=(-8, -16 - 11 * i), ha="right", fontsize=7, color=color,
            )  # fmt: skip
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set_xlabel("epoch")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(", ".join(labels or run_labels(run_dirs)), fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    with plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text (editable, searchable)
        fig.savefig(path)
    plt.close(fig)
    return path
