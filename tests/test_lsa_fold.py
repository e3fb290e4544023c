"""LSA's folded local attention (the fast path) equals the plain path, in float64.

The fold computes ``kv(LayerNorm(variants))`` from the im2col patches without building the
variants; these tests pin it, layer by layer and model by model, to the paper's plain path
(``as_written``, which materialises the variants and attends with SDPA).
"""

from __future__ import annotations

import pytest
import torch

from lgvit.models import create_model, list_models
from lgvit.models.layers import as_written
from lgvit.models.lsa import LocallyShiftedViT, LocalShiftBlock

TOL = dict(rtol=1e-10, atol=1e-12)


def _randomise(m: torch.nn.Module) -> None:
    # Trained-looking weights: non-trivial LayerNorm affines and biases, so every term of the
    # fold (norm weight and bias, conv bias, position offsets) carries weight.
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.dim() == 1 else 0.1)


def _shifted_lsa_models() -> list[str]:
    """The registered LSA models whose local block attends over shifted variants."""
    names = []
    for name in list_models("lsa_*"):
        if "authors" in name:
            continue
        with torch.device("meta"):  # only the structure is read: nothing to initialise
            m = create_model(name, img_size=16, dims=(8,), depths=(1,), num_heads=2)
        if isinstance(m, LocallyShiftedViT) and isinstance(m.local_block, LocalShiftBlock):
            names.append(name)
    return names


def _stem_both_ways(m: LocallyShiftedViT, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        fast, _ = m.forward_stem(x)
        with as_written():
            plain, _ = m.forward_stem(x)
    return fast, plain


@pytest.mark.parametrize("name", _shifted_lsa_models())
def test_registered_lsa_model_folded_stem_equals_the_plain_path(name):
    """Each registered shifted-variant LSA model, at a tiny width and depth but with its own
    shifts, embedding conv and key/value head sharing, gives the same stem output folded and
    plain; the fold must actually run where the patch is narrower than the embedding."""
    torch.manual_seed(0)
    m = create_model(name, img_size=16, dims=(256,), depths=(1,), num_heads=2).double().eval()
    _randomise(m)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        variants = m.patch_embed(x)[1]
        folded = variants.fold(m.local_block.norm1, m.local_block.attn.kv)
    assert (folded is None) == (variants.patches.shape[-1] >= 256), name
    fast, plain = _stem_both_ways(m, x)
    torch.testing.assert_close(fast, plain, **TOL)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_heads": 1, "num_heads": 3},  # one key/value head shared by three query heads
        {"kv_heads": 3, "num_heads": 3},
        {"kv_heads": 2, "num_heads": 4, "conv_per_variant": False},  # one shared conv
        {"num_heads": 2, "pos_per_variant": False},  # one shared position embedding
    ],
)
def test_folded_attention_equals_plain_attention_on_random_variants(kwargs):
    """The local attention layer on its own: ShiftedVariants folded against the same variants
    materialised, random queries and patches, training-mode gradients included."""
    torch.manual_seed(1)
    m = create_model(
        "lsa_tiny_cifar", img_size=10, dims=(48,), depths=(1,), drop_path_rate=0.0, **kwargs
    ).double()
    _randomise(m)
    x = torch.randn(3, 3, 10, 10, dtype=torch.float64)
    block = m.local_block
    outs = []
    for dense in (False, True):
        m.zero_grad()
        _, variants, _ = m.patch_embed(x)
        variants = variants.add(m.pos_embed)
        torch.manual_seed(1)  # the same query both ways
        query = block.norm1(torch.randn(3, variants.shape[2], 48, dtype=torch.float64))
        assert variants.fold(block.norm1, block.attn.kv) is not None
        y = block.attn(query, variants.materialize() if dense else variants, block.norm1)
        y.square().sum().backward()
        # the conv and position embedding get their gradients through the fold too
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        outs.append((y.detach(), grads))
    (y, g), (y_ref, g_ref) = outs
    assert g.keys() == g_ref.keys() and "patch_embed.weight" in g
    torch.testing.assert_close(y, y_ref, **TOL)
    for n, ref in g_ref.items():
        torch.testing.assert_close(g[n], ref, rtol=1e-9, atol=1e-12, msg=n)
