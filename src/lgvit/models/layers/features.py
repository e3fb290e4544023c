"""Which intermediate features to return, and the ``feature_info`` list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def feature_take_indices(num: int, indices: int | Sequence[int] | None = None) -> list[int]:
    """Resolve timm's ``indices``: None = all, an int n = the last n, a list = those (negative
    counts from the end). Out-of-range indices are an error, never silently wrapped."""
    if indices is None:
        return list(range(num))
    if isinstance(indices, int):
        if not 0 < indices <= num:
            raise ValueError(f"indices={indices}: asks for the last {indices} of {num} features")
        return list(range(num - indices, num))
    take = []
    for i in indices:
        if not -num <= int(i) < num:
            raise ValueError(f"feature index {i} is out of range for {num} features")
        take.append(int(i) % num)
    return take


class FeatureInfo(list):
    """``feature_info``: a list of ``dict(num_chs, reduction, module)``, with timm's accessors."""

    def _get(self, key: str, idx: int | Sequence[int] | None) -> Any:
        if idx is None:
            return [f[key] for f in self]
        if isinstance(idx, int):
            return self[idx][key]
        return [self[i][key] for i in idx]

    def channels(self, idx: int | Sequence[int] | None = None) -> Any:
        return self._get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None) -> Any:
        return self._get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None) -> Any:
        return self._get("module", idx)

    def get_dicts(self) -> list[dict[str, Any]]:
        return [dict(f) for f in self]
