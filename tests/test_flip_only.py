"""``random_crop_flip`` with nothing to crop (a streamed batch, already at its size) takes a
flip-only path: the same bytes and the same draws as the general gathers."""

from __future__ import annotations

import pytest
import torch

from lgvit.data.transforms import random_crop_flip


def _by_gathers(x: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
    """The general path's arithmetic for a zero crop offset: a column gather per image."""
    b, c, h, w = x.shape
    ar = torch.arange(w)
    cols = torch.where(flipped[:, None], w - 1 - ar, ar)
    return x.gather(3, cols.view(b, 1, 1, w).expand(b, c, h, w))


@pytest.mark.parametrize("mask", [False, True])
def test_flip_only_equals_the_gathers_and_keeps_the_draws(mask):
    x = torch.randint(0, 256, (9, 3, 12, 12), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state()
    flip = torch.tensor([True, False] * 4 + [True]) if mask else True
    out = random_crop_flip(x, 12, 0, flip, gen=gen)
    # the draws the general path makes: top, left (all 0 here), then the flips
    ref_gen = torch.Generator()
    ref_gen.set_state(before)
    torch.randint(0, 1, (9,), generator=ref_gen)
    torch.randint(0, 1, (9,), generator=ref_gen)
    flipped = flip if mask else torch.rand(9, generator=ref_gen) < 0.5
    assert torch.equal(out, _by_gathers(x, flipped))
    assert torch.equal(gen.get_state(), ref_gen.get_state())
    assert 0 < int(flipped.sum()) < 9 and out.data_ptr() != x.data_ptr()


def test_no_flip_is_a_copy():
    x = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    out = random_crop_flip(x, 5, 0, False, gen=torch.Generator())
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
