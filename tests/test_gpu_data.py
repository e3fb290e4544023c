"""Data on its way to a GPU, proven on the CPU: evaluation reads the host once, after its last
batch (a sync detector over the batches); the loaders pin a batch once, for a CUDA device only
(the pin decision checked by a stand-in DataLoader that records it); ``lgvit eval`` hands the
loader the model's device, so a GPU resizes and normalises the uint8 batch itself. The
results are those of an independent computation. Tests marked ``device`` also run on a GPU
(LGVIT_TEST_DEVICE=cuda), where they check what only CUDA can: real pinned memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from seg_fixtures import write_seg_set
from torch.utils._python_dispatch import TorchDispatchMode

import lgvit
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.core.runtime import Dist
from lgvit.data.loader import AugmentConfig, BatchLoader, BatchRecipe
from lgvit.data.segmentation import SegAugment, SegEvalLoader, SegTrainLoader, load_seg_split
from lgvit.data.splits import FileImageSet
from lgvit.data.stream import StreamingLoader
from lgvit.tasks.classification.evaluate import TopKRecorder, evaluate
from lgvit.tasks.segmentation.evaluate import SegMetrics, evaluate_segmentation

aten = torch.ops.aten

# ----------------------------------------------------------------------------- sync detector

# Ops that make the host wait for the device: a scalar read (item, bool, float), or an output
# whose size depends on the data (nonzero, masking, bincount's max, unique).
_SYNC_OPS = {
    aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.masked_select,
    aten.bincount, aten._unique2, aten.unique_dim, aten.unique_consecutive,
}  # fmt: skip


class HostReads(TorchDispatchMode):
    """Records every host read while ``armed``: the syncing ops above, a boolean-mask index,
    and the Python-level reads (``.cpu()``, ``.tolist()``, ``.numpy()``), which on a CPU
    tensor dispatch nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.armed = False
        self.seen: list[str] = []
        for name in ("cpu", "tolist", "numpy"):
            real = getattr(torch.Tensor, name)

            def spy(t: torch.Tensor, *a: Any, _real: Any = real, _name: str = name, **k: Any):
                if self.armed:
                    self.seen.append(f".{_name}()")
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.armed:
            if func.overloadpacket in _SYNC_OPS:
                self.seen.append(str(func))
            elif func.overloadpacket is aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            ):
                self.seen.append("boolean mask index")
        return func(*args, **(kwargs or {}))


class ArmedLoader:
    """Ready batches; the detector is armed from the first batch until the loader is done,
    so the loader's own work is not counted, only what the evaluation does per batch."""

    def __init__(self, batches: list, reads: HostReads) -> None:
        self.batches, self.reads = batches, reads

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):  # noqa: ANN204
        self.reads.armed = True
        yield from self.batches
        self.reads.armed = False


def _class_batches(n_batches: int = 4, classes: int = 7) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(n_batches):
        x = torch.randn(6, 3, 4, 4, generator=g)
        y = torch.randint(0, classes, (6,), generator=g)
        out.append((x, y, torch.arange(6 * b, 6 * b + 6)))
    return out


def test_classification_evaluation_reads_the_host_once_after_the_last_batch(monkeypatch):
    classes = 7
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, classes))
    batches = _class_batches(classes=classes)
    reads = HostReads(monkeypatch)
    recorder = TopKRecorder(k=5)
    with reads:
        res = evaluate(model, ArmedLoader(batches, reads), classes, Dist(), None,
                       on_batch=recorder)  # fmt: skip
    assert reads.seen == []
    # The same numbers, computed independently from all the logits at once.
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        logits = model(x)
    top = logits.topk(5, dim=1).indices
    hit1 = top[:, 0] == y
    assert res["count"] == len(y) == 24
    assert res["acc1"] == pytest.approx(100 * hit1.double().mean().item(), abs=1e-12)
    assert res["acc5"] == pytest.approx(
        100 * (top == y[:, None]).any(1).double().mean().item(), abs=1e-12
    )
    assert res["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    per_class = [100 * hit1[y == c].double().mean().item() if (y == c).any() else 0.0
                 for c in range(classes)]  # fmt: skip
    assert res["per_class_acc"] == pytest.approx(per_class, abs=1e-12)
    idx, labels, top_r, _ = recorder.result()
    assert torch.equal(idx, torch.arange(24)) and torch.equal(labels, y)
    assert torch.equal(top_r, top)


def _old_areas(pred: torch.Tensor, label: torch.Tensor, n: int) -> torch.Tensor:
    """SegMetrics.update as it was (masking and bincount), the reference for the counts."""
    keep = label != 255
    p, t = pred[keep].long(), label[keep].long()
    inter = torch.bincount(t[p == t], minlength=n)[:n]
    area_p = torch.bincount(p, minlength=n)[:n]
    area_t = torch.bincount(t, minlength=n)[:n]
    return torch.stack([inter, area_p + area_t - inter, area_p, area_t]).double()


def test_segmentation_areas_are_those_of_masking_and_bincount():
    rng = np.random.default_rng(1)
    n = 6
    m = SegMetrics(n)
    want = torch.zeros(4, n, dtype=torch.float64)
    for _ in range(4):
        p = torch.from_numpy(rng.integers(0, n, size=(2, 13, 11)))
        t = torch.from_numpy(rng.integers(0, n, size=(2, 13, 11)))
        t[torch.from_numpy(rng.random(t.shape) < 0.2)] = 255
        t[0, 0, :3] = n + 2  # a label beyond the classes: its prediction counts, it does not
        m.update(p, t)
        want += _old_areas(p, t, n)
    assert torch.equal(m.areas, want)


def test_segmentation_evaluation_reads_the_host_once_after_the_last_image(monkeypatch):
    n = 4
    torch.manual_seed(0)
    model = nn.Conv2d(3, n, 1)
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(3):
        image = torch.randint(0, 256, (1, 3, 8, 10), dtype=torch.uint8, generator=g)
        mask = torch.randint(0, n, (1, 12, 15), generator=g)
        mask[0, :2] = 255
        batches.append((image, mask))
    reads = HostReads(monkeypatch)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    with reads:
        res = evaluate_segmentation(model, ArmedLoader(batches, reads), n, Dist(), None,
                                    mean, std)  # fmt: skip
    assert reads.seen == []
    # An independent confusion matrix of the same predictions.
    cm = np.zeros((n, n))
    for image, mask in batches:
        x = (image.float() - torch.tensor(mean).view(1, 3, 1, 1) * 255) / (
            torch.tensor(std).view(1, 3, 1, 1) * 255
        )
        with torch.no_grad():
            logits = F.interpolate(model(x), size=mask.shape[-2:], mode="bilinear")
        p, t = logits.argmax(1).numpy().ravel(), mask.numpy().ravel()
        keep = t != 255
        np.add.at(cm, (t[keep], p[keep]), 1)
    tp = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - tp
    assert res["count"] == 3
    assert res["aAcc"] == pytest.approx(100 * tp.sum() / cm.sum(), rel=1e-12)
    iou = [round(100 * v, 4) for v in tp / union]
    assert res["per_class_iou"] == pytest.approx(iou, abs=1e-4)


def test_the_detector_sees_the_reads_it_is_for(monkeypatch):
    """The detector itself: each kind of host read the evaluations used to make is caught."""
    reads = HostReads(monkeypatch)
    t = torch.arange(6)
    with reads:
        reads.armed = True
        t.sum().item()
        t[t > 2].sum()
        torch.bincount(t)
        t.cpu()
        bool(t[0])
        reads.armed = False
        t.cpu()  # not armed: not counted
    assert len(reads.seen) == 5, reads.seen


# ------------------------------------------------------------------------------- pinning


class PinSpy:
    """A stand-in for ``DataLoader`` that records each one's ``pin_memory`` and, where it is
    set, "pins" every batch as the real one does (once per batch, each tensor in it, after the
    collate), with a copy whose address is remembered: a tensor a loader yields or sends to the
    device is the pinned one only if its address is."""

    def __init__(self) -> None:
        self.pin_flags: list[bool] = []
        self.pinned: set[int] = set()
        self.batches = 0
        real = torch.utils.data.DataLoader
        spy = self

        class Loader(real):
            def __init__(self, *a: Any, pin_memory: bool = False, **k: Any) -> None:
                spy.pin_flags.append(pin_memory)
                self._pin = pin_memory
                super().__init__(*a, **k)

            def __iter__(self):  # noqa: ANN204
                for batch in super().__iter__():
                    if self._pin:
                        spy.batches += 1
                        batch = spy.pin(batch)
                    yield batch

        self.Loader = Loader

    def pin(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            out = obj.clone()
            self.pinned.add(out.data_ptr())
            return out
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.pin(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self.pin(v) for k, v in obj.items()}
        return obj

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self.pinned


def _pngs(root: Path, n: int, size: tuple[int, int]) -> list[str]:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = root / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(p)
        out.append(str(p))
    return out


def _cpu_generators(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a loader for a CUDA device gets CPU generators where it would make its
    augmentation generator on the GPU (eval batches draw nothing from it)."""
    real = torch.Generator
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "Generator", lambda device=None: real())


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_streaming_eval_batches_go_to_the_device_as_pinned(tmp_path, monkeypatch, device):
    """For CUDA the workers' batch is pinned once and that very buffer is copied to the device
    (the bug: compacting it made a pageable copy, pinned again); for the CPU nothing pins."""
    paths = _pngs(tmp_path / "im", 6, (20, 24))
    files = FileImageSet(paths, torch.tensor([0, 1, 2, 0, 1, 2]), ["a", "b", "c"])
    _cpu_generators(monkeypatch)
    spy = PinSpy()
    monkeypatch.setattr("lgvit.data.stream.DataLoader", spy.Loader)
    sent: list[torch.Tensor] = []

    def to_device(self: BatchRecipe, t: torch.Tensor) -> torch.Tensor:
        sent.append(t)  # no GPU here: the batch stays, its address is what counts
        return t

    monkeypatch.setattr(BatchRecipe, "to_device", to_device)
    aug = AugmentConfig(img_size=16)
    loader = StreamingLoader(files, 4, workers=0, aug=aug, num_classes=3, train=False,
                             device=device)  # fmt: skip
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 2]
    images = [t for t in sent if t.dtype == torch.uint8]
    assert len(images) == 2
    if device == "cuda":
        assert spy.pin_flags == [True] and spy.batches == 2
        assert all(spy.is_pinned(t) for t in images)
    else:
        assert spy.pin_flags == [False] and not spy.pinned


def _seg_loaders(root: Path, device: str) -> list:
    train = load_seg_split("segfolder", str(root), "train")
    val = load_seg_split("segfolder", str(root), "val")
    aug = SegAugment(crop=16, scale=(40, 20))
    return [
        SegTrainLoader(train, aug, batch_size=2, seed=0, workers=0, device=device),
        SegEvalLoader(val, (40, 20), workers=0, device=device),
    ]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_segmentation_loaders_pin_their_batches_for_cuda_only(tmp_path, monkeypatch, device):
    root = write_seg_set(tmp_path / "seg", n_train=4, n_val=2, size=(20, 24))
    spy = PinSpy()
    monkeypatch.setattr(torch.utils.data, "DataLoader", spy.Loader)
    for loader in _seg_loaders(root, device):
        for image, mask in loader:
            assert image.dtype == torch.uint8 and mask.dtype == torch.int64
            if device == "cuda":  # the very tensors pinned: stacked before, not after
                assert spy.is_pinned(image) and spy.is_pinned(mask)
    if device == "cuda":
        assert spy.pin_flags == [True, True] and spy.batches == 2 + 2
    else:
        assert spy.pin_flags == [False, False] and not spy.pinned


def test_a_segmentation_sample_that_fails_is_still_one_line(tmp_path, monkeypatch):
    root = write_seg_set(tmp_path / "seg", n_train=4, n_val=2, size=(20, 24))
    spy = PinSpy()
    monkeypatch.setattr(torch.utils.data, "DataLoader", spy.Loader)
    mask = next((root / "annotations" / "validation").iterdir())
    Image.new("L", (5, 5)).save(mask)  # another size than its image
    with pytest.raises(LgvitError, match=mask.name):
        list(_seg_loaders(root, "cuda")[1])


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_detection_loaders_pin_their_batches_for_cuda_only(tmp_path, monkeypatch, device):
    pytest.importorskip("pycocotools")
    from det_fixtures import write_coco_set

    from lgvit.data.coco import DetEvalLoader, DetTrainLoader, load_coco_split

    root = write_coco_set(tmp_path / "coco", n_train=4, n_val=2, size=(40, 48), empty=0)
    spy = PinSpy()
    monkeypatch.setattr(torch.utils.data, "DataLoader", spy.Loader)
    train = DetTrainLoader(load_coco_split(root, "train"), 1, seed=0, workers=0, device=device)
    for images, targets in train:
        if device == "cuda":
            assert all(spy.is_pinned(im) for im in images)
            assert all(spy.is_pinned(t["boxes"]) for t in targets)
    val = DetEvalLoader(load_coco_split(root, "val"), workers=0, device=device)
    for image, _ in val:
        assert image is not None and (spy.is_pinned(image) == (device == "cuda"))
    assert spy.pin_flags == [device == "cuda"] * 2


# ----------------------------------------------------------------------- lgvit eval's device


def test_lgvit_eval_gives_its_loader_the_models_device(tmp_path, monkeypatch, capsys):
    """The loader, not the evaluation, moves the batch: it gets the model's device, so on a GPU
    the uint8 batch goes there and is resized and normalised there (the bug: the loader was
    left on the CPU and moved the float batch after preprocessing it)."""
    import lgvit.data.stream as stream

    for c in range(2):
        _pngs(tmp_path / "d" / "val" / f"c{c}", 2, (18 + 4 * c, 20))
    torch.manual_seed(0)
    model = lgvit.create_model("lsa_micro_cifar", num_classes=2, img_size=16)
    torch.save(model.state_dict(), tmp_path / "m.pth")
    seen: list[Any] = []
    real = stream.make_loader

    def make_loader(*a: Any, **k: Any) -> Any:
        seen.append(k.get("device"))
        return real(*a, **k)

    monkeypatch.setattr(stream, "make_loader", make_loader)
    code = main(["eval", "--model", "lsa_micro_cifar", "--img-size", "16", "--checkpoint",
                 str(tmp_path / "m.pth"), "--data", "imagefolder", "--data-dir",
                 str(tmp_path / "d"), "--cache-dir", str(tmp_path / "c"), "-j", "0",
                 "--device", "cpu", "--json"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert seen == [torch.device("cpu")]
    assert json.loads(out.out)["count"] == 4


def test_a_cuda_eval_loader_moves_the_uint8_batch_before_resizing(monkeypatch):
    """The logic a GPU runs, on the CPU: the loader for a CUDA device sends the stored uint8
    images (not floats, not resized) and its output equals the CPU loader's exactly."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (5, 3, 20, 24), dtype=torch.uint8, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 1])
    aug = AugmentConfig(img_size=16, crop_pct=0.875)
    cpu = list(BatchLoader(images, labels, 3, num_classes=3, train=False, aug=aug))
    _cpu_generators(monkeypatch)
    cuda = BatchLoader(images, labels, 3, num_classes=3, train=False, aug=aug, device="cuda")
    sent: list[torch.Tensor] = []

    def to_device(t: torch.Tensor) -> torch.Tensor:
        sent.append(t)
        return t

    cuda.recipe.to_device = to_device
    got = list(cuda)
    assert [t.dtype for t in sent] == [torch.uint8, torch.int64] * 2
    assert [tuple(t.shape) for t in sent[::2]] == [(3, 3, 20, 24), (2, 3, 20, 24)]
    for (xa, ya), (xb, yb) in zip(cpu, got, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ------------------------------------------------------------------- on a GPU (device tests)


@pytest.mark.device
def test_on_cuda_batches_are_pinned_once_and_evaluate_unchanged(tmp_path):
    if not torch.cuda.is_available():  # the plain suite hides the GPUs; LGVIT_TEST_DEVICE=cuda
        pytest.skip("pinned memory needs CUDA")
    pinned = torch.zeros(4, 3, 8, 8, dtype=torch.uint8).pin_memory()
    assert pinned.pin_memory().data_ptr() == pinned.data_ptr()  # to_device does not pin it twice
    root = write_seg_set(tmp_path / "seg", n_train=4, n_val=2, size=(20, 24))
    for loader in _seg_loaders(root, "cuda"):
        image, mask = next(iter(loader))
        assert image.is_pinned() and mask.is_pinned()
    classes = 7
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, classes))
    batches = _class_batches(classes=classes)
    on_cpu = evaluate(model, batches, classes, Dist(), None)
    dev = torch.device("cuda")
    on_gpu = evaluate(model.to(dev), batches, classes, Dist(device=dev), None)
    assert on_gpu["count"] == on_cpu["count"]
    for key in ("acc1", "acc5", "loss"):
        assert on_gpu[key] == pytest.approx(on_cpu[key], rel=1e-5)
    with torch.cuda.device(dev):
        torch.cuda.set_sync_debug_mode("error")
        try:
            m = SegMetrics(5, dev)
            m.update(torch.randint(0, 5, (2, 9, 9), device=dev),
                     torch.randint(0, 5, (2, 9, 9), device=dev))  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode("default")
