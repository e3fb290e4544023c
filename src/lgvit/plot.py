"""Training curves as PNG, drawn with Pillow (no plotting library needed)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

from lgvit.errors import LgvitError

W, H, PAD = 640, 360, 48
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
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


def line_chart(title: str, xs: list[float], series: dict[str, list[float]], path: Path) -> None:
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    vals = [v for ys in series.values() for v in ys]
    lo, hi = min(vals), max(vals)
    if hi == lo:
        hi = lo + 1.0
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def pt(x: float, y: float) -> tuple[float, float]:
        return (
            PAD + (x - x0) / (x1 - x0) * (W - 2 * PAD),
            H - PAD - (y - lo) / (hi - lo) * (H - 2 * PAD),
        )

    g.rectangle([PAD, PAD, W - PAD, H - PAD], outline="black")
    for i in range(5):  # y grid with labels
        y = lo + (hi - lo) * i / 4
        _, py = pt(x0, y)
        g.line([PAD, py, W - PAD, py], fill="#dddddd")
        g.text((4, py - 6), f"{y:.3g}", fill="black")
    g.text((PAD, 8), title, fill="black")
    g.text((W // 2 - 16, H - PAD + 16), "epoch", fill="black")
    g.text((PAD, H - PAD + 4), f"{x0:g}", fill="black")
    g.text((W - PAD - 16, H - PAD + 4), f"{x1:g}", fill="black")
    for (name, ys), color in zip(series.items(), COLORS, strict=False):
        pts = [pt(x, y) for x, y in zip(xs, ys, strict=True)]
        if len(pts) > 1:
            g.line(pts, fill=color, width=2)
        for px, py in pts:
            g.ellipse([px - 2, py - 2, px + 2, py + 2], fill=color)
        ly = PAD + 6 + 14 * list(series).index(name)
        g.line([W - PAD - 120, ly + 6, W - PAD - 100, ly + 6], fill=color, width=2)
        g.text((W - PAD - 96, ly), name, fill="black")
    img.save(path)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``loss.png``, ``accuracy.png`` and ``lr.png`` into the run directory."""
    rows = read_metrics(run_dir)
    run = Path(run_dir)
    xs = [r["epoch"] + 1 for r in rows]
    out = []
    charts = {
        "loss.png": ("loss", {"train": "train_loss", "test": "test_loss"}),
        "accuracy.png": ("test accuracy (%)", {"top-1": "test_acc1", "top-5": "test_acc5"}),
        "lr.png": ("learning rate (end of epoch)", {"lr": "lr"}),
    }
    for fname, (title, keys) in charts.items():
        series = {label: [r[k] for r in rows] for label, k in keys.items() if k in rows[0]}
        if series:
            line_chart(title, xs, series, run / fname)
            out.append(run / fname)
    return out
