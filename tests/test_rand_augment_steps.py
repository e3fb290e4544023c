"""rand_augment's output, pinned byte for byte.

The sha256 of each output was recorded from the implementation before rand_augment was split
into named steps; any change to the draws, their order, the grouping by op or the op maths
changes the bytes.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from lgvit.data.transforms import rand_augment

# (rand_augment keyword arguments, sha256 of the output's bytes)
RECORDED = {
    "default": ({}, "eb14ec7a889dc4383670895be3a433ad8ef5e9b843d384c8fb79c41821e46422"),
    "m5_std0": (
        dict(magnitude=5, magnitude_std=0.0),
        "482a6cbad926a13c2fe8f0401226487503146061220985d01663d027ab61fe00",
    ),
    "m10_uniform": (
        dict(magnitude=10, magnitude_std=float("inf")),
        "ceb534ed1c68e179b05d3f329178ff8d0bfe1a88fe2364b1122bb912f653438a",
    ),
    "not_increasing": (
        dict(increasing=False, prob=1.0),
        "2796232433fb5b5734aad0642c03453eefbdeb88b23c85d07a8917e271836f71",
    ),
    "three_ops_always": (
        dict(num_ops=3, prob=1.0, magnitude=7),
        "18aadd4da2a5ba423118c88f0e85c8d52357f6f49735e04d11af2ae348986ee6",
    ),
    "black_fill_capped": (
        dict(fill=None, magnitude_max=8, magnitude=12, prob=0.9),
        "8e1f792df8cffde916585b644a6ada9b184c406c7d4cc25c38af7c9f4519e3a3",
    ),
}


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (24, 3, 14, 12), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_rand_augment_output_is_byte_identical_to_the_recorded_one(case):
    kwargs, digest = RECORDED[case]
    x = _batch()
    y = rand_augment(x, torch.Generator().manual_seed(7), **kwargs)
    assert not torch.equal(y, x)  # the ops ran
    assert torch.equal(x, _batch())  # the input is not written
    assert hashlib.sha256(y.numpy().tobytes()).hexdigest() == digest


def test_rand_augment_with_no_op_applied_returns_the_input():
    x = _batch()
    assert torch.equal(rand_augment(x, torch.Generator().manual_seed(7), prob=0.0), x)
