"""``lgvit viz``: what the locality mechanisms learned, on real images, as PNGs.

* ``lsa-shifts`` (LSA): at every grid position, the local attention weights over the T shifted
  variants -- the dominant shift as a map, the attention entropy, one map per shift.
* ``dtm-offsets`` (LIT): where three chained deformable token merging modules sample for chosen
  output positions (4^3 locations), beside the regular 2x2 grid they would sample without
  offsets.
* ``attention`` (any model with global attention): a query pixel's attention probabilities for
  every head at the first and last block of every stage, averaged over the images; and the
  attention rollout of the last stage.

Attention is captured with a flag on the attention modules (:func:`capture_attention`): the
probabilities are recomputed from the same ``q``/``k`` next to the fused kernel, so the forward
pass is the one that always runs, and costs nothing when nothing is captured.

Needs matplotlib (``pip install 'lgvit[viz]'``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from lgvit.core.errors import LgvitError
from lgvit.models.layers import Attention, DeformableTokenMerging, Grid, WindowAttention

KINDS = ("lsa-shifts", "dtm-offsets", "attention")


def need_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line error saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "plots need matplotlib, which is not installed: pip install 'lgvit[viz]'"
        raise LgvitError(msg) from None
    return plt


# ---------------------------------------------------------------------------------------------
# Capturing
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def capture_attention(
    modules: Sequence[Attention],
) -> Iterator[list[list[tuple[torch.Tensor, Grid | None]]]]:
    """Inside the block, every call of each module appends ``(probabilities, grid)`` to its list
    (``probabilities (B, heads, queries, keys)``, float32); the flags are cleared on exit."""
    lists: list[list[tuple[torch.Tensor, Grid | None]]] = [[] for _ in modules]
    for m, store in zip(modules, lists, strict=True):
        m.captured = store
    try:
        yield lists
    finally:
        for m in modules:
            m.captured = None


def _shift_attention(model: nn.Module) -> Attention:
    from lgvit.models.lsa import LocalShiftAttention

    found = [m for m in model.modules() if isinstance(m, LocalShiftAttention)]
    if not found:
        raise LgvitError(
            f"{_name(model)} has no local attention over shifted variants: "
            "--what lsa-shifts needs an LSA model with shifts"
        )
    return found[0]


def _global_attentions(model: nn.Module) -> list[tuple[int, int, Attention]]:
    """``(stage, block, module)`` of every attention over a whole token grid."""
    from lgvit.models.lsa import LocalShiftAttention

    out = []
    for name, m in model.named_modules():
        if isinstance(m, Attention) and not isinstance(m, LocalShiftAttention | WindowAttention):
            parts = name.split(".")
            if "stages" in parts and "blocks" in parts:
                stage = int(parts[parts.index("stages") + 1])
                block = int(parts[parts.index("blocks") + 1])
            elif "blocks" in parts:  # one-stage models (DeiT, T2T): blocks.<i>
                stage, block = 0, int(parts[parts.index("blocks") + 1])
            else:
                continue
            out.append((stage, block, m))
    if not out:
        raise LgvitError(
            f"{_name(model)} has no global attention (windows or MLP-only stages): "
            "--what attention needs a model that attends over a whole stage"
        )
    return out


def _name(model: nn.Module) -> str:
    return getattr(model, "model_name", type(model).__name__)


def _split_prefix(probs: torch.Tensor, grid: Grid | None) -> tuple[torch.Tensor, Grid, Grid]:
    """Drop class-token rows/columns; the query and key grids of the image tokens."""
    n, m = probs.shape[-2:]
    if grid is None:  # a one-stage ViT: a square grid after its prefix tokens
        side = math.isqrt(n)
        grid = (side, side)
    prefix = n - grid[0] * grid[1]
    probs = probs[..., prefix:, :]
    keys = m - prefix
    if keys == grid[0] * grid[1]:
        kgrid = grid
    else:  # spatial-reduction attention: keys on a coarser grid of the same shape
        r = round(math.sqrt(grid[0] * grid[1] / keys))
        kgrid = (grid[0] // r, grid[1] // r)
    probs = probs[..., m - kgrid[0] * kgrid[1] :]
    return probs, grid, kgrid


# ---------------------------------------------------------------------------------------------
# Drawing helpers
# ---------------------------------------------------------------------------------------------


def display_images(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The preprocessed batch back in ``[0, 1]`` (what the model saw), ``(N, H, W, 3)``."""
    cfg = model.pretrained_cfg
    mean = torch.tensor(cfg["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(cfg["std"]).view(1, -1, 1, 1)
    return (x * std + mean).clamp(0, 1).permute(0, 2, 3, 1)


def _show(ax: Any, image: torch.Tensor, title: str) -> None:
    h, w = image.shape[:2]
    ax.imshow(image.numpy(), extent=(0, w, h, 0), interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _overlay(ax: Any, image: torch.Tensor, grid_map: torch.Tensor, title: str, **kw: Any) -> Any:
    """``grid_map (h, w)`` stretched over the image, semi-transparent; returns the artist."""
    h, w = image.shape[:2]
    ax.imshow(image.numpy(), extent=(0, w, h, 0), interpolation="nearest")
    art = ax.imshow(
        grid_map.numpy(), extent=(0, w, h, 0), alpha=kw.pop("alpha", 0.75), interpolation="nearest",
        **kw,
    )  # fmt: skip
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    return art


def _heatmap(ax: Any, image: torch.Tensor, grid_map: torch.Tensor, title: str, alone: bool) -> Any:
    """A probability map over the image, or alone (``alone``: averaged over several images)."""
    if not alone:
        return _overlay(ax, image, grid_map, title, cmap="inferno", alpha=0.75, vmin=0)
    h, w = image.shape[:2]
    art = ax.imshow(grid_map.numpy(), extent=(0, w, h, 0), cmap="inferno", vmin=0)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    return art


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=fig.dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# lsa-shifts
# ---------------------------------------------------------------------------------------------


def shift_weights(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Grid]:
    """``(B, heads, h, w, T)``: each grid position's local attention weights over the shifts."""
    attn = _shift_attention(model)
    with torch.inference_mode(), capture_attention([attn]) as (store,):
        model(x)
    probs = store[0][0]  # (B, heads, N, T)
    B, H, N, T = probs.shape
    grid = tuple(model.grids[0])  # the stem's grid at the model's input size
    if grid[0] * grid[1] != N:
        raise LgvitError(f"{_name(model)}: {N} local-attention positions, not a {grid} grid")
    return probs.view(B, H, grid[0], grid[1], T), grid


def plot_lsa_shifts(
    model: nn.Module, x: torch.Tensor, stems: Sequence[str], out: Path, per_head: bool = False
) -> list[Path]:
    plt = need_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap

    weights, grid = shift_weights(model, x)
    images = display_images(model, x)
    shifts = _shift_attention_shifts(model)
    T = len(shifts)
    cmap = ListedColormap(plt.get_cmap("tab20" if T > 10 else "tab10").colors[:T])
    norm = BoundaryNorm([i - 0.5 for i in range(T + 1)], T)
    paths = []
    for i, stem in enumerate(stems):
        heads = [(None, weights[i].mean(0))]
        if per_head:
            heads += [(h, weights[i, h]) for h in range(weights.shape[1])]
        for head, w in heads:  # w: (h, w, T)
            cols = min(T, 6)
            rows = math.ceil(T / cols)
            fig = plt.figure(figsize=(12, 3.6 + 2.0 * rows), dpi=110, layout="constrained")
            top, bottom = fig.subfigures(2, 1, height_ratios=[3.4, 2.0 * rows])
            axes = top.subplots(1, 3)
            who = "mean over heads" if head is None else f"head {head}"
            _show(axes[0], images[i], f"{stem} (as the model sees it)")
            art = _overlay(axes[1], images[i], w.argmax(-1).float(), "dominant shift per position",
                           cmap=cmap, norm=norm)  # fmt: skip
            bar = top.colorbar(art, ax=axes[1], ticks=range(T), fraction=0.05)
            bar.ax.set_yticklabels([f"{dy:+d},{dx:+d}" for dy, dx in shifts], fontsize=6)
            bar.set_label("shift (dy, dx)", fontsize=7)
            entropy = -(w * w.clamp_min(1e-12).log()).sum(-1)
            title = f"attention entropy (uniform = ln {T} = {math.log(T):.2f})"
            art = _overlay(axes[2], images[i], entropy, title, cmap="magma", vmin=0,
                           vmax=math.log(T))  # fmt: skip
            top.colorbar(art, ax=axes[2], fraction=0.05).set_label("nats", fontsize=7)
            small = bottom.subplots(rows, cols, squeeze=False).ravel()
            vmax = float(w.max())
            for t, ax in enumerate(small):
                ax.set_xticks([])
                ax.set_yticks([])
                if t >= T:
                    ax.axis("off")
                    continue
                dy, dx = shifts[t]
                art = ax.imshow(w[..., t].numpy(), cmap="viridis", vmin=0, vmax=vmax)
                ax.set_title(f"weight of shift ({dy:+d}, {dx:+d})", fontsize=8)
            bottom.colorbar(art, ax=small.tolist(), fraction=0.02).set_label("weight", fontsize=7)
            fig.suptitle(
                f"{_name(model)}: local attention over {T} shifted copies at each of the "
                f"{grid[0]}x{grid[1]} positions ({who})",
                fontsize=10,
            )
            tag = "" if head is None else f"_head{head}"
            paths.append(_save(fig, out / f"{stem}_lsa_shifts{tag}.png"))
    return paths


def _shift_attention_shifts(model: nn.Module) -> tuple[tuple[int, int], ...]:
    embed = getattr(model, "patch_embed", None)
    return tuple(getattr(embed, "shifts", ()))


# ---------------------------------------------------------------------------------------------
# dtm-offsets
# ---------------------------------------------------------------------------------------------


def dtm_offsets(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every deformable merge's sampling offsets ``(B, k*k, 2 (dy, dx), Ho, Wo)``, first merge
    first."""
    merges = [m for m in model.modules() if isinstance(m, DeformableTokenMerging)]
    if not merges:
        raise LgvitError(
            f"{_name(model)} has no deformable token merging: --what dtm-offsets needs a LIT model"
        )
    offsets: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple) -> None:
        tokens, hw = args[0], args[1]
        o = module.offsets(tokens, hw)
        k = module.offset_conv.kernel_size[0]
        offsets.append(o.view(o.shape[0], k * k, 2, *o.shape[-2:]).float())

    handles = [m.register_forward_pre_hook(grab) for m in merges]
    try:
        with torch.inference_mode():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return offsets


def sampling_locations(
    offsets: Sequence[torch.Tensor], position: tuple[int, int], kernel: int = 2
) -> torch.Tensor:
    """Where the chained merges sample, in the first merge's input grid, for one output
    ``position`` of the last merge: ``(n, 2)`` (y, x), n = (k*k)^levels minus points that leave
    a map. ``offsets``: one image's ``(k*k, 2, Ho, Wo)`` per merge, first merge first.

    Each level maps a point p of its output grid to the k*k points ``k*p + (ky, kx) + offset``
    of its input grid; an intermediate point is rounded to the nearest position to read that
    position's offsets (as the LIT authors' figure does)."""
    points = torch.tensor([position], dtype=torch.float32)
    taps = torch.stack(
        torch.meshgrid(torch.arange(kernel), torch.arange(kernel), indexing="ij"), -1
    ).view(-1, 2)
    for level, off in enumerate(reversed(offsets)):
        Ho, Wo = off.shape[-2:]
        if level:  # points from the level above live in this level's output grid
            points = points.round()
            ok = (points[:, 0] >= 0) & (points[:, 0] < Ho) & (points[:, 1] >= 0)
            points = points[ok & (points[:, 1] < Wo)]
        p = points.long()
        o = off[:, :, p[:, 0], p[:, 1]].permute(2, 0, 1)  # (n, k*k, 2)
        points = (kernel * points[:, None] + taps + o).reshape(-1, 2)
    return points


def plot_dtm_offsets(
    model: nn.Module,
    x: torch.Tensor,
    stems: Sequence[str],
    out: Path,
    positions: Sequence[tuple[int, int]] = (),
) -> list[Path]:
    plt = need_matplotlib()
    offsets = dtm_offsets(model, x)
    images = display_images(model, x)
    Ho, Wo = offsets[-1].shape[-2:]
    positions = list(positions) or _default_positions(Ho, Wo)
    for y, xx in positions:
        if not (0 <= y < Ho and 0 <= xx < Wo):
            raise LgvitError(f"--positions {y},{xx} is outside the last merge's {Ho}x{Wo} grid")
    H, W = x.shape[-2:]
    g0 = offsets[0].shape[-2] * 2, offsets[0].shape[-1] * 2  # first merge's input grid
    sy, sx = H / g0[0], W / g0[1]  # pixels per token of that grid
    paths = []
    for i, stem in enumerate(stems):
        fig, axes = plt.subplots(
            1, len(positions), figsize=(3.6 * len(positions), 4.0), dpi=110, layout="constrained",
            squeeze=False,
        )  # fmt: skip
        for ax, (y, xx) in zip(axes[0], positions, strict=True):
            learned = sampling_locations([o[i] for o in offsets], (y, xx))
            regular = sampling_locations([torch.zeros_like(o[i]) for o in offsets], (y, xx))
            _show(ax, images[i], f"output position ({y}, {xx})")
            regular_style = dict(s=14, facecolors="none", edgecolors="white", linewidths=0.8)
            ax.scatter(*_pixels(regular, sy, sx), label="regular 2x2 merging", **regular_style)
            ax.scatter(*_pixels(learned, sy, sx), s=9, c="red", label="deformable (learned)")
            cell = H / Ho, W / Wo
            ax.add_patch(
                plt.Rectangle((xx * cell[1], y * cell[0]), cell[1], cell[0], fill=False,
                              edgecolor="lime", linewidth=1.5, label="output token's patch")
            )  # fmt: skip
            ax.set_xlim(0, W)
            ax.set_ylim(H, 0)
        axes[0][0].legend(loc="lower left", fontsize=6, framealpha=0.7)
        fig.suptitle(
            f"{_name(model)}: sampling locations of {len(offsets)} chained deformable token "
            f"merges ({4 ** len(offsets)} per output token) on {stem}",
            fontsize=10,
        )
        paths.append(_save(fig, out / f"{stem}_dtm_offsets.png"))
    return paths


def _pixels(points: torch.Tensor, sy: float, sx: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid points (y, x) -> pixel coordinates (x, y) of their centres."""
    return (points[:, 1] + 0.5) * sx, (points[:, 0] + 0.5) * sy


def _default_positions(h: int, w: int) -> list[tuple[int, int]]:
    if h * w <= 4:  # a small last grid (CIFAR-sized inputs): every output token
        return [(y, x) for y in range(h) for x in range(w)]
    pts = [(h // 2, w // 2), (h // 4, w // 4), (h - 1 - h // 4, w - 1 - w // 4)]
    return list(dict.fromkeys(pts))


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def stage_attention(
    model: nn.Module, x: torch.Tensor
) -> dict[tuple[int, int], tuple[torch.Tensor, Grid, Grid]]:
    """``(stage, block) -> (probabilities (heads, Nq, Nk) averaged over the batch, query grid,
    key grid)``, image tokens only (class token rows and columns dropped)."""
    found = _global_attentions(model)
    with torch.inference_mode(), capture_attention([m for _, _, m in found]) as lists:
        model(x)
    out = {}
    for (stage, block, _), store in zip(found, lists, strict=True):
        if store:
            probs, grid, kgrid = _split_prefix(*store[0])
            out[stage, block] = (probs.mean(0), grid, kgrid)
    return out


def attention_rollout(maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """Abnar & Zuidema's rollout over consecutive blocks on one grid: the product of
    ``0.5 * mean_heads(A) + 0.5 * I`` (rows renormalised), first block applied first."""
    n = maps[0].shape[-1]
    out = torch.eye(n)
    for a in maps:
        a = 0.5 * a.mean(0) + 0.5 * torch.eye(n)
        out = (a / a.sum(-1, keepdim=True)) @ out
    return out


def plot_attention(
    model: nn.Module,
    x: torch.Tensor,
    stems: Sequence[str],
    out: Path,
    query: tuple[int, int] | None = None,
) -> list[Path]:
    plt = need_matplotlib()
    maps = stage_attention(model, x)
    image = display_images(model, x)[0]
    averaged = len(x) > 1  # maps over several images: drawn alone, not over one of them
    H, W = x.shape[-2:]
    qy, qx = query if query is not None else (H // 2, W // 2)
    if not (0 <= qy < H and 0 <= qx < W):
        raise LgvitError(f"--query {qy},{qx} is outside the {H}x{W} input")
    stages = sorted({s for s, _ in maps})
    chosen = [
        (s, b) for s in stages for b in sorted({min(b for t, b in maps if t == s),
                                                max(b for t, b in maps if t == s)})
    ]  # fmt: skip
    heads = max(maps[k][0].shape[0] for k in chosen)
    fig, axes = plt.subplots(
        len(chosen), heads + 1, figsize=(1.9 * (heads + 1), 2.0 * len(chosen)), dpi=110,
        layout="constrained", squeeze=False,
    )  # fmt: skip
    what = stems[0] if len(x) == 1 else f"{len(x)} images"
    for row, key in zip(axes, chosen, strict=True):
        probs, grid, kgrid = maps[key]
        gy, gx = qy * grid[0] // H, qx * grid[1] // W
        on = f" on {stems[0]}" if averaged else ""
        _show(row[0], image, f"stage {key[0] + 1} block {key[1] + 1}\nquery ({qy}, {qx}){on}")
        row[0].add_patch(
            plt.Rectangle((gx * W / grid[1], gy * H / grid[0]), W / grid[1], H / grid[0],
                          fill=False, edgecolor="lime", linewidth=1.5)
        )  # fmt: skip
        for h, ax in enumerate(row[1:]):
            if h >= probs.shape[0]:
                ax.axis("off")
                continue
            m = probs[h, gy * grid[1] + gx].view(kgrid)
            art = _heatmap(ax, image, m, f"head {h + 1}", averaged)
        fig.colorbar(art, ax=row[-1], fraction=0.05).set_label("probability", fontsize=7)
    fig.suptitle(
        f"{_name(model)}: attention probabilities of the query token (green) per head, "
        f"{'on' if len(x) == 1 else 'averaged over'} {what}",
        fontsize=10,
    )
    paths = [_save(fig, out / "attention.png")]
    last = stages[-1]
    blocks = [maps[last, b] for b in sorted(b for s, b in maps if s == last)]
    roll = attention_rollout([p for p, _, _ in blocks])
    grid = blocks[0][1]
    gy, gx = qy * grid[0] // H, qx * grid[1] // W
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.3), dpi=110, layout="constrained")
    _show(axes[0], image, stems[0] if not averaged else f"{stems[0]} (1 of {len(x)})")
    art = _heatmap(axes[1], image, roll[gy * grid[1] + gx].view(grid),
                   f"rollout for query ({qy}, {qx})", averaged)  # fmt: skip
    fig.colorbar(art, ax=axes[1], fraction=0.05)
    art = _heatmap(axes[2], image, roll.mean(0).view(grid), "rollout, mean over queries\n"
                   "(what average pooling draws on)", averaged)  # fmt: skip
    fig.colorbar(art, ax=axes[2], fraction=0.05)
    fig.suptitle(
        f"{_name(model)}: attention rollout over the {len(blocks)} blocks of stage {last + 1}"
        + ("" if len(x) == 1 else f", averaged over {len(x)} images"),
        fontsize=10,
    )
    paths.append(_save(fig, out / "attention_rollout.png"))
    return paths


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def visualize(
    checkpoint: str,
    images: Sequence[str],
    what: str,
    out: str | Path = "viz",
    per_head: bool = False,
    query: tuple[int, int] | None = None,
    positions: Sequence[tuple[int, int]] = (),
    device: str = "cpu",
    model_name: str | None = None,
) -> list[Path]:
    """Load ``checkpoint`` (or a registered name: random weights; a ``.pth`` state dict such
    as the authors' releases with ``model_name``), run it on ``images`` and write the ``what``
    figures into ``out``; returns the paths written."""
    if what not in KINDS:
        raise LgvitError(f"--what {what!r}: choose one of {', '.join(KINDS)}")
    need_matplotlib()
    from lgvit.inference import preprocess_images, resolve_device
    from lgvit.tools.export import load_source

    device = resolve_device(device)  # CUDA asked for and absent, or a bogus name: one line
    model, _ = load_source(checkpoint, model_name=model_name)
    model = model.to(device).eval()
    x = preprocess_images(model, images).to(device)
    stems = _unique_stems(images)
    out = Path(out)
    if what == "lsa-shifts":
        return plot_lsa_shifts(model, x, stems, out, per_head)
    if what == "dtm-offsets":
        return plot_dtm_offsets(model, x, stems, out, positions)
    return plot_attention(model, x, stems, out, query)


def _unique_stems(paths: Sequence[str]) -> list[str]:
    stems: list[str] = []
    for p in paths:
        s = Path(p).stem
        stems.append(s if s not in stems else f"{s}_{len(stems)}")
    return stems
