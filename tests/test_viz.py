"""`lgvit viz` and `lgvit plot`: captured attention against a recomputation from q and k, the
chained DTM sampling locations, every figure kind written, the runs overlaid, one-line errors;
and training progress without control characters off a terminal."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from PIL import Image

import lgvit
import lgvit.tools.viz as viz
from lgvit.checkpoints.files import save_checkpoint
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.models.layers import Attention
from lgvit.models.lsa import LocalShiftAttention
from lgvit.tools.plot import plot_runs

pytest.importorskip("matplotlib", reason="the viz extra is not installed")


def _outputs(module: torch.nn.Module, names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Record the outputs of the named submodules (the q and kv projections)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for n in names:
        module.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen[n].append(out.detach().double())
        )
    return seen


def test_captured_global_attention_is_softmax_of_q_k_and_leaves_the_output_alone():
    torch.manual_seed(0)
    attn = Attention(24, 4, kv_heads=2, rel_pos_grid=(3, 4)).eval()  # grouped heads + a bias
    x = torch.randn(2, 12, 24)
    plain = attn(x, (3, 4))
    with viz.capture_attention([attn]) as (store,):
        captured_out = attn(x, (3, 4))
    assert torch.equal(captured_out, plain)  # the same forward pass
    probs, grid = store[0]
    assert grid == (3, 4) and probs.shape == (2, 4, 12, 12)
    xd = x.double()  # the projections recomputed from the weights
    w, b = attn.qkv.weight.double(), attn.qkv.bias.double()  # rows: q (24), k (12), v (12)
    q = torch.nn.functional.linear(xd, w[:24], b[:24]).view(2, 12, 4, 6)
    kv = torch.nn.functional.linear(xd, w[24:], b[24:])
    k = kv[..., :12].view(2, 12, 2, 6)
    bias = attn.rel_pos((3, 4)).double()
    want = torch.empty(2, 4, 12, 12, dtype=torch.float64)
    for h in range(4):  # query head h reads key head h // 2
        logits = torch.einsum("bnd,bmd->bnm", q[:, :, h], k[:, :, h // 2]) / 6**0.5 + bias[h]
        want[:, h] = logits.softmax(-1)
    torch.testing.assert_close(probs.double(), want, rtol=1e-5, atol=1e-6)
    assert attn.captured is None  # the flag is cleared


def test_captured_shift_attention_is_softmax_over_the_variants():
    torch.manual_seed(0)
    model = lgvit.create_model("lsa_micro_cifar").eval()
    attn = next(m for m in model.modules() if isinstance(m, LocalShiftAttention))
    name = next(n for n, m in model.named_modules() if m is attn)
    seen = _outputs(model, [f"{name}.q"])
    x = torch.randn(2, 3, 32, 32)
    weights, grid = viz.shift_weights(model, x)
    T, heads, d = len(model.patch_embed.shifts), attn.num_heads, attn.head_dim
    assert grid == (16, 16) and weights.shape == (2, heads, 16, 16, T)
    q = seen[f"{name}.q"][0].view(2, 256, heads, d)
    with torch.no_grad():  # keys of the variants as written: kv(LN(embedding + position))
        variants = model.patch_embed(x)[1].add(model.pos_embed).materialize()
        k = attn.kv(model.local_block.norm1(variants))[..., : attn.kv_heads * d].double()
    k = k.view(T, 2, 256, attn.kv_heads, d)
    g = heads // attn.kv_heads
    for h in range(heads):
        logits = torch.einsum("bnd,tbnd->bnt", q[:, :, h], k[:, :, :, h // g]) / d**0.5
        want = logits.softmax(-1).view(2, 16, 16, T)
        torch.testing.assert_close(weights[:, h].double(), want, rtol=1e-5, atol=1e-6)


def test_sampling_locations_chain_the_merges():
    zeros = [torch.zeros(4, 2, s, s) for s in (8, 4, 2)]  # merges 16->8->4->2
    pts = viz.sampling_locations(zeros, (1, 0))
    # Without offsets: the 8x8 block of the first grid under output token (1, 0).
    want = {(y, x) for y in range(8, 16) for x in range(0, 8)}
    assert len(pts) == 64 and {tuple(p) for p in pts.long().tolist()} == want
    # An offset of one row at every level moves the points 4 + 2 + 1 = 7 rows down; those
    # leaving a map are dropped, as the authors' figure does.
    ones = [torch.zeros(4, 2, s, s) for s in (8, 4, 2)]
    for o in ones:
        o[:, 0] = 1.0
    pts = viz.sampling_locations(ones, (0, 0))
    assert {tuple(p) for p in pts.long().tolist()} == {
        (y + 7, x) for y in range(8) for x in range(8)
    }
    pts = viz.sampling_locations(ones, (1, 1))  # rows 15+... leave the 16-row map
    assert len(pts) < 64 and pts[:, 0].min() == 15


def test_rollout_of_identity_attention_is_identity():
    eye = torch.eye(4)[None].repeat(2, 1, 1)
    torch.testing.assert_close(viz.attention_rollout([eye, eye]), torch.eye(4))
    uniform = torch.full((1, 4, 4), 0.25)
    r = viz.attention_rollout([uniform])
    torch.testing.assert_close(r, 0.5 * torch.eye(4) + 0.125)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    paths = []
    for i, color in enumerate([(200, 40, 40), (30, 160, 220)]):
        img = Image.new("RGB", (40, 36), color)
        img.paste((255, 255, 255), (10 + 5 * i, 8, 24, 20))
        img.save(d / f"im{i}.png")
        paths.append(str(d / f"im{i}.png"))
    return paths


def _checkpoint(tmp_path, name, **kwargs):
    torch.manual_seed(0)
    m = lgvit.create_model(name, num_classes=3, **kwargs)
    for mod in m.modules():  # learned-looking offsets (they start at zero)
        if hasattr(mod, "offset_conv"):
            torch.nn.init.normal_(mod.offset_conv.weight, std=0.5)
    meta = {"model": name, "img_size": str(m.pretrained_cfg["input_size"][-1]),
            "classes": json.dumps(["a", "b", "c"]), "model_kwargs": json.dumps(kwargs)}  # fmt: skip
    save_checkpoint(tmp_path / "best", m.state_dict(), {"step": 0}, metadata=meta)
    return str(tmp_path / "best")


@pytest.mark.parametrize(
    "name, kwargs, what, files",
    [
        ("lsa_micro_cifar", {}, "lsa-shifts", ["im0_lsa_shifts.png", "im1_lsa_shifts.png"]),
        ("lit_ti", dict(img_size=32, patch_size=2), "dtm-offsets",
         ["im0_dtm_offsets.png", "im1_dtm_offsets.png"]),
        ("lsa_micro_cifar", {}, "attention", ["attention.png", "attention_rollout.png"]),
        ("lit_ti", dict(img_size=32, patch_size=2), "attention",
         ["attention.png", "attention_rollout.png"]),
    ],
)  # fmt: skip
def test_each_kind_writes_its_figures(name, kwargs, what, files, images, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, name, **kwargs)
    out = tmp_path / "viz"
    assert main(["viz", ckpt, *images, "--what", what, "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / f) for f in files]
    for f in files:
        w, h = Image.open(out / f).size
        assert w >= 600 and h >= 300  # a readable figure, not a thumbnail


def test_per_head_and_positions(images, tmp_path):
    model = lgvit.create_model("lsa_micro_cifar").eval()
    x = torch.randn(1, 3, 32, 32)
    paths = viz.plot_lsa_shifts(model, x, ["a"], tmp_path, per_head=True)
    heads = next(m for m in model.modules() if isinstance(m, LocalShiftAttention)).num_heads
    assert [p.name for p in paths] == ["a_lsa_shifts.png"] + [
        f"a_lsa_shifts_head{h}.png" for h in range(heads)
    ]
    lit = lgvit.create_model("lit_ti", img_size=32, patch_size=2).eval()
    with pytest.raises(LgvitError, match=r"--positions 5,0 is outside the last merge's 2x2 grid"):
        viz.plot_dtm_offsets(lit, x, ["a"], tmp_path, positions=[(5, 0)])


def test_wrong_family_and_bad_arguments_are_one_line(images, tmp_path, capsys):
    cases = [
        (
            ["viz", "deit_tiny", images[0], "--what", "lsa-shifts"],
            "no local attention over shifted",
        ),
        (["viz", "lsa_micro_cifar", images[0], "--what", "dtm-offsets"], "needs a LIT model"),
        (["viz", "swin_tiny", images[0], "--what", "attention"], "no global attention"),
        (["viz", "lsa_micro_cifar", str(tmp_path / "none.jpg"), "--what", "attention"], "none.jpg"),
    ]
    for argv, needle in cases:
        assert main([*argv, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_missing_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(LgvitError, match=r"matplotlib.*pip install 'lgvit\[viz\]'"):
        viz.need_matplotlib()


def _run(tmp_path, name, acc1):
    run = tmp_path / name
    run.mkdir()
    rows = [
        {"epoch": e, "train_loss": 2.0 - 0.3 * e, "test_acc1": a, "test_acc5": a + 20}
        for e, a in enumerate(acc1)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_overlays_runs(tmp_path, capsys):
    a = _run(tmp_path, "deit_tiny", [40.0, 55.0, 52.0])
    b = _run(tmp_path, "localvit_tiny", [45.0, 58.0, 63.0])
    assert main(["plot", str(a), str(b), "--out", str(tmp_path / "fig4.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "fig4.png")
    w, h = Image.open(tmp_path / "fig4.png").size
    assert w > 1000 and h > 300
    svg = plot_runs([a, b], tmp_path / "fig4.svg", labels=["DeiT-T", "LocalViT-T"])
    text = svg.read_text()
    assert "DeiT-T" in text and "LocalViT-T" in text and "best 63.00% (epoch 3)" in text
    assert plot_runs([a]) == a / "curves.png"
    with pytest.raises(LgvitError, match=r"--out .*x\.jpg: the file must end in"):
        plot_runs([a], tmp_path / "x.jpg")
    with pytest.raises(LgvitError, match="metrics.jsonl: not found"):
        plot_runs([a, tmp_path / "nothing"])


def test_progress_bar_on_a_terminal_only(capsys):
    from lgvit.core.progress import RunClock, StepProgress, format_duration

    p = StepProgress(3, "epoch 1/2", bar=True)
    p.bar.mininterval = 0  # draw every update (a real bar redraws at most 10 times a second)
    for _ in range(3):
        p.update(8, loss="1.0000", lr="1e-3", run_ETA="0m01s")
    p.close()
    out = capsys.readouterr().out
    assert "\r" in out and "epoch 1/2" in out and "img/s" in out and "run_ETA" in out
    q = StepProgress(3, "epoch 1/2", bar=False)
    q.update(8, loss="1.0")
    q.close()
    assert capsys.readouterr().out == "" and q.images == 8
    assert format_duration(75) == "1m15s" and format_duration(3 * 3600 + 120) == "3h02m"
    clock = RunClock(total_steps=10, start_step=4)
    assert clock.eta(4) is None and clock.eta(6) >= 0
    # progressive resizing: 4 steps per epoch, epoch costs 1, 1, 4 -> cost 4 done of 24 in all
    sized = RunClock(12, 0, steps_per_epoch=4, epoch_cost=lambda e: 4.0 if e == 2 else 1.0)
    assert sized._cost(4) == 4 and sized._cost(10) == 16 and sized._cost(12) == 24
    sized.t0 -= 10.0  # 10 s for the first epoch
    assert sized.eta(4) == pytest.approx(10.0 / 4 * 20, rel=0.01)
