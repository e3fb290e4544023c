"""The engine's loader contract (lgvit.data.protocol): every loader a task hands the engine keeps
it, by structure and by signature, and a loader that does not is refused before training."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from det_fixtures import write_coco_set
from seg_fixtures import write_seg_set

from lgvit.data.coco import DetEvalLoader, DetTrainLoader, load_coco_split
from lgvit.data.loader import BatchLoader
from lgvit.data.protocol import Loader, TrainLoader, check_loaders
from lgvit.data.segmentation import SegAugment, SegEvalLoader, SegTrainLoader, load_seg_split
from lgvit.data.splits import FileImageSet
from lgvit.data.stream import StreamingLoader
from lgvit.run.config import TrainConfig
from lgvit.run.engine import Prepared, run

TRAIN_LOADERS = [BatchLoader, StreamingLoader, SegTrainLoader, DetTrainLoader]
EVAL_LOADERS = [SegEvalLoader, DetEvalLoader]


@pytest.fixture(scope="module")
def loaders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    """(train, eval) loaders of every kind, on tiny sets."""
    tmp = tmp_path_factory.mktemp("loaders")
    images = torch.zeros((8, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(8) % 2
    kw = dict(num_classes=2, workers=0)
    files = FileImageSet([str(tmp / f"{i}.png") for i in range(8)], labels, ["a", "b"])
    seg = load_seg_split("segfolder", write_seg_set(tmp / "s", n_train=4, n_val=2), "train")
    coco = load_coco_split(write_coco_set(tmp / "c", n_train=4, n_val=2), "train")
    return {
        "batch": (BatchLoader(images, labels, 2, num_classes=2, train=True),
                  BatchLoader(images, labels, 2, num_classes=2, train=False)),
        "stream": (StreamingLoader(files, 2, train=True, **kw),
                   StreamingLoader(files, 2, train=False, **kw)),
        "seg": (SegTrainLoader(seg, SegAugment(crop=32, scale=(64, 48)), 2, 0, workers=0),
                SegEvalLoader(seg, (64, 48), workers=0)),
        "det": (DetTrainLoader(coco, 2, 0, workers=0), DetEvalLoader(coco, workers=0)),
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["batch", "stream", "seg", "det"])
def test_every_loader_keeps_the_contract(loaders, kind):
    train, test = loaders[kind]
    assert isinstance(train, TrainLoader) and isinstance(test, Loader)
    check_loaders(train, test)  # what the engine checks after a task's prepare()
    assert len(train) > 0 and len(test) > 0
    train.set_epoch(1)
    train.set_epoch(1, 0, train.aug_state())  # positionally, as the engine calls it


@pytest.mark.parametrize("cls", TRAIN_LOADERS + EVAL_LOADERS, ids=lambda c: c.__name__)
def test_loader_classes_match_the_protocol(cls):
    assert issubclass(cls, Loader)
    if cls in EVAL_LOADERS:
        assert not issubclass(cls, TrainLoader)  # evaluation loaders are only counted, iterated
        return
    assert issubclass(cls, TrainLoader)
    for name in ("set_epoch", "aug_state"):
        want = inspect.signature(getattr(TrainLoader, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        # The same names, kinds and defaults: called positionally by the engine, by keyword
        # by a reader of the protocol.
        assert [(p.name, p.kind, p.default) for p in got.values()] == [
            (p.name, p.kind, p.default) for p in want.values()
        ], (cls.__name__, name)


class _NoAugState:
    """A train loader that forgot ``aug_state``: it would fail at the first mid-epoch save."""

    def __len__(self) -> int:
        return 1

    def __iter__(self):
        yield torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)

    def set_epoch(self, epoch: int, batch: int = 0, state: object = None) -> None:
        pass


def test_a_missing_method_is_caught():
    assert isinstance(_NoAugState(), Loader) and not isinstance(_NoAugState(), TrainLoader)
    with pytest.raises(TypeError, match=r"train loader \(_NoAugState\).*no aug_state"):
        check_loaders(_NoAugState(), [])
    with pytest.raises(TypeError, match=r"test loader \(object\).*no __len__, __iter__"):
        check_loaders(BatchLoader(torch.zeros((2, 3, 4, 4), dtype=torch.uint8),
                                  torch.zeros(2, dtype=torch.long), 2, num_classes=1, train=True),
                      object())  # fmt: skip


class _Task:
    identity_keys = ("task",)
    best_metric = "acc1"

    def prepare(self, cfg: TrainConfig, d: object) -> Prepared:
        return Prepared(nn.Linear(2, 2), _NoAugState(), [], {}, "a task with a bad loader")


def test_the_engine_refuses_a_task_whose_loader_breaks_the_contract(tmp_path: Path):
    cfg = TrainConfig(out=str(tmp_path / "run"), device="cpu")
    with pytest.raises(TypeError, match="no aug_state"):
        run(cfg, _Task())  # type: ignore[arg-type]
    assert not (tmp_path / "run" / "last.safetensors").exists()  # refused before any step
