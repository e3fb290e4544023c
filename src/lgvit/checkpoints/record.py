"""The checkpoint record: what an lgvit checkpoint carries besides its weights, for every task.

A checkpoint's safetensors header holds strings only. :class:`CheckpointRecord` is that header as
typed fields, written (:meth:`~CheckpointRecord.to_meta`), validated and read
(:meth:`~CheckpointRecord.from_meta`) here and nowhere else;
:func:`lgvit.checkpoints.files.load_record` reads one from a file. The on-disk form is the one lgvit
has always written -- the same keys, whole numbers as decimal strings, lists and objects as
``json.dumps`` of them, a classification checkpoint naming no task -- so checkpoints written before
the record and after it load in either version. A malformed value (a hand-edited or foreign header)
is one line naming the file and the key; a key a checkpoint lacks takes the record's default for its
task.

Also here: the type tests of metadata values (``is_size``, ``is_rgb``, ...) and each key's rule
applied to a decoded value (:func:`value_problem`), which ``models/hub.py`` applies to a hub
folder's ``config.json`` too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lgvit.checkpoints.kinds import DETECTORS
from lgvit.core.constants import MAX_DENSE_SCALE
from lgvit.core.errors import LgvitError
from lgvit.task_table import DEFAULT_TASK, TASK_NAMES, get_task

__all__ = [
    "CheckpointRecord",
    "is_img_size",
    "is_names",
    "is_number",
    "is_rgb",
    "is_size",
    "value_problem",
]


# --------------------------------------------------------------------------- value type tests


def is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def is_size(x: Any) -> bool:
    """A positive integer (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def is_img_size(v: Any) -> bool:
    """A positive integer or a (height, width) pair of them."""
    return is_size(v) or (isinstance(v, tuple | list) and len(v) == 2 and all(map(is_size, v)))


def is_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(c, str) for c in v)


def is_rgb(v: Any) -> bool:
    """Three numbers (a mean or std per RGB channel)."""
    return isinstance(v, list) and len(v) == 3 and all(map(is_number, v))


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint of any task carries; None: the checkpoint does not say (the model's or
    the data's own value applies). Field order is the on-disk key order."""

    task: str = DEFAULT_TASK
    detector: str | None = None  # detection: retinanet | maskrcnn
    model: str | None = None  # the registered model (for dense tasks, the backbone)
    img_size: int | None = None  # the backbone's build size (crop for segmentation)
    num_classes: int | None = None
    classes: tuple[str, ...] | None = None  # class names, in label order
    cat_ids: tuple[int, ...] | None = None  # detection: the COCO category id of each class
    mean: tuple[float, float, float] | None = None  # normalisation, [0, 1] units
    std: tuple[float, float, float] | None = None
    dataset: str | None = None
    model_kwargs: dict[str, Any] | None = field(default=None, hash=False)  # architecture keys
    seg_scale: tuple[int, int] | None = None  # segmentation: mmseg's (long, short) test scale
    det_scale: tuple[int, int] | None = None  # detection: (long, short) image sides
    crop_pct: float | None = None  # read, never written: a foreign or hand-edited header's

    @property
    def is_dense(self) -> bool:
        """A segmenter's or detector's checkpoint (the task's ``dense``), not a classifier's."""
        return get_task(self.task).dense

    def to_meta(self) -> dict[str, str]:
        """The header's strings: every field that is set, in field order."""
        meta: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "task" and value == DEFAULT_TASK):
                continue  # not stored; a classification checkpoint has never named its task
            meta[f.name] = _encode(value)
        return meta

    @classmethod
    def from_meta(
        cls, meta: Mapping[str, str], source: str | Path, task: str | None = None
    ) -> CheckpointRecord:
        """The record of a header, every value checked (a malformed one is an
        :class:`LgvitError` naming ``source`` and the key), absent keys at their defaults.

        ``task``: the task the caller loads. A header that names none of the record's keys (the
        authors' ``.pth``, a foreign ``.safetensors``) is taken as one of it; an lgvit
        checkpoint of another task is refused. Keys the record does not know are ignored."""
        values: dict[str, Any] = {}
        for key, (want, parse) in _PARSERS.items():
            if key in meta and not (key == "crop_pct" and not meta[key]):  # "": none
                values[key] = _parse(meta, key, source, want, parse)
        values.setdefault("task", DEFAULT_TASK)
        if task is not None and task != values["task"]:
            if cls.is_lgvit_header(meta):
                raise LgvitError(f"{source}: a {values['task']} checkpoint, not a {task} one")
            values["task"] = task
        for key, value in cls.defaults(values).items():
            values.setdefault(key, value)
        _check_together(values, meta, source)
        return cls(**values)

    @classmethod
    def defaults(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """The values of the keys a header of ``values['task']`` may lack (given ``values``,
        the ones it has): the task's ``record_defaults`` (:mod:`lgvit.task_table`).
        lgvit's first
        classification checkpoints named no task and no model_kwargs; the LIT authors'
        mmseg/mmdet files carry no header at all."""
        return get_task(values.get("task", DEFAULT_TASK)).record_defaults(dict(values))

    @staticmethod
    def is_lgvit_header(meta: Mapping[str, str]) -> bool:
        """Whether a header holds any of the record's keys (an lgvit checkpoint, whose task is
        then its record's); a foreign file's header holds none."""
        return any(key in meta for key in _PARSERS)


def _encode(value: Any) -> str:
    """A field's on-disk string, as lgvit's writers have always made it."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


# --------------------------------------------------------------------------- validation


def _whole(raw: str) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and int(text) > 0):
        raise ValueError(raw)
    return int(text)


def _json(ok: Callable[[Any], bool], convert: Callable[[Any], Any] = tuple) -> Callable:
    def parse(raw: str) -> Any:
        value = json.loads(raw)
        if not ok(value):
            raise ValueError(raw)
        return convert(value)

    return parse


def _one_of(names: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in names:
            raise ValueError(raw)
        return raw

    return parse


def _text(raw: str) -> str:
    if not raw.strip():
        raise ValueError(raw)
    return raw


def _rgb(positive: bool) -> Callable[[Any], bool]:
    # Finite: Python's json reads NaN and Infinity, which would normalise every pixel to NaN.
    return lambda v: is_rgb(v) and all(math.isfinite(x) and (x > 0 or not positive) for x in v)


def _scale(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(is_size(x) and x <= MAX_DENSE_SCALE
                                                       for x in v)  # fmt: skip


def _is_object(v: Any) -> bool:
    return isinstance(v, dict)


def _class_names(v: Any) -> bool:
    return is_names(v) and len(v) > 0 and all(c.strip() for c in v)


def _category_ids(v: Any) -> bool:  # distinct positive ints (one per class: checked after)
    return isinstance(v, list) and all(map(is_size, v)) and len(set(v)) == len(v)


_SIZES = f"two sizes (pixels, at most {MAX_DENSE_SCALE})"

# Each key: what a good value is (the error's words) and its parser (ValueError or TypeError:
# malformed), in the record's field order.
_PARSERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "task": (f"one of {', '.join(TASK_NAMES)}", _one_of(TASK_NAMES)),
    "detector": (f"one of {', '.join(DETECTORS)}", _one_of(DETECTORS)),
    "model": ("a model name", _text),
    "img_size": ("a positive whole number", _whole),
    "num_classes": ("a positive whole number", _whole),
    "classes": ("a JSON list of class names (at least one)", _json(_class_names)),
    "cat_ids": ("a JSON list of the classes' distinct category ids", _json(_category_ids)),
    "mean": ("a JSON list of 3 numbers", _json(_rgb(positive=False))),
    "std": ("a JSON list of 3 positive numbers", _json(_rgb(positive=True))),
    "dataset": ("a dataset name", _text),
    "model_kwargs": ("a JSON object of architecture arguments", _json(_is_object, dict)),
    "seg_scale": (_SIZES, _json(_scale)),
    "det_scale": (_SIZES, _json(_scale)),
    "crop_pct": ("a number in (0, 1]", _json(lambda v: is_number(v) and 0 < v <= 1, float)),
}
assert tuple(_PARSERS) == tuple(f.name for f in fields(CheckpointRecord))  # one table per key


def _bad(meta: Mapping[str, str], key: str, source: str | Path, want: str) -> LgvitError:
    return LgvitError(f"{source}: metadata {key}={str(meta[key])[:60]!r} is not {want}")


def _parse(
    meta: Mapping[str, str], key: str, source: str | Path, want: str, parse: Callable
) -> Any:
    raw = meta[key]
    try:
        if not isinstance(raw, str):  # a header holds strings; a caller's dict may not
            raise TypeError(key)
        return parse(raw)
    except (TypeError, ValueError):  # ValueError: json's too
        raise _bad(meta, key, source, want) from None


def value_problem(key: str, value: Any) -> str | None:
    """The record's rule for ``key`` applied to a value as JSON decodes it (a hub folder's
    ``config.json`` carries the same facts): None when the record would write it and read the
    same value back, else the words of what it must be."""
    want, parse = _PARSERS[key]
    try:
        back = parse(_encode(value))
    except (TypeError, ValueError):
        return want
    return None if back == (tuple(value) if isinstance(value, list) else value) else want


def _check_together(values: Mapping[str, Any], meta: Mapping[str, str], source: str | Path) -> None:
    """The keys that must agree: a dense model is built with one output per class name, and a
    detection's class index is looked up in ``cat_ids``. (A classifier's names may be fewer
    than its outputs: the rest are named by index.)"""
    classes, n = values.get("classes"), values.get("num_classes")
    dense = get_task(values["task"]).dense
    if dense and classes is not None and n is not None and n != len(classes):
        raise _bad(meta, "num_classes", source, f"the number of its {len(classes)} classes")
    ids = values.get("cat_ids")
    if get_task(values["task"]).needs_cat_ids and ids is None:
        raise LgvitError(f"{source}: metadata names classes but no cat_ids (the COCO category "
                         "id of each class)")  # fmt: skip
    if ids is not None and classes is not None and len(ids) != len(classes):
        if "cat_ids" not in meta:  # the defaults' COCO ids against its own classes
            raise LgvitError(f"{source}: metadata names {len(classes)} classes but no cat_ids")
        raise _bad(meta, "cat_ids", source, f"a JSON list of {len(classes)} distinct category ids")
