"""Image classification: the DeiT recipe of the papers (``train``), top-1/top-5, ReaL and the
papers' test-time augmentation (``evaluate``), ``lgvit eval`` / ``predict`` (``cli``)."""

from __future__ import annotations

from typing import Any


def build_released(w: Any) -> Any:
    """The registered classifier (``lgvit weights`` checks a download by loading into it)."""
    from lgvit.models import create_model

    return create_model(w.model, num_classes=w.num_classes)
