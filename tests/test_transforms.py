"""Tests for the batched augmentations (lgvit.data.transforms) and BatchLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from lgvit.core.errors import LgvitError
from lgvit.data import transforms as T
from lgvit.data.loader import AugmentConfig, BatchLoader, parse_rand_augment


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand_u8(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=_gen(seed))


def _to_pil(x: torch.Tensor) -> Image.Image:
    """(3, H, W) uint8 tensor -> RGB PIL image."""
    return Image.fromarray(x.permute(1, 2, 0).contiguous().numpy())


def _from_pil(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


# --------------------------------------------------------------------------- mixup / cutmix


def test_one_hot_smooth_on_off_values():
    y = torch.tensor([0, 3, 9])
    t = T.one_hot_smooth(y, 10, 0.1)
    off, on = 0.1 / 10, 1 - 0.1 + 0.1 / 10
    expected = torch.full((3, 10), off)
    expected[torch.arange(3), y] = on
    torch.testing.assert_close(t, expected)
    torch.testing.assert_close(t.sum(1), torch.ones(3))
    torch.testing.assert_close(T.one_hot_smooth(y, 10, 0.0), F.one_hot(y, 10).float())


@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_mixup_targets_rows_sum_to_one(mode):
    x = torch.randn(8, 3, 16, 16, generator=_gen(1))
    y = torch.randint(0, 5, (8,), generator=_gen(2))
    for seed in range(10):
        out, t = T.mixup_cutmix(x, y, 5, _gen(seed), label_smoothing=0.1, mode=mode)
        assert out.shape == x.shape and t.shape == (8, 5)
        torch.testing.assert_close(t.sum(1), torch.ones(8))
        assert (t >= 0).all()


def test_mixup_blends_images_and_labels_with_same_lambda():
    x = torch.randn(6, 3, 8, 8, generator=_gen(1))
    y = torch.arange(6)
    out, t = T.mixup_cutmix(x, y, 6, _gen(5), mixup_alpha=0.8, cutmix_alpha=0.0, label_smoothing=0)
    lam = t[0, 0].item()
    assert 0.0 < lam < 1.0
    torch.testing.assert_close(out, x * lam + x.flip(0) * (1 - lam))
    torch.testing.assert_close(t[torch.arange(6), y], torch.full((6,), lam))


def test_cutmix_box_lambda_and_outside_pixels():
    b, h, w = 6, 16, 20
    x = torch.randn(b, 3, h, w, generator=_gen(1))
    y = torch.arange(b)
    checked = 0
    for seed in range(20):
        out, t = T.mixup_cutmix(
            x, y, b, _gen(seed), mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.0
        )
        changed = (out != x).any(1)  # (B, H, W)
        if not changed.any():
            continue
        # The changed region is one rectangle, the same for every sample (batch mode).
        rows = changed[0].any(1).nonzero().view(-1)
        cols = changed[0].any(0).nonzero().view(-1)
        yl, yh, xl, xh = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
        box = torch.zeros(h, w, dtype=torch.bool)
        box[yl:yh, xl:xh] = True
        assert torch.equal(changed, box.expand(b, h, w))
        # Inside comes from the mirrored sample, outside is untouched.
        torch.testing.assert_close(out[..., box], x.flip(0)[..., box])
        torch.testing.assert_close(out[..., ~box], x[..., ~box])
        lam = 1 - box.sum().item() / (h * w)
        torch.testing.assert_close(t[torch.arange(b), y], torch.full((b,), lam))
        torch.testing.assert_close(t[torch.arange(b), y.flip(0)], torch.full((b,), 1 - lam))
        checked += 1
    assert checked >= 5


def test_mixup_prob_zero_gives_smoothed_labels_only():
    x = torch.randn(4, 3, 8, 8)
    y = torch.tensor([1, 0, 2, 1])
    out, t = T.mixup_cutmix(x, y, 3, _gen(0), prob=0.0, label_smoothing=0.1)
    assert torch.equal(out, x)
    torch.testing.assert_close(t, T.one_hot_smooth(y, 3, 0.1))


def test_mixup_odd_batch_raises():
    with pytest.raises(LgvitError, match="even"):
        T.mixup_cutmix(torch.randn(3, 3, 4, 4), torch.zeros(3, dtype=torch.long), 2, _gen())


def test_soft_target_cross_entropy_matches_hard_ce():
    logits = torch.randn(5, 7, generator=_gen(3))
    y = torch.tensor([0, 6, 2, 2, 4])
    got = T.soft_target_cross_entropy(logits, F.one_hot(y, 7).float())
    torch.testing.assert_close(got, F.cross_entropy(logits, y))
    smooth = T.soft_target_cross_entropy(logits, T.one_hot_smooth(y, 7, 0.1))
    torch.testing.assert_close(smooth, F.cross_entropy(logits, y, label_smoothing=0.1))


# --------------------------------------------------------------------------- RandAugment ops


def test_rand_augment_dtype_shape_range_and_reproducible():
    x = _rand_u8((32, 3, 16, 16))
    out = T.rand_augment(x, _gen(7))
    assert out.dtype == torch.uint8 and out.shape == x.shape
    assert not torch.equal(out, x)
    assert torch.equal(out, T.rand_augment(x, _gen(7)))
    assert not torch.equal(out, T.rand_augment(x, _gen(8)))
    # Input is not modified in place.
    assert torch.equal(x, _rand_u8((32, 3, 16, 16)))


def test_rand_augment_roughly_half_of_ops_apply():
    x = _rand_u8((400, 3, 8, 8), seed=3)
    out = T.rand_augment(x, _gen(0), num_ops=1)
    changed = (out != x).flatten(1).any(1).float().mean().item()
    # p = 0.5 per op; a few applied ops are no-ops on some images, so slightly below 0.5.
    assert 0.35 < changed < 0.6


def test_rand_augment_level_to_arg_mapping():
    # magnitude 10, no noise, p=1, one op: every output must be one of timm's ops at level 10.
    x = _rand_u8((1, 3, 8, 8), seed=12)
    fill = (124, 116, 104)
    candidates = {
        "AutoContrast": T.auto_contrast(x),
        "Equalize": T.equalize(x),
        "Invert": T.invert(x),
        "PosterizeIncreasing": T.posterize(x, 0),  # 4 - int(4 * 10 / 10)
        "SolarizeIncreasing": T.solarize(x, 0),  # 256 - int(256 * 10 / 10)
        "SolarizeAdd": T.solarize_add(x, 110, 128),
    }
    for sign in (1, -1):
        candidates[f"Rotate{sign}"] = T.rotate(x, 30.0 * sign, fill)
        candidates[f"ShearX{sign}"] = T.shear_x(x, 0.3 * sign, fill)
        candidates[f"ShearY{sign}"] = T.shear_y(x, 0.3 * sign, fill)
        candidates[f"TranslateX{sign}"] = T.translate_x(x, 0.45 * 8 * sign, fill)
        candidates[f"TranslateY{sign}"] = T.translate_y(x, 0.45 * 8 * sign, fill)
        for fn in (T.adjust_color, T.adjust_contrast, T.adjust_brightness, T.adjust_sharpness):
            candidates[f"{fn.__name__}{sign}"] = fn(x, max(0.1, 1 + 0.9 * sign))
    out = T.rand_augment(
        x.expand(300, 3, 8, 8), _gen(0), num_ops=1, magnitude=10, magnitude_std=0.0, prob=1.0
    )
    hit = set()
    for o in out:
        names = [k for k, v in candidates.items() if torch.equal(o, v[0])]
        assert names, "output matches no RandAugment op at level 10"
        hit.update(names)
    assert len(hit) >= 20


def test_invert_posterize_solarize():
    x = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    assert torch.equal(T.invert(x), 255 - x)
    assert torch.equal(T.posterize(x, 4), x & 0xF0)
    assert torch.equal(T.posterize(x, 8), x)
    assert torch.equal(T.posterize(x, 0), torch.zeros_like(x))
    sol = T.solarize(x, 128)
    assert torch.equal(sol, torch.where(x >= 128, 255 - x, x))
    add = T.solarize_add(x, 100, 128)
    expected = torch.where(x < 128, (x.int() + 100).clamp(max=255), x.int()).to(torch.uint8)
    assert torch.equal(add, expected)
    # Per-sample parameters.
    two = torch.cat([x, x])
    assert torch.equal(T.posterize(two, torch.tensor([4, 2]))[1], x[0] & 0xC0)


def test_equalize_two_value_image_matches_pil():
    x = torch.full((1, 3, 32, 32), 50, dtype=torch.uint8)
    x[..., 16:, :] = 200
    out = T.equalize(x)
    assert out.min() == 0 and out.max() == 255
    assert torch.equal(out[0], _from_pil(ImageOps.equalize(_to_pil(x[0]))))


def test_equalize_and_autocontrast_match_pil_on_random_images():
    # 48x64 pixels: PIL's step is ~12, so its rounding offset (step // 2) matters.
    x = _rand_u8((4, 3, 48, 64), seed=11)
    x[1] = x[1] // 4 + 60  # low-contrast image: autocontrast really stretches it
    x[2, 0] = 77  # constant channel: both ops leave it alone
    eq, ac = T.equalize(x), T.auto_contrast(x)
    for i in range(4):
        assert torch.equal(eq[i], _from_pil(ImageOps.equalize(_to_pil(x[i]))))
        assert torch.equal(ac[i], _from_pil(ImageOps.autocontrast(_to_pil(x[i]))))
    assert ac[1].flatten(1).amin(1).tolist() == [0, 0, 0]
    assert ac[1].flatten(1).amax(1).tolist() == [255, 255, 255]


@pytest.mark.parametrize(
    "ours, pil",
    [
        (T.adjust_brightness, ImageEnhance.Brightness),
        (T.adjust_contrast, ImageEnhance.Contrast),
        (T.adjust_color, ImageEnhance.Color),
        (T.adjust_sharpness, ImageEnhance.Sharpness),
    ],
)
@pytest.mark.parametrize("factor", [0.1, 0.55, 1.0, 1.9])
def test_enhance_ops_match_pil(ours, pil, factor):
    x = _rand_u8((3, 3, 8, 8), seed=5)
    out = ours(x, factor)
    for i in range(3):
        ref = _from_pil(pil(_to_pil(x[i])).enhance(factor))
        assert (out[i].int() - ref.int()).abs().max() <= 2


def test_rotate_90_equals_rot90_on_interior():
    x = _rand_u8((2, 3, 9, 9), seed=4)
    out = T.rotate(x, 90.0, fill=(124, 116, 104))
    ref = torch.rot90(x, 1, dims=(-2, -1))  # counter-clockwise, like PIL's rotate(90)
    assert torch.equal(out[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1])
    pil = _from_pil(_to_pil(x[0]).rotate(90, resample=Image.BILINEAR))
    assert torch.equal(out[0, :, 1:-1, 1:-1], pil[:, 1:-1, 1:-1])


def test_translate_and_shear_match_pil_and_fill():
    x = _rand_u8((1, 3, 10, 12), seed=6)
    fill = (124, 116, 104)
    out = T.translate_x(x, 3.0, fill)
    assert torch.equal(out[0, :, :, :9], x[0, :, :, 3:])  # integer shift is exact
    assert (out[0, :, :, 9:] == torch.tensor(fill).view(3, 1, 1)).all()
    out = T.translate_y(x, -2.0, fill)
    assert torch.equal(out[0, :, 2:], x[0, :, :8])
    img = _to_pil(x[0])
    for fn, data, arg in [
        (T.shear_x, (1, 0.27, 0, 0, 1, 0), 0.27),
        (T.shear_y, (1, 0, 0, -0.2, 1, 0), -0.2),
    ]:
        ref = _from_pil(img.transform(img.size, Image.AFFINE, data, Image.BILINEAR, fillcolor=fill))
        diff = (fn(x, arg, fill)[0].int() - ref.int()).abs()
        assert diff.max() <= 1


def test_parse_rand_augment():
    assert parse_rand_augment("rand-m9-mstd0.5-inc1") == {
        "magnitude": 9,
        "magnitude_std": 0.5,
        "increasing": True,
        "num_ops": 2,
    }
    p = parse_rand_augment("rand-m7-n3-p0.7")
    assert p["num_ops"] == 3 and p["magnitude"] == 7 and p["prob"] == 0.7
    assert p["increasing"] is False
    for bad in ["rand-x9", "augmix-m3", "rand-m", "", "rand-m9-foo1"]:
        with pytest.raises(LgvitError, match="RandAugment"):
            parse_rand_augment(bad)
    with pytest.raises(LgvitError):
        AugmentConfig(rand_augment="rand-q3")


# --------------------------------------------------------------------------- crops, erasing


def test_random_crop_flip_matches_hand_computed_crop():
    x = _rand_u8((6, 3, 10, 10), seed=2)
    size, pad = 8, 3
    out = T.random_crop_flip(x, size, pad, True, gen=_gen(9))
    g = _gen(9)
    top = torch.randint(0, 10 + 2 * pad - size + 1, (6,), generator=g)
    left = torch.randint(0, 10 + 2 * pad - size + 1, (6,), generator=g)
    flipped = torch.rand(6, generator=g) < 0.5
    xp = F.pad(x, (pad,) * 4)
    for i in range(6):
        crop = xp[i, :, top[i] : top[i] + size, left[i] : left[i] + size]
        expected = crop.flip(-1) if flipped[i] else crop
        assert torch.equal(out[i], expected)
    assert flipped.any() and not flipped.all()  # the seed exercises both branches


def test_random_crop_without_padding_or_flip_is_identity():
    x = _rand_u8((3, 3, 8, 8))
    assert torch.equal(T.random_crop_flip(x, 8, 0, False, gen=_gen()), x)


def test_random_crops_take_an_explicit_flip_mask():
    x = _rand_u8((6, 3, 10, 10), seed=4)
    mask = torch.tensor([True, False, False, True, True, False])
    out = T.random_crop_flip(x, 8, 2, mask, gen=_gen(5))
    g = _gen(5)  # crop offsets only: nothing is drawn for a given mask
    top = torch.randint(0, 10 + 4 - 8 + 1, (6,), generator=g)
    left = torch.randint(0, 10 + 4 - 8 + 1, (6,), generator=g)
    xp = F.pad(x, (2,) * 4)
    for i in range(6):
        crop = xp[i, :, top[i] : top[i] + 8, left[i] : left[i] + 8]
        assert torch.equal(out[i], crop.flip(-1) if mask[i] else crop)
    whole = T.random_resized_crop(x, 10, scale=(1.0, 1.0), ratio=(1.0, 1.0), gen=_gen(), flip=mask)
    for i in range(6):
        assert torch.equal(whole[i], x[i].flip(-1) if mask[i] else x[i])
    with pytest.raises(LgvitError, match=r"flip mask: expected a \(6,\) bool tensor"):
        T.random_crop_flip(x, 8, 2, mask[:5], gen=_gen())


def test_random_resized_crop_shape_and_full_crop_identity():
    x = _rand_u8((5, 3, 24, 24), seed=1)
    out = T.random_resized_crop(x, 16, gen=_gen(0))
    assert out.shape == (5, 3, 16, 16) and out.dtype == torch.uint8
    # Whole-image crops at the same size reproduce the input (flip applied by hand).
    g = _gen(3)
    same = T.random_resized_crop(x, 24, scale=(1.0, 1.0), ratio=(1.0, 1.0), gen=g, flip=False)
    assert torch.equal(same, x)


def test_random_resized_crop_box_geometry():
    # scale 1/4 with ratio 1 on 16x16 means an 8x8 box; resized to 8 it is an exact crop.
    x = _rand_u8((8, 3, 16, 16), seed=3)
    out = T.random_resized_crop(x, 8, scale=(0.25, 0.25), ratio=(1.0, 1.0), gen=_gen(1))
    n_flipped = 0
    for i in range(8):
        crops = {
            (t, le, f): x[i, :, t : t + 8, le : le + 8].flip(-1)
            if f
            else x[i, :, t : t + 8, le : le + 8]
            for t in range(9)
            for le in range(9)
            for f in (False, True)
        }
        matches = [k for k, v in crops.items() if torch.equal(out[i], v)]
        assert matches
        n_flipped += matches[0][2]
    assert 0 < n_flipped < 8


def test_resize_center_crop():
    x = _rand_u8((2, 3, 32, 32))
    assert torch.equal(T.resize_center_crop(x, 32), x)
    big = _rand_u8((2, 3, 48, 64))
    out = T.resize_center_crop(big, 32, crop_pct=0.875)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.uint8
    # A constant image stays constant through resize + crop.
    const = torch.full((1, 3, 40, 40), 90, dtype=torch.uint8)
    assert (T.resize_center_crop(const, 24) == 90).all()


def test_random_erasing():
    x = torch.randn(16, 3, 12, 12, generator=_gen(0))
    assert torch.equal(T.random_erasing(x, _gen(1), prob=0.0), x)
    out = T.random_erasing(x, _gen(1), prob=1.0)
    assert out.shape == x.shape
    changed = out != x
    for i in range(16):
        region = changed[i].all(0)  # 'pixel' mode replaces all channels of the box
        assert region.any()
        rows = region.any(1).nonzero().view(-1)
        cols = region.any(0).nonzero().view(-1)
        # The erased region is a rectangle (no holes), strictly smaller than the image.
        box = region[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert box.all() and region.sum() == box.numel()
        frac = box.numel() / 144
        assert 0.01 <= frac <= 0.4 and box.numel() < 144
    assert torch.equal(x, torch.randn(16, 3, 12, 12, generator=_gen(0)))  # not in place
    # A box must fit strictly inside the image (timm): a full-image box is never used.
    full = T.random_erasing(x, _gen(1), prob=1.0, min_area=1.0, max_area=1.0, min_aspect=1.0)
    assert torch.equal(full, x)


def test_normalize_matches_formula():
    x = _rand_u8((2, 3, 4, 4))
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    out = T.normalize(x, mean, std)
    ref = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- BatchLoader


def _data(n: int = 40, size: int = 8):
    images = _rand_u8((n, 3, size, size), seed=42)
    return images, torch.arange(n)


def _plain_aug(**kw) -> AugmentConfig:
    """Augmentation on, but int labels (no mixup/smoothing) so samples can be tracked."""
    base = dict(img_size=8, mixup=0.0, cutmix=0.0, label_smoothing=0.0)
    base.update(kw)
    return AugmentConfig(**base)


def test_loader_reproducible_and_epoch_dependent():
    images, labels = _data()
    aug = AugmentConfig(img_size=8)

    def run(epoch: int):
        ld = BatchLoader(images, labels, 8, num_classes=40, train=True, aug=aug, seed=3)
        ld.set_epoch(epoch)
        return list(ld)

    a, b, c = run(1), run(1), run(2)
    assert len(a) == 5
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == (8, 3, 8, 8) and xa.dtype == torch.float32
    assert ya.shape == (8, 40)  # soft targets with mixup + smoothing
    torch.testing.assert_close(ya.sum(1), torch.ones(8))
    assert not torch.equal(a[0][0], c[0][0])
    # Resuming at an epoch boundary gives the same data as running through.
    ld = BatchLoader(images, labels, 8, num_classes=40, train=True, aug=aug, seed=3)
    for epoch in range(3):
        ld.set_epoch(epoch)
        got = list(ld)
    for (xa, _), (xc, _) in zip(got, c, strict=True):
        assert torch.equal(xa, xc)


def test_loader_augmentation_stream_depends_on_seed_epoch_and_rank():
    # All images identical, so only the augmentation randomness can tell batches apart.
    images = _rand_u8((1, 3, 8, 8)).expand(8, 3, 8, 8).contiguous()
    labels = torch.zeros(8, dtype=torch.long)

    def first_batch(seed: int = 0, epoch: int = 0, rank: int = 0) -> torch.Tensor:
        ld = BatchLoader(
            images,
            labels,
            4,
            num_classes=2,
            train=True,
            aug=AugmentConfig(img_size=8),
            seed=seed,
            rank=rank,
            world_size=2,
        )
        ld.set_epoch(epoch)
        return next(iter(ld))[0]

    ref = first_batch()
    assert torch.equal(ref, first_batch())
    assert not torch.equal(ref, first_batch(epoch=1))
    assert not torch.equal(ref, first_batch(rank=1))
    assert not torch.equal(ref, first_batch(seed=1))


def test_alternating_flip_mirrors_each_image_in_every_other_epoch():
    # Crop without padding (a no-op at full size), so each sample is its image or its mirror.
    images, labels = _data(40)
    aug = _plain_aug(crop_padding=0, rand_augment=None, reprob=0.0, alternate_flip=True)
    plain = T.normalize(images, aug.mean, aug.std)

    def flipped(epoch: int, rank: int = 0, world: int = 1, seed: int = 7) -> dict[int, bool]:
        ld = BatchLoader(images, labels, 4, num_classes=40, train=True, aug=aug, seed=seed,
                         rank=rank, world_size=world)  # fmt: skip
        ld.set_epoch(epoch)
        out = {}
        for x, y in ld:
            for xi, i in zip(x, y.tolist(), strict=True):
                assert torch.equal(xi, plain[i]) or torch.equal(xi, plain[i].flip(-1))
                out[i] = torch.equal(xi, plain[i].flip(-1))
        return out

    e0, e1, e2 = flipped(0), flipped(1), flipped(2)
    assert 10 < sum(e0.values()) < 30  # a random phase per image
    assert all(e0[i] != e1[i] and e0[i] == e2[i] for i in range(40))
    # Every rank agrees on the phase (a shard of epoch 1 matches the single-process run).
    shard = flipped(1, rank=1, world=2)
    assert len(shard) == 20 and all(shard[i] == e1[i] for i in shard)
    assert flipped(0, seed=8) != e0


def test_loader_rank_shards_disjoint_and_cover():
    images, labels = _data(40)
    seen = []
    for rank in range(2):
        ld = BatchLoader(
            images,
            labels,
            4,
            num_classes=40,
            train=True,
            aug=_plain_aug(),
            rank=rank,
            world_size=2,
            seed=1,
        )
        ld.set_epoch(5)
        ys = torch.cat([y for _, y in ld])
        assert ys.dtype == torch.int64
        assert torch.equal(ys, ld.indices())
        seen.append(set(ys.tolist()))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(40))
    # The permutation is shuffled and changes with the epoch.
    ld = BatchLoader(images, labels, 4, num_classes=40, train=True, aug=_plain_aug())
    assert not torch.equal(ld.indices(), torch.arange(40))
    first = ld.indices()
    ld.set_epoch(1)
    assert not torch.equal(first, ld.indices())


def test_loader_len_and_padding():
    images, labels = _data(41)
    kw = dict(num_classes=41, aug=_plain_aug())
    assert len(BatchLoader(images, labels, 6, train=True, **kw)) == 6  # drop_last default
    assert len(BatchLoader(images, labels, 6, train=True, drop_last=False, **kw)) == 7
    assert len(BatchLoader(images, labels, 6, train=False, **kw)) == 7
    for rank in range(2):  # 41 padded to 42 -> 21 per rank
        ld = BatchLoader(
            images, labels, 5, train=True, rank=rank, world_size=2, drop_last=False, **kw
        )
        assert ld.num_samples == 21 and len(ld) == 5 == len(list(ld))
    # Eval is not padded: disjoint shards of 21 and 20 that cover the dataset exactly once.
    shards = [
        BatchLoader(images, labels, 5, train=False, rank=r, world_size=2, **kw) for r in range(2)
    ]
    ys = [torch.cat([y for _, y in ld]) for ld in shards]
    assert [ld.num_samples for ld in shards] == [21, 20]
    assert sorted(torch.cat(ys).tolist()) == list(range(41))
    assert [len(ld) for ld in shards] == [len(list(ld)) for ld in shards] == [5, 4]


def test_loader_mixup_odd_tail_and_odd_batch():
    images, labels = _data(41)
    ld = BatchLoader(
        images,
        labels,
        8,
        num_classes=41,
        train=True,
        drop_last=False,
        aug=AugmentConfig(img_size=8),
    )
    sizes = [x.shape[0] for x, _ in ld]
    assert len(ld) == len(sizes) == 5 and sizes == [8, 8, 8, 8, 8]  # lone tail sample dropped
    ld = BatchLoader(
        images[:39],
        labels[:39],
        8,
        num_classes=41,
        train=True,
        drop_last=False,
        aug=AugmentConfig(img_size=8),
    )
    assert [x.shape[0] for x, _ in ld][-1] == 6  # 7 -> 6 to keep the batch even
    with pytest.raises(LgvitError, match="even"):
        BatchLoader(images, labels, 7, num_classes=41, train=True, aug=AugmentConfig(img_size=8))


def test_loader_eval_in_order_with_int_labels():
    images, labels = _data(20)
    aug = AugmentConfig(img_size=8)
    ld = BatchLoader(images, labels, 6, num_classes=20, train=False, aug=aug)
    xs, ys = zip(*ld, strict=True)
    assert [y.dtype for y in ys] == [torch.int64] * 4
    assert torch.equal(torch.cat(ys), labels)
    torch.testing.assert_close(torch.cat(xs), T.normalize(images, aug.mean, aug.std))
    # Larger images are resized + centre-cropped to img_size for eval.
    big = _rand_u8((4, 3, 12, 12))
    ld = BatchLoader(big, torch.arange(4), 4, num_classes=4, train=False, aug=aug)
    ((x, _),) = list(ld)
    assert x.shape == (4, 3, 8, 8)


def test_loader_train_resizes_mismatched_images_and_repeated_aug():
    images = _rand_u8((16, 3, 12, 12))
    ld = BatchLoader(
        images,
        torch.arange(16),
        4,
        num_classes=16,
        train=True,
        aug=AugmentConfig(img_size=8, rand_augment=None),
    )
    x, y = next(iter(ld))
    assert x.shape == (4, 3, 8, 8) and y.shape == (4, 16)
    ld = BatchLoader(
        images,
        torch.arange(16),
        4,
        num_classes=16,
        train=True,
        aug=_plain_aug(),
        repeated_aug=3,
        world_size=2,
        drop_last=False,
    )
    idx = ld.indices()
    assert idx.numel() == 8 == ld.num_samples  # epoch length stays ~N, like DeiT's RASampler


def test_loader_rejects_bad_input():
    images, labels = _data(10)
    with pytest.raises(LgvitError, match="uint8"):
        BatchLoader(images.float(), labels, 2, num_classes=10, train=True)
    with pytest.raises(LgvitError, match="labels"):
        BatchLoader(images, labels + 5, 2, num_classes=10, train=True)
    with pytest.raises(LgvitError, match="train_crop"):
        AugmentConfig(train_crop="center")
