"""Mapping other checkpoint layouts (the authors' releases, timm's) onto lgvit's keys."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch


def rename_keys(
    state_dict: dict[str, torch.Tensor], rules: Iterable[tuple[str, str]]
) -> dict[str, torch.Tensor]:
    """Apply regex ``(pattern, replacement)`` rules, in order, to every key."""
    rules = [(re.compile(p), r) for p, r in rules]
    out = {}
    for key, value in state_dict.items():
        for pattern, repl in rules:
            key = pattern.sub(repl, key)
        out[key] = value
    return out


def drop_keys(state_dict: dict[str, torch.Tensor], pattern: str) -> dict[str, torch.Tensor]:
    """Leave out keys that match (buffers lgvit rebuilds, such as relative-position indices)."""
    rx = re.compile(pattern)
    return {k: v for k, v in state_dict.items() if not rx.search(k)}
