"""The batched augmentation recipe on a device: no host sync and no host-made tensor per batch.

Off the CPU the recipe takes its sync-free path (``sync_free``): every decision stays a tensor
on the batch's device, so the host can queue batch n+1 while step n runs. A CPU cannot show a
CUDA sync, so these tests force that path on CPU batches and watch, with a torch function mode,
for every call that would read a device value back (``.item()``, ``.tolist()``, ``bool()``,
``nonzero``, ``bincount``, a boolean mask index, ...) or build a tensor from host data that a
device would then have to copy in (``torch.tensor``, ``as_tensor`` of a list). On a GPU,
``torch.cuda.set_sync_debug_mode("error")`` over the same recipe is the final word.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.overrides import TorchFunctionMode

from lgvit.data import transforms as T
from lgvit.data.loader import AugmentConfig, BatchLoader

# Calls that, on a CUDA tensor, copy a value to the host and wait for the device.
READS_BACK = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
    "repeat_interleave",
}  # fmt: skip
# Tensors made from host (Python) data: on a device run they are a host-to-device copy.
FROM_HOST = {"tensor", "as_tensor"}


class HostSyncGuard(TorchFunctionMode):
    """Records every call that would sync with, or copy from, the host on a device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in READS_BACK:
            self.calls.append(name)
        elif name in FROM_HOST and args and not isinstance(args[0], torch.Tensor):
            self.calls.append(f"{name}({args[0]!r})")
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1:2]):
            self.calls.append(f"{name} with a boolean mask")
        return func(*args, **kwargs)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(
        _has_bool_index(i)
        if isinstance(i, (tuple, list))
        else isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in items
    )


def test_the_guard_catches_a_read_back():
    """The guard can fail: a host read, a host-made tensor and a mask index are all seen."""
    t = torch.arange(4)
    with HostSyncGuard() as guard:
        t.sum().item()
        torch.tensor([1, 2])
        t[t > 1]
        torch.bincount(t)
    assert guard.calls == ["item", "tensor([1, 2])", "__getitem__ with a boolean mask", "bincount"]


def _images(n: int = 16, size: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def _loader(aug: AugmentConfig, n: int = 24, batch: int = 8) -> BatchLoader:
    loader = BatchLoader(_images(n, 14), torch.arange(n) % 5, batch, num_classes=5, train=True,
                         aug=aug, seed=3)  # fmt: skip
    loader.recipe.sync_free = True  # the path a GPU takes, here on the CPU
    return loader


RECIPES = {
    "cifar": dict(train_crop="random_crop", crop_padding=2, alternate_flip=True),
    "imagenet": dict(train_crop="random_resized_crop", mixup_mode="elem", recount=2),
    "rand-erase": dict(train_crop="random_resized_crop", remode="rand", mixup=0.0, cutmix=0.0),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_full_recipe_never_reads_back_or_copies_from_the_host(recipe):
    """Crop, flip, RandAugment (every op, all three categories), erasing and mixup/cutmix, per
    batch: nothing waits for the device and nothing is copied in from the host."""
    aug = AugmentConfig(img_size=12, rand_augment="rand-m9-mstd0.5-inc1-n3", reprob=1.0,
                        **RECIPES[recipe])  # fmt: skip
    it = iter(_loader(aug))
    next(it)  # the epoch's set-up (its order, the generator) happens once, at the first batch
    with HostSyncGuard() as guard:
        batches = list(it)
    assert len(batches) == 2
    assert guard.calls == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"increasing": False, "num_ops": 3, "prob": 1.0},
        {"magnitude_std": float("inf"), "fill": None, "prob": 0.8},
        {"magnitude": 5, "magnitude_max": 7, "increasing": False},
    ],
)
def test_sync_free_rand_augment_is_the_batched_one_byte_for_byte(kwargs):
    """The same draws give the same images: every op computed for every image and selected
    on the device is exactly the category-batched result the CPU path computes."""
    x = _images(24, 10, seed=1)
    for seed in range(3):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = T.rand_augment(x, g1, **kwargs)
        got = T.rand_augment(x, g2, sync_free=True, **kwargs)
        assert torch.equal(got, want)
        assert torch.equal(g1.get_state(), g2.get_state())


def test_equalize_needs_no_bincount_and_is_pils():
    """Equalize's per-image histograms without bincount (which syncs on CUDA), still PIL's."""
    x = _images(6, 9, seed=2)
    x[0] = 7  # a single level: PIL leaves the image as it is
    with HostSyncGuard() as guard:
        got = T.equalize(x)
    assert guard.calls == []
    for i in range(len(x)):
        pil = ImageOps.equalize(Image.fromarray(x[i].permute(1, 2, 0).numpy()))
        assert torch.equal(got[i], torch.from_numpy(np.array(pil)).permute(2, 0, 1))


@pytest.mark.parametrize("count", [1, 2])
def test_sync_free_erasing_boxes_are_the_host_ones(count):
    """Same draws, same boxes: 'const' erasing is byte-identical to the picking path's, and
    one round of 'pixel' erasing fills exactly those boxes with noise (with two rounds the
    noise of the first moves the second's draws)."""
    x = torch.randn(16, 3, 10, 10, generator=torch.Generator().manual_seed(4))
    kw = dict(prob=0.6, max_count=count, min_count=1)
    want = T.random_erasing(x, torch.Generator().manual_seed(5), mode="const", **kw)
    with HostSyncGuard() as guard:
        got = T.random_erasing(x, torch.Generator().manual_seed(5), mode="const", sync_free=True,
                               **kw)  # fmt: skip
    assert guard.calls == []
    assert torch.equal(got, want)
    erased = want != x
    assert 0 < erased.sum() < x.numel()
    if count == 1:
        gen = torch.Generator().manual_seed(5)
        noisy = T.random_erasing(x, gen, mode="pixel", sync_free=True, **kw)
        assert torch.equal(noisy != x, erased)


@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_sync_free_mixup_is_timm_mixup_or_cutmix(mode):
    """Each image is either blended with its mirror with weight lam, or has a box of its mirror
    pasted in with lam its kept area; targets mix the smoothed labels with the same lam."""
    b, k, h = 8, 4, 10
    x = torch.randn(b, 3, h, h, generator=torch.Generator().manual_seed(6))
    y = torch.arange(b) % k
    kinds = set()
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        with HostSyncGuard() as guard:
            out, t = T.mixup_cutmix(x, y, k, gen, label_smoothing=0.1, mode=mode, sync_free=True)
        assert guard.calls == []
        torch.testing.assert_close(t.sum(1), torch.ones(b))
        lam = (t - T.one_hot_smooth(y.flip(0), k, 0.1)) / (
            T.one_hot_smooth(y, k, 0.1) - T.one_hot_smooth(y.flip(0), k, 0.1)
        )
        lam = lam.gather(1, y.view(-1, 1)).view(b)
        if mode == "batch":
            torch.testing.assert_close(lam, lam[:1].expand(b))
        for i in range(b):
            pasted = (out[i] == x.flip(0)[i]) & (out[i] != x[i])
            if pasted.any() and (out[i] == x[i]).any():  # cutmix: a box of the mirror
                kinds.add("cutmix")
                rows, cols = pasted.any(0).any(1).nonzero(), pasted.any(0).any(0).nonzero()
                area = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
                torch.testing.assert_close(lam[i].item(), 1 - area.item() / h / h)
            else:
                kinds.add("mixup")
                mixed = x[i] * lam[i] + x.flip(0)[i] * (1 - lam[i])
                torch.testing.assert_close(out[i], mixed, atol=1e-5, rtol=1e-5)
    assert kinds == {"cutmix", "mixup"}


def test_sync_free_mixup_with_prob_zero_changes_nothing():
    x, y = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 2, 0])
    out, t = T.mixup_cutmix(x, y, 3, torch.Generator(), prob=0.0, sync_free=True)
    assert torch.equal(out, x)
    torch.testing.assert_close(t, T.one_hot_smooth(y, 3, 0.1))


def test_sync_free_resume_mid_epoch_is_exact():
    """The augmentation stream's state after two batches continues the epoch exactly."""
    aug = AugmentConfig(img_size=12, reprob=0.5, mixup_mode="elem")
    full = [x for x, _ in _loader(aug, n=32)]
    first = _loader(aug, n=32)
    it = iter(first)
    next(it), next(it)
    resumed = _loader(aug, n=32)
    resumed.set_epoch(0, 2, first.aug_state())
    rest = [x for x, _ in resumed]
    assert len(rest) == 2 and all(torch.equal(a, b) for a, b in zip(rest, full[2:], strict=True))


def test_a_state_saved_on_another_kind_of_device_restarts_the_stream():
    """A CUDA generator's state (16 bytes) cannot position a CPU one (nor the reverse): the
    epoch continues at its batch with the stream started afresh, as with no saved state."""
    aug = AugmentConfig(img_size=12)
    fresh = _loader(aug)
    fresh.set_epoch(1, 1, None)
    other = _loader(aug)
    other.set_epoch(1, 1, torch.zeros(16, dtype=torch.uint8))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(fresh, other, strict=True))


class _FakeGenerator:
    """Stands in for a CUDA generator on a machine without one: records where it was made."""

    made: list[torch.device] = []

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        _FakeGenerator.made.append(self.device)

    def manual_seed(self, seed: int) -> _FakeGenerator:
        return self


@pytest.mark.parametrize(("device", "want"), [("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_a_gpu_recipe_draws_on_a_generator_of_the_batch_device(monkeypatch, device, want):
    """Made once per pass, on the GPU, with the index the batches have (a generator of device
    'cuda' is not equal to a batch's 'cuda:0', and the erasing noise would then get a
    generator seeded from the host every batch)."""
    loader = BatchLoader(_images(8, 12), torch.arange(8) % 5, 4, num_classes=5, train=True,
                         device=device)  # fmt: skip
    monkeypatch.setattr(torch, "Generator", _FakeGenerator)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _FakeGenerator.made.clear()
    _, gen = loader.recipe.pass_start()
    assert gen.device == torch.device(want)
    assert _FakeGenerator.made == [torch.device(want)]


@pytest.mark.device
def test_on_the_device_the_recipe_syncs_nothing_and_matches_the_cpu(device):
    """On LGVIT_TEST_DEVICE: a whole pass of the recipe with no sync (CUDA: under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at the first), and RandAugment
    from the CPU's draws giving the CPU's bytes, but for CUDA's float rounding (a level, in a
    few pixels; a sample point on an image's edge may fall on the other side of it)."""
    aug = AugmentConfig(img_size=12, rand_augment="rand-m9-mstd0.5-inc1-n3", reprob=1.0,
                        mixup_mode="elem", recount=2)  # fmt: skip
    loader = BatchLoader(_images(24, 14), torch.arange(24) % 5, 8, num_classes=5, train=True,
                         aug=aug, seed=3, device=device)  # fmt: skip
    loader.recipe.sync_free = True  # the default off the CPU; forced on it
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            batches = list(loader)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    else:
        it = iter(loader)
        batches = [next(it)]
        with HostSyncGuard() as guard:
            batches += list(it)
        assert guard.calls == []
    assert len(batches) == 3 and all(x.device.type == device for x, _ in batches)
    x = _images(32, 16, seed=5)
    want = T.rand_augment(x, torch.Generator().manual_seed(3), num_ops=3)
    got = T.rand_augment(x.to(device), torch.Generator().manual_seed(3), num_ops=3, sync_free=True)
    diff = (got.cpu().int() - want.int()).abs()
    assert (diff > 0).float().mean() < 0.02 and (diff > 1).float().mean() < 1e-3
