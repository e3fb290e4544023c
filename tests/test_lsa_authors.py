"""The LSA authors' released models (``*_authors``): their sizes, their checkpoint layout, their
forward restated independently, and the refusal of their checkpoints by the paper's models.

Output equality with the authors' own code is measured outside the repository (docs/models.md
gives the numbers); here the key names and shapes of their five models are fixtures, and a
restatement of their forward on their state-dict layout is the reference.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lgvit
from lgvit.checkpoints.files import load_weights, save_checkpoint
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.models.layers import DropPath
from lgvit.models.loading import load_initial_weights
from lgvit.models.lsa import CIFAR_SHIFTS, shift_patch_index
from lgvit.models.lsa_authors import AUTHORS_IMAGENET_SHIFTS, SharedNorm
from lgvit.tools.measure import count_params

FIXTURE = Path(__file__).parent / "fixtures" / "lsa_authors_keys.json"
AUTHORS = [
    "lsa_tiny_cifar_authors",
    "lsa_small_cifar_authors",
    "lsa_base_cifar_authors",
    "lsa_tiny_224_authors",
    "lsa_small_224_authors",
]
# What their scripts print as "number of params" (main_*.py), in millions.
THEIR_PARAMS_M = dict(zip(AUTHORS, (10.14, 32.77, 102.78, 9.91, 22.15), strict=True))


def their_keys(name: str) -> list[tuple[str, list[int]]]:
    return [tuple(kv) for kv in json.loads(FIXTURE.read_text())[name]]


def meta(name: str, **kw):
    with torch.device("meta"):
        return lgvit.create_model(name, **kw)


@pytest.fixture(scope="module")
def their_tiny_cifar(tmp_path_factory) -> Path:
    """A checkpoint of their tiny CIFAR-10 model, as their training loop writes it: the weights
    under ``model`` beside the optimizer state and the argparse ``Namespace``."""
    g = torch.Generator().manual_seed(0)
    sd = {k: 0.02 * torch.randn(shape, generator=g) for k, shape in their_keys(AUTHORS[0])}
    path = tmp_path_factory.mktemp("theirs") / "checkpoint.pth"
    args = argparse.Namespace(data_set="cifar10", lr=0.00025, drop_path=0.1)
    torch.save({"model": sd, "optimizer": {"state": {}}, "epoch": 299, "args": args}, path)
    return path


# ----------------------------------------------------------------------------- sizes and layout


@pytest.mark.parametrize("name", AUTHORS)
def test_param_counts_are_theirs(name):
    theirs = sum(math.prod(shape) for _, shape in their_keys(name))  # all their params train
    assert count_params(meta(name)) == theirs
    assert round(theirs / 1e6, 2) == THEIR_PARAMS_M[name]


@pytest.mark.parametrize("name", AUTHORS)
def test_their_key_names_and_shapes_load_strictly(name):
    # Facts from their models (built once from their code): every key and shape.
    keys = their_keys(name)
    assert any(k.endswith("Wkv_even.weight") for k, _ in keys)
    with torch.device("meta"):
        sd = {k: torch.empty(shape) for k, shape in keys}
    m = meta(name)
    m.load_state_dict(m.checkpoint_filter_fn(sd), strict=True, assign=True)


def test_structure_follows_their_scripts():
    tiny = meta("lsa_tiny_cifar_authors")
    attns = [tiny.local_block.attn] + [b.attn for s in tiny.stages for b in s.blocks]
    assert {(a.num_heads, a.kv_heads) for a in attns} == {(4, 1)}
    assert tiny.patch_embed.shifts == CIFAR_SHIFTS and tiny.patch_embed.mode == "circular"
    base = meta("lsa_base_cifar_authors").stages[3].blocks[2].attn
    assert (base.num_heads, base.kv_heads) == (12, 1)
    small = meta("lsa_small_224_authors")
    assert small.patch_embed.shifts == AUTHORS_IMAGENET_SHIFTS and small.patch_embed.mode == "pad"
    assert [s.blocks[0].attn.kv_heads for s in small.stages] == [2, 6, 12]
    assert small.embed_conv == (4, 4, 0) and meta("lsa_tiny_224_authors").embed_conv == (9, 7, 1)
    # One LayerNorm pair per stage: stage 1's is the local block's.
    for blk in tiny.stages[0].blocks:
        assert isinstance(blk.norm1, SharedNorm) and blk.norm1.shared is tiny.local_block.norm1
        assert blk.norm2.shared is tiny.local_block.norm2
    s1 = tiny.stages[1].blocks
    assert isinstance(s1[0].norm1, torch.nn.LayerNorm) and s1[3].norm2.shared is s1[0].norm2
    assert not any(".norm" in k for k in tiny.state_dict() if k.startswith("stages.0."))

    # A constant drop path, whatever the depth.
    def rates(m):
        return {d.drop_prob for d in m.modules() if isinstance(d, DropPath)}

    assert rates(tiny) == {0.1} and rates(meta(AUTHORS[0], drop_path_rate=0.3)) == {0.3}


def test_shared_norms_survive_copies_and_lgvit_checkpoints(tmp_path):
    torch.manual_seed(0)
    size = dict(img_size=16, dims=(32,) * 4, depths=(2, 2, 1, 1))
    m = lgvit.create_model(AUTHORS[0], **size).eval()
    c = copy.deepcopy(m).double()  # an EMA copy; a dtype change reaches the shared norms
    assert c.stages[0].blocks[0].norm1.shared is c.local_block.norm1
    assert c.stages[0].blocks[0].norm1.shared.weight.dtype == torch.float64
    with torch.no_grad():
        assert c(torch.ones(1, 3, 16, 16, dtype=torch.float64)).dtype == torch.float64
    # No tensor is stored twice, so the safetensors checkpoint writes and loads back.
    save_checkpoint(tmp_path / "ft", m.state_dict())
    back = lgvit.create_model(AUTHORS[0], checkpoint_path=str(tmp_path / "ft"), **size).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- their forward


def _reference(sd: dict, x: torch.Tensor, heads, shared_kv: bool, shifts, padded: bool, conv):
    """Their forward (cifar/cifar_model.py, imagenet_model.py) restated on their state dict, a
    batch of one included: T shifted copies (rolled, or circularly padded on the top/left),
    T convs, per-variant positions, local attention over the copies, then global stages whose
    blocks share the stage's LayerNorm pair, conv/LN/max-pool between stages, LN, mean, head."""

    def ln(z, key):
        return F.layer_norm(z, z.shape[-1:], sd[f"{key}.weight"], sd[f"{key}.bias"], 1e-6)

    def lin(z, key):
        return F.linear(z, sd[f"{key}.weight"], sd[f"{key}.bias"])

    def split(q, kv, h):  # q (..., C), kv (..., 2 * kvh * d) -> per-head q, k, v
        d = q.shape[-1] // h
        k, v = kv.chunk(2, -1)
        kvh = 1 if shared_kv else h
        return (q.unflatten(-1, (h, d)), k.unflatten(-1, (kvh, d)), v.unflatten(-1, (kvh, d)), d)

    _, stride, pad = conv  # kernel, stride, padding of the embedding convs
    copies = []
    for t, (dy, dx) in enumerate(shifts):
        img = F.pad(x, (dx, 0, dy, 0), mode="circular") if padded else x.roll((dy, dx), (2, 3))
        w, b = (sd[f"to_patch_embedding.projections.{t}.{p}"] for p in ("weight", "bias"))
        copies.append(F.conv2d(img, w, b, stride=stride, padding=pad).flatten(2).transpose(1, 2))
    z = torch.stack(copies) + sd["layers.0.0.pos_emb"][:, None]  # (T, B, N, C)
    n_stages = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    heads = [heads] * n_stages if isinstance(heads, int) else heads
    out = z[0]
    for i in range(n_stages):
        pre = f"layers.{i}.0"
        if i:
            out = out + sd[f"{pre}.pos_emb"]
        depth = 1 + max(int(k.split(".")[4]) for k in sd if k.startswith(f"{pre}.layers."))
        for j in range(depth):
            blk = f"{pre}.layers.{j}"
            if i == 0 and j == 0:  # local: each position's query over its T copies
                q = lin(ln(out, f"{pre}.norm1"), f"{blk}.0.Wq_even")
                kv = lin(ln(z, f"{pre}.norm1"), f"{blk}.0.Wkv_even")
                q, k, v, d = split(q, kv, heads[i])  # q (B,N,h,d), k/v (T,B,N,kvh,d)
                a = (torch.einsum("bnhd,tbnhd->bnht", q, k.expand(-1, -1, -1, q.shape[2], -1))
                     * d**-0.5).softmax(-1)  # fmt: skip
                o = torch.einsum("bnht,tbnhd->bnhd", a, v.expand(-1, -1, -1, q.shape[2], -1))
            else:
                h = ln(out, f"{pre}.norm1")
                q, k, v, d = split(lin(h, f"{blk}.0.Wq_odd"), lin(h, f"{blk}.0.Wkv_odd"), heads[i])
                k, v = (kv_.expand(-1, -1, q.shape[2], -1) for kv_ in (k, v))
                a = (torch.einsum("bihd,bjhd->bhij", q, k) * d**-0.5).softmax(-1)
                o = torch.einsum("bhij,bjhd->bihd", a, v)
            out = out + lin(o.flatten(2), f"{blk}.0.proj")
            hid = F.gelu(lin(ln(out, f"{pre}.norm2"), f"{blk}.1.fc1"))
            out = out + lin(hid, f"{blk}.1.fc2")
        if i < n_stages - 1:
            r = f"layers.{i}.1"
            B, N, C = out.shape
            g = math.isqrt(N)
            m = F.conv2d(out.transpose(1, 2).reshape(B, C, g, g), sd[f"{r}.conv.weight"],
                         sd[f"{r}.conv.bias"], padding=1)  # fmt: skip
            m = ln(m.permute(0, 2, 3, 1), f"{r}.norm").permute(0, 3, 1, 2)
            out = F.max_pool2d(m, 3, 2, 1).flatten(2).transpose(1, 2)
    return lin(ln(out, "norm").mean(1), "mlp_head")


def _unfused(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our fused ``attn.qkv`` as ``attn.q`` (its first ``dim`` rows) and ``attn.kv``, as their
    ``Wq`` and ``Wkv``."""
    out = {}
    for key, v in sd.items():
        if ".attn.qkv." not in key:
            out[key] = v
            continue
        dim = sd[key.replace(".bias", ".weight")].shape[1]
        out[key.replace(".qkv.", ".q.")], out[key.replace(".qkv.", ".kv.")] = v[:dim], v[dim:]
    return out


def _to_their_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict of an ``*_authors`` model in their names (an independent inverse)."""
    parts = {"attn.q": "0.Wq_{}", "attn.kv": "0.Wkv_{}", "attn.proj": "0.proj",
             "mlp.fc1": "1.fc1", "mlp.fc2": "1.fc2"}  # fmt: skip
    out = {}
    for t in range(sd["patch_embed.weight"].shape[0]):
        for p in ("weight", "bias"):
            out[f"to_patch_embedding.projections.{t}.{p}"] = sd[f"patch_embed.{p}"][t]
    for key, v in _unfused(sd).items():
        if key.startswith("patch_embed."):
            continue
        if key == "pos_embed":
            out["layers.0.0.pos_emb"] = v
        elif key.startswith(("head.", "norm.")):
            out[key.replace("head.", "mlp_head.", 1)] = v
        elif m := re.fullmatch(r"stages\.(\d+)\.pos_embed", key):
            out[f"layers.{m[1]}.0.pos_emb"] = v
        elif m := re.fullmatch(r"stages\.(\d+)\.downsample\.(.+)", key):
            out[f"layers.{int(m[1]) - 1}.1.{m[2]}"] = v
        else:
            m = re.fullmatch(r"(?:local_block|stages\.(\d+)\.blocks\.(\d+))\.(.+)\.(\w+)", key)
            i = int(m[1] or 0)
            j = 0 if m[1] is None else int(m[2]) + (i == 0)
            if m[3] in ("norm1", "norm2"):
                out[f"layers.{i}.0.{m[3]}.{m[4]}"] = v
            else:  # their local attention's projections are the "even" ones
                name = parts[m[3]].format("even" if (i, j) == (0, 0) else "odd")
                out[f"layers.{i}.0.layers.{j}.{name}.{m[4]}"] = v
    return out


def _randomise(model: torch.nn.Module) -> None:
    """Weights far from their init, so every part moves the output."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("pos_embed"):
                p.copy_(0.5 * r)
            elif p.ndim == 1:
                p.copy_(1 + 0.2 * r if "norm" in name and name.endswith("weight") else 0.1 * r)
            else:
                p.copy_(r / math.sqrt(math.prod(p.shape[1:] if p.ndim != 5 else p.shape[2:])))


# (registered name, reduced size, their heads, shared K/V, shifts, padded, embedding conv)
REDUCED = {
    "cifar": ("lsa_tiny_cifar_authors", dict(img_size=16, dims=(32,) * 4, depths=(2, 2, 3, 1)),
              4, True, CIFAR_SHIFTS, False, (3, 1, 1)),
    # 56px: the 9x9 stride-7 windows of the last row and column read past the image edge.
    "tiny_224": ("lsa_tiny_224_authors", dict(img_size=56, dims=(32,) * 4, depths=(2, 2, 2, 1)),
                 4, False, AUTHORS_IMAGENET_SHIFTS, True, (9, 7, 1)),
    "small_224": ("lsa_small_224_authors",
                  dict(img_size=32, dims=(16, 32, 48), depths=(2, 2, 2), num_heads=(2, 4, 6)),
                  (2, 4, 6), False, AUTHORS_IMAGENET_SHIFTS, True, (4, 4, 0)),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(REDUCED))
def test_their_layout_loads_and_gives_their_forward(kind, tmp_path):
    name, size, heads, shared_kv, shifts, padded, conv = REDUCED[kind]
    torch.manual_seed(0)
    ours = lgvit.create_model(name, num_classes=5, **size)
    _randomise(ours)
    theirs = _to_their_layout(ours.state_dict())
    assert not any(k.startswith(("patch_embed", "stages", "local_block")) for k in theirs)
    # A bare state dict, or the weights under "model" as their training loop saves them.
    torch.save(
        theirs if kind == "small_224" else {"model": theirs, "epoch": 3}, tmp_path / "theirs.pth"
    )
    m = lgvit.create_model(name, checkpoint_path=str(tmp_path / "theirs.pth"), **size).eval()
    x = torch.randn(3, 3, size["img_size"], size["img_size"])
    with torch.no_grad():
        want = _reference(theirs, x, heads, shared_kv, shifts, padded, conv)
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m(x[1:2]), want[1:2], rtol=1e-5, atol=1e-5)  # a batch of one
        if padded and conv[0] == 9:  # the padding matters: a roll reads zeros at the edge
            m.patch_embed.mode, m.patch_embed._index_cache = "circular", {}
            assert (m(x) - want).abs().max() > 1e-3
    mt = lgvit.create_model(name, checkpoint_path=str(tmp_path / "theirs.pth"), drop_path_rate=0.0,
                            **size).train()  # fmt: skip
    torch.testing.assert_close(mt(x), want, rtol=1e-5, atol=1e-5)


def test_padded_shift_index_is_circular_padding_then_conv():
    x = torch.randn(2, 3, 23, 23)
    shifts = ((0, 0), (0, 2), (3, 0), (1, 1))
    idx, (h, w) = shift_patch_index(shifts, 23, 23, 5, 3, 2, 3, mode="pad")
    flat = F.pad(x.flatten(1), (0, 1))
    weight = torch.randn(4, 3, 5, 5)
    for t, (dy, dx) in enumerate(shifts):
        patches = flat[:, idx[t]]  # (B, N, C*k*k)
        got = patches @ weight.flatten(1).t()
        ref = F.conv2d(F.pad(x, (dx, 0, dy, 0), mode="circular"), weight, stride=3, padding=2)
        ref = ref[..., :h, :w].flatten(2).transpose(1, 2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="negative"):
        shift_patch_index(((0, 0), (-1, 0)), 8, 8, 3, 1, 1, 3, mode="pad")


# ----------------------------------------------------------------------------- their files


def test_their_training_checkpoint_loads(their_tiny_cifar):
    # At 16px: their 32x32 position embeddings are resized on the way in.
    with pytest.warns(UserWarning, match="left out objects"):
        a = lgvit.create_model(AUTHORS[0], img_size=16, checkpoint_path=str(their_tiny_cifar))
    with pytest.warns(UserWarning):
        sd = load_weights(their_tiny_cifar)
    assert a.num_classes == 10 and a.pos_embed.shape == (18, 16 * 16, 192)
    assert torch.equal(a.local_block.norm1.weight, sd["layers.0.0.norm1.weight"])
    assert torch.equal(a.patch_embed.weight[17], sd["to_patch_embedding.projections.17.weight"])
    assert torch.equal(a.stages[2].blocks[3].mlp.fc2.bias, sd["layers.2.0.layers.3.1.fc2.bias"])


def test_paper_models_refuse_their_checkpoints_naming_the_model(their_tiny_cifar):
    for name in ("lsa_tiny_cifar", "lsa_small_cifar_authors"):
        with pytest.raises(LgvitError) as e, pytest.warns(UserWarning):
            lgvit.create_model(name, checkpoint_path=str(their_tiny_cifar))
        msg = str(e.value)
        assert "\n" not in msg and str(their_tiny_cifar) in msg, msg
        assert "lsa_tiny_cifar_authors" in msg and name in msg, msg
    # --initial-checkpoint: the same refusal.
    refused = pytest.raises(LgvitError, match="load it as lsa_tiny_cifar_authors")
    with refused, pytest.warns(UserWarning):
        load_initial_weights(meta("lsa_tiny_cifar", img_size=16), str(their_tiny_cifar))


def test_fine_tune_their_cifar10_model_on_cifar100(their_tiny_cifar):
    m = lgvit.create_model("lsa_tiny_cifar_authors", num_classes=100, img_size=16)
    with pytest.warns(UserWarning):
        note = load_initial_weights(m, str(their_tiny_cifar))
        sd = load_weights(their_tiny_cifar)
    assert "head for another class count dropped" in note
    assert m.head.weight.shape == (100, 192)
    kv = sd["layers.3.0.layers.3.0.Wkv_odd.weight"]
    assert kv.shape == (96, 192) and torch.equal(m.stages[3].blocks[3].attn.qkv.weight[192:], kv)


def test_info_lists_their_models(capsys):
    assert main(["info", "lsa_*_authors"]) == 0
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    for name, params in THEIR_PARAMS_M.items():
        assert abs(float(rows[name][2]) - params) <= 0.01, rows[name]  # printed to 0.01
