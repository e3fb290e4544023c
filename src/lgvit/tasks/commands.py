"""What ``lgvit eval`` and ``lgvit predict`` do alike for every task, so each task's ``cli``
keeps only its own steps and words.

eval: the ``--data`` a task evaluates on (:func:`check_data`), the data's classes against the
checkpoint's with ``--any-classes`` (:func:`check_classes`), the ``--predictions`` path checked
before the evaluation runs (:func:`check_predictions_path`), the model's device and ``--amp``
resolved there (:class:`EvalDevice`), and the ending: the result's common keys
(:func:`add_eval_keys`), JSON with ``--json`` or the task's lines (:func:`report_eval`).

predict: the images (:func:`expand_images`), ``--out`` (:func:`require_out`,
:func:`images_with_outputs`: the folder created, a distinct name per input), the PNGs written
(:func:`save_png`, :func:`palette`), its precision (:data:`PREDICT_AMP`) and the ending with its
exit status (:func:`report_predictions`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

from lgvit.core.constants import IMAGE_EXTENSIONS
from lgvit.core.errors import LgvitError
from lgvit.core.runtime import Dist, precision_name, resolve_amp

# --------------------------------------------------------------------------------- eval


def check_data(args: argparse.Namespace, model_words: str, datasets: Sequence[str]) -> None:
    """``--data`` must be one the checkpoint's task evaluates on: one line naming them."""
    if args.data in datasets:
        return
    if len(datasets) == 1:
        wanted = f"--data {datasets[0]}"
    elif len(datasets) == 2:
        wanted = " or ".join(datasets)
    else:
        wanted = f"one of {', '.join(datasets)}"
    raise LgvitError(f"{args.checkpoint} is {model_words}; evaluate it on {wanted}")


def check_classes(
    any_classes: bool,
    outputs: int,
    trained: Sequence[Any] | None,
    data: Sequence[Any],
    count_line: Callable[[], str],
    names_line: Callable[[], str],
) -> None:
    """The data's classes (names, or COCO ids) against the checkpoint's: as many as the model
    has ``outputs`` always (``--any-classes`` too: label i is class i), and ``trained``, the
    ones the checkpoint names, in order, unless ``any_classes`` (a checkpoint that names none
    is held to the count). The lines are the task's words, formed only for a mismatch."""
    if len(data) != outputs:
        raise LgvitError(count_line())
    if trained and list(trained) != list(data) and not any_classes:
        raise LgvitError(names_line())


def check_predictions_path(path: str | None) -> None:
    """``--predictions``, when given, must be writable: checked before the whole evaluation
    runs, not after it."""
    if path:
        from lgvit.core.atomic import check_writable

        check_writable(path, "--predictions")


class EvalDevice:
    """Where an evaluation runs: the model's device (``--device``: where loading put it) and
    ``--amp`` resolved there on first use (:attr:`amp`), where the task's evaluation starts,
    so a refused ``--amp`` or bf16's emulation warning comes after the task's own checks."""

    def __init__(self, args: argparse.Namespace, model: nn.Module) -> None:
        self.device: torch.device = next(model.parameters()).device
        self._amp_flag: str = args.amp

    @cached_property
    def amp(self) -> torch.dtype | None:
        return resolve_amp(self._amp_flag, self.device)

    @property
    def dist(self) -> Dist:
        """One process on the device (``lgvit eval`` runs no torchrun)."""
        return Dist(device=self.device)

    @property
    def precision(self) -> str:
        """What ran, in the result's words (``fp32``, ``bf16 autocast``)."""
        return precision_name(self.amp)


def add_eval_keys(res: dict[str, Any], args: argparse.Namespace, images: int, **keys: Any) -> None:
    """The keys every task's result carries (the checkpoint, ``--data``, the split's image
    count), then the task's ``keys``, in the order ``--json`` prints them."""
    res.update(checkpoint=str(args.checkpoint), data=args.data, images=images, **keys)


def report_eval(
    args: argparse.Namespace, res: dict[str, Any], show: Callable[[dict[str, Any]], None]
) -> int:
    """``lgvit eval``'s ending: the result as JSON with ``--json``, else the task's lines
    (``show``); exit status 0."""
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        show(res)
    return 0


# ------------------------------------------------------------------------------ predict

PREDICT_AMP: torch.dtype | None = None  # predict takes no --amp: full precision


def predict_precision() -> str:
    """What predict runs in, in a result's words."""
    return precision_name(PREDICT_AMP)


def expand_images(paths: Sequence[str]) -> list[str]:
    """Files as given; a directory stands for the images in it (sorted, not recursive)."""
    out: list[str] = []
    for p in paths:
        if Path(p).is_dir():
            found = sorted(
                str(f) for f in Path(p).iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS
            )
            if not found:
                raise LgvitError(
                    f"{p}: a directory with no image files ({', '.join(IMAGE_EXTENSIONS)})"
                )
            out += found
        else:
            out.append(p)
    return out


def require_out(out: str | None, what: str) -> None:
    """A task whose predict writes files needs ``--out``: one line saying ``what`` it writes."""
    if not out:
        raise LgvitError(f"{what}: pass --out DIR")


def output_dir(path: str) -> Path:
    """``--out``, created (one line when it cannot be)."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LgvitError(f"--out {out}: cannot create it ({e.strerror})") from None
    return out


def output_stems(paths: Sequence[str]) -> list[str]:
    """A distinct name per input for the files ``predict --out`` writes: the file's stem where
    no other input has it, else the stem and its suffix (``x.png``, ``x.jpg``: ``x_png``,
    ``x_jpg``), then a count in input order (``a/x.png``, ``b/x.png``: ``x_png``,
    ``x_png_2``). Compared case-blind: a case-insensitive disk holds one of ``X`` and ``x``."""
    stems = [Path(p).stem for p in paths]
    seen = Counter(s.casefold() for s in stems)
    names: list[str | None] = [s if seen[s.casefold()] == 1 else None for s in stems]
    taken = {n.casefold() for n in names if n is not None}
    for i, path in enumerate(paths):
        if names[i] is not None:
            continue
        suffix = Path(path).suffix.lstrip(".").lower()
        base = f"{stems[i]}_{suffix}" if suffix else stems[i]
        name, k = base, 1
        while name.casefold() in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name.casefold())
        names[i] = name
    return [n for n in names if n is not None]


def read_images(
    paths: Sequence[str], failed: list[str], upright: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, uint8 (3, H, W))`` of each readable image (``upright=False``: as stored, its EXIF
    orientation ignored); each unreadable one's line is appended to ``failed`` (for
    :func:`report_predictions`)."""
    from lgvit.data.decode import read_image_rgb

    for path in paths:
        try:
            yield path, read_image_rgb(path, upright)
        except LgvitError as e:
            failed.append(str(e))


def images_with_outputs(
    images: Sequence[str], out: str, failed: list[str], upright: bool = True
) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """``(path, out / NAME, uint8 (3, H, W))`` of each readable image of ``images`` (from
    :func:`expand_images`), ``--out`` created and NAME distinct per input
    (:func:`output_stems`: a.png, a.jpg and b/a.png must not write the same files); each
    unreadable image's line is appended to ``failed``; ``upright`` as :func:`read_images`."""
    folder = output_dir(out)
    for path, stem in zip(images, output_stems(images), strict=True):
        for _, img in read_images([path], failed, upright):
            yield path, folder / stem, img


def save_png(img: Image.Image, path: Path, orientation: int = 1) -> None:
    """``img`` as a PNG at ``path``, atomically; an EXIF ``orientation`` tag other than 1 kept."""
    import io

    from lgvit.core.atomic import atomic_write_bytes
    from lgvit.data.decode import EXIF_ORIENTATION

    buf = io.BytesIO()
    if orientation != 1:
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = orientation
        img.save(buf, format="PNG", exif=exif)
    else:
        img.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())


def palette(n: int) -> np.ndarray:
    """``(n, 3)`` uint8 colours, distinct and stable (the PASCAL VOC bit pattern)."""
    out = np.zeros((n, 3), dtype=np.uint8)
    for i in range(n):
        c, r, g, b = i + 1, 0, 0, 0
        for k in range(8):
            r |= ((c >> 0) & 1) << (7 - k)
            g |= ((c >> 1) & 1) << (7 - k)
            b |= ((c >> 2) & 1) << (7 - k)
            c >>= 3
        out[i] = (r, g, b)
    return out


def report_predictions(
    results: list[dict[str, Any]],
    failed: list[str],
    as_json: bool,
    line: Callable[[dict[str, Any]], str],
) -> int:
    """``lgvit predict``'s ending: every unreadable image a line on stderr (skipped, also when
    no image was readable), the results as JSON (each with its precision) or ``line(result)``
    each after a line naming the precision that ran; exit status 1 when an image was
    skipped."""
    precision = predict_precision()
    for msg in failed:
        print(f"lgvit predict: skipped: {msg}", file=sys.stderr)
    for r in results:
        r["precision"] = precision
    if as_json:
        print(json.dumps(results, indent=2))
    elif results:
        print(f"precision: {precision}")
        for r in results:
            print(line(r))
    return 1 if failed else 0
