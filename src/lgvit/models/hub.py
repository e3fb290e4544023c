"""Weights in the Hugging Face hub layout that timm uses: a folder with ``config.json``
(``architecture``, ``num_classes``, ``num_features``, ``model_args``, ``label_names`` and
``dataset`` at the top level, timm's ``pretrained_cfg``) and ``model.safetensors``.

- ``save_pretrained(model, DIR)`` (also ``model.save_pretrained(DIR)``) writes it;
- ``create_model("local-dir:DIR")`` builds the architecture named in it and loads the weights;
- ``create_model("hf-hub:ORG/NAME")`` and ``push_to_hub(model, "ORG/NAME")`` do the same through
  ``huggingface_hub`` when it is installed and the hub can be reached; ``push_to_hub`` adds a
  ``README.md`` model card (:func:`model_card`: licence, paper, source, reported accuracy).

This module only reads and writes the layout; building the model is the registry's
(``create_model``), so nothing here imports it. Loading never runs code from the folder:
``config.json`` is JSON and the weights are safetensors.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn as nn

from lgvit.checkpoints.record import is_img_size, is_size, value_problem
from lgvit.core.atomic import atomic_save_safetensors, atomic_write_bytes
from lgvit.core.errors import LgvitError, first_line

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# pretrained_cfg keys written to config.json: timm's only (timm builds its PretrainedCfg from
# them, a TypeError on a key it lacks); the rest of ours stays in the package. Not
# fixed_input_size: timm reads it as "the architecture takes img_size" and passes one to the
# folder's architecture, which fails for one of timm's that takes none (lgvit's take it anyway,
# and the model built carries it in its own pretrained_cfg).
# Where released weights came from (timm's keys), kept so a folder's model card can say it.
_SOURCE_KEYS = ("tag", "license", "origin_url", "paper_ids", "paper_name")
_CFG_KEYS = (
    "input_size", "mean", "std", "crop_pct", "interpolation", "num_classes", "first_conv",
    "classifier", *_SOURCE_KEYS,
)  # fmt: skip
# Written at config.json's top level: the class names where timm writes and reads them, and
# lgvit's own keys, which timm does not read there. Folders lgvit wrote before held both inside
# pretrained_cfg too (read, never written).
_NAMES_KEY = "label_names"
_TOP_KEYS = ("dataset",)
CARD_NAME = "README.md"


def _json_ready(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for a model built by ``create_model``."""
    name = getattr(model, "model_name", None)
    if name is None:
        raise LgvitError("save_pretrained needs a model built by lgvit.create_model")
    args = dict(getattr(model, "model_args", {}))
    bad = [k for k, v in args.items() if not _json_ready(v)]
    if bad:
        raise LgvitError(
            f"{name}: model arguments {', '.join(bad)} are not plain data and cannot go into "
            f"{CONFIG_NAME}; build the model from plain values to save it"
        )
    cfg = {k: v for k, v in model.pretrained_cfg.items() if k in _CFG_KEYS}
    num_classes = getattr(model, "num_classes", cfg.get("num_classes"))
    cfg["num_classes"] = num_classes  # the head's, after a reset_classifier too (timm's)
    config = {
        "architecture": name,
        "num_classes": num_classes,
        "num_features": getattr(model, "num_features", None),
        "global_pool": getattr(model, "global_pool", None) or "avg",
        "model_args": args,
    }
    names = model.pretrained_cfg.get(_NAMES_KEY)
    if names and len(names) == num_classes:  # names of another head describe none (timm's rule)
        config[_NAMES_KEY] = list(names)
    config.update({k: model.pretrained_cfg[k] for k in _TOP_KEYS if model.pretrained_cfg.get(k)})
    config["pretrained_cfg"] = cfg
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # Atomic (with fsync): a reader never sees a half-written file.
    atomic_save_safetensors(state, out / WEIGHTS_NAME, {"format": "pt"})
    atomic_write_bytes(out / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    return out


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise LgvitError(f"{directory}: no {CONFIG_NAME} (not a saved lgvit/timm model folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LgvitError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise LgvitError(f"{path}: a JSON {type(config).__name__}, not an object of keys")
    if "architecture" not in config:  # save_pretrained always writes it; timm needs it too
        raise LgvitError(f"{path}: the key 'architecture' (the model to build) is missing")
    if not isinstance(config["architecture"], str):
        raise LgvitError(f"{path}: architecture {config['architecture']!r} is not a model name")
    _check_config(config, path)
    return config


def _rule(want: str, ok: Callable[[Any], bool]) -> Callable[[Any], str | None]:
    return lambda v: None if ok(v) else want


def _record(key: str) -> Callable[[Any], str | None]:
    """The checkpoint record's rule for the same fact (one home per rule: its record)."""
    return lambda v: value_problem(key, v)


def _interpolation(v: Any) -> str | None:
    from lgvit.data.transforms import INTERPOLATIONS  # the names eval's resize has

    if isinstance(v, str) and v in INTERPOLATIONS:
        return None
    return f"one of {', '.join(INTERPOLATIONS)}"


# What each key of config.json must be (what save_pretrained writes): a rule giving the words of
# what it must be, or None. timm's and older lgvit folders hold label_names and dataset in
# pretrained_cfg too.
_RULES: dict[str, Callable[[Any], str | None]] = {
    "model_args": _record("model_kwargs"),
    "num_classes": lambda v: None if v is None else value_problem("num_classes", v),
    "pretrained_cfg": _rule("an object", lambda v: isinstance(v, dict)),
    "label_names": _record("classes"),
    "dataset": _record("dataset"),
    "model_args.img_size": _rule("a positive integer or a [height, width] pair", is_img_size),
    "pretrained_cfg.mean": _record("mean"),
    "pretrained_cfg.std": _record("std"),
    "pretrained_cfg.input_size": _rule(
        "a list of 3 positive integers",
        lambda v: isinstance(v, list) and len(v) == 3 and all(map(is_size, v)),
    ),
    "pretrained_cfg.crop_pct": _record("crop_pct"),
    "pretrained_cfg.interpolation": _interpolation,
    "pretrained_cfg.dataset": _record("dataset"),
    "pretrained_cfg.label_names": _record("classes"),
}


def _check_config(config: dict[str, Any], path: Path) -> None:
    """A malformed ``config.json`` (a hand edit, another tool's) is one line naming the key."""
    for key, problem in _RULES.items():
        outer, _, inner = key.partition(".")
        holder = config.get(outer) if inner else config
        name = inner or outer
        want = problem(holder[name]) if isinstance(holder, dict) and name in holder else None
        if want is not None:
            raise LgvitError(f"{path}: {key} {str(holder[name])[:60]!r} is not {want}")


FOLDER_PREFIXES = ("local-dir:", "hf-hub:")


def folder_named(source: str | os.PathLike) -> str | None:
    """The folder a command line's checkpoint names, as ``create_model`` takes it
    (``local-dir:DIR`` / ``hf-hub:ORG/NAME``), in any of its forms: those two as they are, a
    folder holding ``config.json``, or its ``model.safetensors`` (with ``config.json`` beside
    it); None for anything else (a checkpoint, a weights file, a name)."""
    text = str(source)
    if text.startswith(FOLDER_PREFIXES):
        return text
    path = Path(text)
    if path.is_dir() and (path / CONFIG_NAME).is_file():
        return f"local-dir:{path}"
    if path.name == WEIGHTS_NAME and path.is_file() and (path.parent / CONFIG_NAME).is_file():
        return f"local-dir:{path.parent}"
    return None


def weights_file(directory: str | os.PathLike) -> Path:
    """The path of a ``save_pretrained`` folder's weights; an error naming the folder if none."""
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise LgvitError(f"{directory}: no {WEIGHTS_NAME}")
    return weights


def _lgvit_key(config: dict[str, Any], key: str, path: Path) -> Any:
    """A key lgvit writes at the top level (older lgvit folders: in ``pretrained_cfg`` too, or
    only there); where both hold it they must agree."""
    top, inner = config.get(key), config.get("pretrained_cfg", {}).get(key)
    if top is not None and inner is not None and top != inner:
        raise LgvitError(
            f"{path}: {key} {_preview(top)} and pretrained_cfg.{key} {_preview(inner)} differ; "
            f"keep one ({key}: where lgvit and timm read it)"
        )
    return inner if top is None else top


def _preview(value: Any, n: int = 3) -> str:
    if not isinstance(value, list):
        return repr(value)[:60]
    return "[" + ", ".join(map(str, value[:n])) + (", ...]" if len(value) > n else "]")


def apply_saved_cfg(
    model: nn.Module, config: dict[str, Any], source: str, resized: bool = False
) -> None:
    """Put the preprocessing and class names the folder carries into ``model.pretrained_cfg``;
    the class names must name every output of the head the weights built, and the input size
    be the one its ``model_args`` build (``resized``: the caller built it at another; the
    model's own is kept)."""
    path = Path(source) / CONFIG_NAME
    cfg = dict(config.get("pretrained_cfg", {}))
    built = tuple(model.pretrained_cfg["input_size"])
    fixed = model.pretrained_cfg.get("fixed_input_size", True)
    if resized:
        cfg.pop("input_size", None)  # the model's own input stays
    elif fixed and "input_size" in cfg and tuple(cfg["input_size"]) != built:  # a forward fails
        raise LgvitError(
            f"{path}: pretrained_cfg.input_size {cfg['input_size']} is not the input of the "
            f"model its model_args build ({list(built)})"
        )
    names = _lgvit_key(config, _NAMES_KEY, path)
    n = getattr(model, "num_classes", None)
    if names is not None and n is not None and len(names) != n:
        raise LgvitError(
            f"{path}: {_NAMES_KEY} names {len(names)} classes but the model's head has {n}"
        )
    for key in ("mean", "std", "input_size"):
        if key in cfg:
            model.pretrained_cfg[key] = tuple(cfg[key])
    for key in ("crop_pct", "interpolation", *_SOURCE_KEYS):
        if key in cfg:
            model.pretrained_cfg[key] = cfg[key]
    for key, value in ((_NAMES_KEY, names), *((k, _lgvit_key(config, k, path)) for k in _TOP_KEYS)):
        if value is not None:
            model.pretrained_cfg[key] = value
    model.pretrained_cfg["source"] = source


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise LgvitError(
            "hf-hub: models need huggingface_hub: pip install huggingface_hub "
            "(or download the folder yourself and use local-dir:DIR)"
        ) from None
    return huggingface_hub


def download(repo_id: str, revision: str | None = None) -> Path:
    """``hf-hub:ORG/NAME``: download ``config.json`` and ``model.safetensors``; their folder."""
    hub = _hub()
    try:
        folder = None
        for fname in (CONFIG_NAME, WEIGHTS_NAME):
            path = hub.hf_hub_download(repo_id, fname, revision=revision)
            folder = Path(path).parent
    except Exception as e:  # noqa: BLE001 -- network, auth, missing repo: one line
        raise LgvitError(f"hf-hub:{repo_id}: {type(e).__name__}: {first_line(e)}") from None
    return folder


def model_card(model: nn.Module, source: str | None = None, sha256: str | None = None) -> str:
    """A ``README.md`` model card for a ``save_pretrained`` folder: licence, paper, source and
    the accuracy its authors report when the weights are released ones (their ``tag`` in
    :mod:`lgvit.models.weights`), and how the file was converted (``source``: the file or URL
    read, ``sha256``: its hash)."""
    from lgvit.models.weights import find_weights

    cfg = getattr(model, "pretrained_cfg", {})
    arch = getattr(model, "model_name", None) or cfg.get("architecture", "model")
    w = find_weights(f"{arch}.{cfg.get('tag')}") if cfg.get("tag") else None
    if w and cfg.get("num_classes") != w.num_classes:  # a new head on their weights
        title = f"{arch} (from {w.name}, new {cfg.get('num_classes')}-class head)"
    else:
        title = w.name if w else arch
    front = ["---", *([f"license: {w.license}"] if w else []), "library_name: lgvit", "tags:",
             "- image-classification", "- lgvit", "- timm"]  # fmt: skip
    if cfg.get("dataset"):
        front += ["datasets:", f"- {cfg['dataset']}"]
    front.append("---")
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    size = cfg.get("input_size", (3, 0, 0))
    rows = [("architecture", f"`{arch}` (lgvit)"), ("parameters", f"{n_params:.2f} M"),
            ("input size", f"{size[1]} x {size[2]}"),
            ("classes", f"{cfg.get('num_classes')} ({cfg.get('dataset', 'unknown')})")]  # fmt: skip
    if w:
        rows += [("reported accuracy", f"{w.describe_metrics()} (of the released weights, "
                  "from the authors' README; not re-measured here)"),
                 ("licence", f"{w.license} (the authors' repository; the dataset's terms may "
                  "also apply)"),
                 ("released file", w.url), ("authors' repository", w.origin_url),
                 ("paper", f"{w.paper_name} ({w.paper_ids})")]  # fmt: skip
    text = [*front, "", f"# {title}", "", "| | |", "| --- | --- |"]
    text += [f"| {k} | {v} |" for k, v in rows]
    how = ("The file was read with `torch.load(weights_only=True)` (objects that are not plain "
           "data are never imported or run), its keys mapped to lgvit's names and loaded "
           "strictly, then written by lgvit's `save_pretrained` as `model.safetensors` and "
           f"`{CONFIG_NAME}`.")  # fmt: skip
    if source:
        hashed = f" (sha256 `{sha256}`)" if sha256 else ""
        how = f"Converted from `{source}`{hashed}. {how}"
    text += ["", "## How it was made", "", how, "", "## Use", "", "```python", "import lgvit",
             "", 'model = lgvit.create_model("local-dir:THIS_FOLDER")  # or "hf-hub:ORG/NAME"',
             "# with timm: import lgvit, timm; timm.create_model(\"hf-hub:ORG/NAME\", "
             "pretrained=True)", "```"]  # fmt: skip
    if w and w.notes:
        text += ["", f"Note: {w.notes}"]
    return "\n".join(text) + "\n"


def write_model_card(
    model: nn.Module, directory: str | os.PathLike, source: str | None = None,
    sha256: str | None = None,
) -> Path:  # fmt: skip
    """Write :func:`model_card` as ``README.md`` in ``directory`` (atomically)."""
    path = Path(directory) / CARD_NAME
    atomic_write_bytes(path, model_card(model, source, sha256).encode("utf-8"))
    return path


def push_to_hub(
    model: nn.Module, repo_id: str, private: bool = False, commit_message: str = "Add model"
) -> str:
    """Save the model in the hub layout and upload it to ``repo_id``; returns the commit URL."""
    hub = _hub()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        write_model_card(model, tmp)
        api = hub.HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
