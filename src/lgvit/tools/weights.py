"""``lgvit weights list | download | convert``: the authors' released weights from the command line
(the table is :mod:`lgvit.models.weights`, the cache :mod:`lgvit.models.download`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lgvit.core.errors import LgvitError
from lgvit.models.download import (
    ENV_DIR,
    cached_file,
    fetch,
    file_sha256,
    quiet_left_out,
    read_record,
    weights_dir,
)
from lgvit.models.weights import (
    WEIGHTS,
    Weights,
    find_weights,
    resolve_weights,
    split_tag,
    weights_of,
)
from lgvit.task_table import get_task

LSA_NOTE = (
    "The LSA authors' models are only in a Google Drive folder (linked from "
    "github.com/shellysheynin/Locally-SAG-Transformer): download them by hand and pass "
    "checkpoint_path=FILE (--checkpoint FILE)."
)


def entry(name: str) -> Weights:
    """``model.tag``, or a bare model name: its first released weights."""
    w = find_weights(name)
    if w is not None:
        return w
    model, tag = split_tag(name)
    released = weights_of(model)
    if tag or not released:
        from lgvit.models import is_model

        if not tag and not is_model(model):
            raise LgvitError(f"unknown model {model!r}; `lgvit weights list` lists the weights")
        resolve_weights(name)  # raises: which names have weights
    return released[0]


def verifier(w: Weights) -> Callable[[Path], Any]:
    """Loads a downloaded file strictly into the model ``w`` belongs to (as registered)."""
    from lgvit.dense.pretrained import verifier as released_verifier
    from lgvit.tasks.dispatch import BUILD_RELEASED

    task = get_task(w.task)
    return released_verifier(w, BUILD_RELEASED[task.name] if task.dense else None)


def _row(w: Weights, cache_dir: str | None) -> dict[str, Any]:
    path = cached_file(w, cache_dir)
    rec = read_record(path) if path.is_file() else None
    return dict(
        name=w.name, model=w.model, tag=w.tag, task=w.task, detector=w.detector,
        dataset=w.dataset, num_classes=w.num_classes, url=w.url, license=w.license,
        origin_url=w.origin_url, paper_ids=w.paper_ids, metrics=w.metrics,
        cached=str(path) if path.is_file() else None, sha256=(rec or {}).get("sha256"),
    )  # fmt: skip


def list_weights(as_json: bool = False, cache_dir: str | None = None) -> int:
    rows = [_row(w, cache_dir) for w in WEIGHTS]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    head = f"{'weights':34s} {'task':22s} {'reported':30s} {'licence':10s} cached"
    print(head)
    print("-" * len(head))
    for w, r in zip(WEIGHTS, rows, strict=True):
        task = f"{w.task} ({w.detector})" if w.detector else w.task
        print(f"{w.name:34s} {task:22s} {w.describe_metrics():30s} {w.license:10s} "
              f"{'yes' if r['cached'] else '-'}")  # fmt: skip
    where = "" if cache_dir else f" (${ENV_DIR} if set, else torch hub's checkpoints)"
    print(f"cache: {weights_dir(cache_dir)}{where}")
    print(LSA_NOTE)
    return 0


def download_weights(names: list[str], cache_dir: str | None = None) -> int:
    """Download (and check) each of ``names``; print each cached file's path."""
    for name in names:
        w = entry(name)
        print(fetch(w, verifier(w), cache_dir).path)
    return 0


def convert_weights(source: str, out: str, model_name: str | None = None) -> int:
    """``source`` (released weights by name, or a file with ``--model``) -> a hub folder:
    ``model.safetensors``, ``config.json`` and a ``README.md`` model card."""
    from lgvit.models import create_model
    from lgvit.models.hub import save_pretrained, write_model_card

    if not Path(source).exists() and (find_weights(source) or "." not in source):
        w = entry(source)
        if get_task(w.task).dense:
            raise LgvitError(
                f"{w.name} is a {w.task} model; the hub layout holds classification models "
                f"(evaluate it with lgvit eval --checkpoint {w.name})"
            )
        model = create_model(w.name, pretrained=True)
        path = cached_file(w)
        origin, sha = w.url, (read_record(path) or {}).get("sha256") or file_sha256(path)
    else:
        if model_name is None:
            raise LgvitError(f"{source}: pass --model NAME, the architecture of the file")
        with quiet_left_out():
            model = create_model(model_name, checkpoint_path=source)
        origin, sha = Path(source).name, file_sha256(Path(source))
        _claim_release(model, model_name, Path(source), sha)
    folder = save_pretrained(model, out)
    write_model_card(model, folder, origin, sha)
    print(os.fspath(folder))
    return 0


def _claim_release(model: Any, model_name: str, path: Path, sha: str) -> None:
    """A file by hand is named as released weights only when it is one: its sha256 is the one
    pinned or recorded in the cache for the release of that file name (a fine-tuned file of the
    same name gets a plain card)."""
    for w in weights_of(model_name):
        if not get_task(w.task).dense and w.filename == path.name:
            known = w.sha256 or (read_record(cached_file(w)) or {}).get("sha256")
            if known == sha:
                model.pretrained_cfg.update(w.pretrained_cfg(), num_classes=model.num_classes)


def run(args: Any) -> int:
    """The ``lgvit weights`` subcommands."""
    if args.weights_command == "list":
        return list_weights(args.json, args.cache_dir)
    if args.weights_command == "download":
        return download_weights(args.names, args.cache_dir)
    return convert_weights(args.source, args.out, args.model)
