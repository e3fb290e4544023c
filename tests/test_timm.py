"""timm as the reference: its data config and eval transform read our models' preprocessing,
its parameter grouping reads our ``group_matcher``, and where timm has the same model (DeiT-T/S,
Swin-T) ours loaded with its weights gives its outputs through every shared interface
(``forward``, ``forward_intermediates``, ``features_only``, ``feature_info``,
``prune_intermediate_layers``)."""

from __future__ import annotations

import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.models import group_parameters
from timm.optim import param_groups_layer_decay

import lgvit
from lgvit.inference import preprocess_images

PAIRS = [
    ("deit_tiny", "deit_tiny_patch16_224"),
    ("deit_small", "deit_small_patch16_224"),
    ("swin_tiny", "swin_tiny_patch4_window7_224"),
]
ONE_PER_FAMILY = ["lsa_micro_cifar", "lsa_tiny_224", "localvit_tiny", "lit_ti", "swin_tiny",
                  "t2t_vit_7", "localvit_pvt_tiny"]  # fmt: skip


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """A real photograph (scikit-learn's bundled one), 427x640, as a JPEG file."""
    from sklearn.datasets import load_sample_image

    path = tmp_path_factory.mktemp("photo") / "china.jpg"
    Image.fromarray(load_sample_image("china.jpg")).save(path, quality=90)
    return str(path)


def _timm_pair(ours: str, theirs: str, tmp_path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """timm's model with random (not zero) weights, and ours loaded from its state dict."""
    torch.manual_seed(0)
    ref = timm.create_model(theirs, pretrained=False).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)  # not timm's init: zero biases would hide a swapped bias
    torch.save(ref.state_dict(), tmp_path / "timm.pth")
    model = lgvit.create_model(ours, checkpoint_path=str(tmp_path / "timm.pth")).eval()
    return model, ref


@pytest.mark.parametrize("ours, theirs", PAIRS)
def test_baselines_match_timm(ours, theirs, tmp_path):
    model, ref = _timm_pair(ours, theirs, tmp_path)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-5)
        feats, pooled = model.forward_features(x), ref.forward_features(x)
        torch.testing.assert_close(
            model.forward_head(feats, pre_logits=True),
            ref.forward_head(pooled, pre_logits=True),
            rtol=1e-4, atol=1e-5,
        )  # fmt: skip


def _nchw(t: torch.Tensor, channels: int) -> torch.Tensor:
    """timm's Swin hands its features_only maps over channels-last (NHWC); ours are NCHW."""
    return t if t.shape[1] == channels else t.permute(0, 3, 1, 2)


@pytest.mark.parametrize("ours, theirs", [PAIRS[0], PAIRS[2]])
def test_feature_interfaces_behave_as_timms(ours, theirs, tmp_path):
    model, ref = _timm_pair(ours, theirs, tmp_path)
    x = torch.randn(2, 3, 224, 224)
    info, ref_info = model.feature_info, ref.feature_info
    assert [f["num_chs"] for f in info] == [f["num_chs"] for f in ref_info]
    assert [f["reduction"] for f in info] == [f["reduction"] for f in ref_info]
    idx = [1, 2]
    with torch.no_grad():
        for norm in (False, True):
            got = model.forward_intermediates(x, idx, norm=norm, intermediates_only=True)
            want = ref.forward_intermediates(x, idx, norm=norm, intermediates_only=True)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        final, inter = model.forward_intermediates(x, 1)  # the last n, as timm reads an int
        ref_final, ref_inter = ref.forward_intermediates(x, 1)
        # the final features in the same layout: ViT tokens, or Swin's NHWC map as timm's
        assert final.shape == ref_final.shape
        assert model.output_fmt == getattr(ref, "output_fmt", "NLC")  # timm's ViT: tokens
        torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(inter[0], ref_inter[0], rtol=1e-4, atol=1e-5)
    path = str(tmp_path / "timm.pth")
    feats = lgvit.create_model(ours, checkpoint_path=path, features_only=True, out_indices=idx)
    ref_feats = timm.create_model(
        theirs, pretrained=True, pretrained_cfg_overlay=dict(file=path), features_only=True,
        out_indices=idx,
    )  # fmt: skip
    assert feats.feature_info.channels() == ref_feats.feature_info.channels()
    assert feats.feature_info.reduction() == ref_feats.feature_info.reduction()
    with torch.no_grad():
        for a, b in zip(feats.eval()(x), ref_feats.eval()(x), strict=True):
            torch.testing.assert_close(a, _nchw(b, a.shape[1]), rtol=1e-4, atol=1e-5)
    assert model.prune_intermediate_layers(idx) == ref.prune_intermediate_layers(idx)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_timm_data_config_and_transform_give_our_preprocessing(name, photo):
    m = lgvit.create_model(name)
    cfg = resolve_data_config({}, model=m)
    pc = m.pretrained_cfg
    # timm evaluates at test_input_size when a model has one: ours evaluate at the trained size
    # (the test suite's small size is not a pretrained_cfg key)
    assert "test_input_size" not in pc
    assert resolve_data_config({}, model=m, use_test_size=True)["input_size"] == pc["input_size"]
    assert cfg["input_size"] == pc["input_size"] and cfg["crop_pct"] == pc["crop_pct"]
    assert cfg["mean"] == pc["mean"] and cfg["std"] == pc["std"]
    assert cfg["interpolation"] == pc["interpolation"] and cfg["crop_mode"] == pc["crop_mode"]
    want = create_transform(**cfg)(Image.open(photo).convert("RGB"))
    got = preprocess_images(m, [photo])[0]
    assert got.shape == want.shape
    # Same resize, crop and normalisation: pixels within one level of PIL's resize.
    one_level = 1 / 255 / min(pc["std"]) + 1e-5
    assert (got - want).abs().max() <= one_level
    assert (got - want).abs().mean() < 0.05 * one_level


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_timm_layer_decay_reads_our_group_matcher(name):
    m = lgvit.create_model(name)
    groups = group_parameters(m, m.group_matcher(), reverse=True)
    assert set(groups) == {n for n, _ in m.named_parameters()}
    first = next(n for n, _ in m.named_parameters())  # the stem's first parameter
    assert groups[first] == 0 and groups["head.weight"] == max(groups.values())
    coarse = group_parameters(m, m.group_matcher(coarse=True), reverse=True)
    assert 3 <= len(set(coarse.values())) <= len(set(groups.values()))
    decay = param_groups_layer_decay(m, weight_decay=0.05, layer_decay=0.75)
    scales = sorted({g["lr_scale"] for g in decay})
    assert len(scales) == len(set(groups.values())) and scales[-1] == 1.0


def _numel_per_group(model: torch.nn.Module) -> list[int]:
    groups = group_parameters(model, model.group_matcher(), reverse=True)
    sizes = [0] * (max(groups.values()) + 1)
    for name, p in model.named_parameters():
        sizes[groups[name]] += p.numel()
    return sizes


@pytest.mark.parametrize("ours, theirs", PAIRS)
def test_layer_groups_as_timm_groups_its_own_model(ours, theirs):
    # Parameter names differ (our q / kv against timm's fused qkv), group contents do not.
    with torch.device("meta"):
        got = _numel_per_group(lgvit.create_model(ours))
        want = _numel_per_group(timm.create_model(theirs))
    assert got == want


def test_group_matcher_on_lsa_blocks():
    m = lgvit.create_model("lsa_micro_cifar")
    fine = group_parameters(m, m.group_matcher(), reverse=True)
    coarse = group_parameters(m, m.group_matcher(coarse=True), reverse=True)
    assert fine["patch_embed.weight"] == 0 and fine["local_block.attn.q.weight"] == 0
    # stem, 5 blocks (1 + 2 + 2; a stage's downsample joins its first block's group, the
    # final norm the last block's, as timm's ViT does), head.
    assert len(set(fine.values())) == 1 + 5 + 1
    assert len(set(coarse.values())) == 1 + 3 + 1
    assert fine["stages.1.downsample.conv.weight"] == fine["stages.1.blocks.0.attn.qkv.weight"]
    assert fine["norm.weight"] == fine["stages.2.blocks.1.mlp.fc2.weight"]
    assert fine["stages.0.blocks.0.attn.qkv.weight"] < fine["stages.2.blocks.1.mlp.fc2.weight"]
    assert fine["head.weight"] == max(fine.values())
