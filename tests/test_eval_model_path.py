"""The dense tasks' checkpoint loaders resolve a released name with their task's own
``build_released`` (one builder per task, not a retyped copy)."""

from __future__ import annotations

from typing import Any

import pytest

import lgvit.dense.pretrained as pretrained
from lgvit.tasks import detection, segmentation
from lgvit.tasks.detection.evaluate import load_detector
from lgvit.tasks.segmentation.evaluate import load_segmenter


class _Seen(Exception):
    pass


@pytest.mark.parametrize(
    ("load", "task"), [(load_segmenter, segmentation), (load_detector, detection)]
)
def test_released_name_uses_the_tasks_build_released(
    monkeypatch: pytest.MonkeyPatch, load: Any, task: Any
) -> None:
    seen: list[Any] = []

    def spy(checkpoint: str, task_name: str, build: Any, *args: Any) -> None:
        seen.append(build)
        raise _Seen

    monkeypatch.setattr(pretrained, "released_checkpoint", spy)
    with pytest.raises(_Seen):
        load("some.name", device="cpu")
    assert seen == [task.build_released]
