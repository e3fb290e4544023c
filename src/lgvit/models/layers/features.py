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
    """``feature_info``: a list of ``dict(num_chs, reduction, module, index)``, the levels a
    model (or a ``features_only`` wrapper) returns, with timm's ``FeatureInfo`` API: ``info``
    holds every level of the model and ``out_indices`` says which of them this list is; the
    accessors (``channels``, ``reduction``, ``module_name``, ``get``, ``get_dicts``) give the
    returned levels, or with ``idx`` the model's levels by their index, as timm's do."""

    def __init__(
        self, levels: Any = (), info: Sequence[dict[str, Any]] | None = None,
        out_indices: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        levels = [dict(f) for f in levels]
        for i, f in enumerate(levels):
            f.setdefault("index", i)
        super().__init__(levels)
        self.info = [dict(f) for f in info] if info is not None else [dict(f) for f in levels]
        for i, f in enumerate(self.info):
            f.setdefault("index", i)
        self.out_indices = tuple(out_indices if out_indices is not None else range(len(levels)))

    def select(self, out_indices: Sequence[int]) -> FeatureInfo:
        """The levels ``out_indices`` (of :attr:`info`) as a wrapper returns them."""
        return FeatureInfo([self.info[i] for i in out_indices], self.info, out_indices)

    def get(self, key: str, idx: int | Sequence[int] | None = None) -> Any:
        if idx is None:
            return [f[key] for f in self]
        if isinstance(idx, int):
            return self.info[idx][key]
        return [self.info[i][key] for i in idx]

    def channels(self, idx: int | Sequence[int] | None = None) -> Any:
        return self.get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None) -> Any:
        return self.get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None) -> Any:
        return self.get("module", idx)

    def get_dicts(
        self, keys: Sequence[str] | None = None, idx: int | Sequence[int] | None = None
    ) -> Any:  # fmt: skip
        pick = (lambda f: dict(f)) if keys is None else (lambda f: {k: f[k] for k in keys})
        if idx is None:
            return [pick(f) for f in self]
        if isinstance(idx, int):
            return pick(self.info[idx])
        return [pick(self.info[i]) for i in idx]
