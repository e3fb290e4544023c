"""lgvit's models inside timm (``import lgvit, timm``) and the libraries built on timm's
registry: segmentation_models_pytorch's ``tu-`` encoders and transformers' ``TimmBackbone``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lgvit

timm = pytest.importorskip("timm")

ALL = lgvit.list_models()
FIXTURES = Path(__file__).parent / "fixtures"


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (import order and import hooks are per process)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_every_model_is_registered_in_timm_under_its_own_name():
    names = timm.list_models(module="lgvit")
    assert sorted(names) == ALL
    assert sorted(timm.list_models("lsa_tiny_cifar*")) == lgvit.list_models("lsa_tiny_cifar*")
    for name in ALL:
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.architecture == name
        assert tuple(cfg.input_size) == lgvit.get_model_config(name).input_size
        assert cfg.first_conv == lgvit.get_model_config(name).first_conv


def test_import_order_either_way_and_no_timm_import_cost():
    out = _python(
        "import sys, lgvit\n"
        "print('timm' in sys.modules)\n"
        "import timm\n"
        "print(len(timm.list_models(module='lgvit')))\n"
    )
    assert out.split() == ["False", str(len(ALL))]
    out = _python("import timm, lgvit\nprint(len(timm.list_models(module='lgvit')))")
    assert out.split() == [str(len(ALL))]


def test_a_name_timm_already_has_is_left_to_timm():
    out = _python(
        "import warnings; warnings.simplefilter('error')\n"  # timm warns when overwriting
        "import timm, torch\n"
        "from timm.models import register_model\n"
        "def lsa_micro_cifar(pretrained=False, **kw):\n"
        "    return torch.nn.Identity()\n"
        "register_model(lsa_micro_cifar)\n"
        "import lgvit\n"
        "print(type(timm.create_model('lsa_micro_cifar')).__name__)\n"
        "print(type(timm.create_model('lsa_tiny_cifar')).__name__)\n"
    )
    assert out.split() == ["Identity", "LocallyShiftedViT"]


def test_lgvit_works_without_timm():
    out = _python(
        "import sys; sys.modules['timm'] = None\n"  # what an uninstalled package looks like
        "import lgvit, torch\n"
        "m = lgvit.create_model('lsa_micro_cifar', num_classes=3)\n"
        "print(tuple(m(torch.randn(1, 3, 32, 32)).shape))\n"
    )
    assert out.strip() == "(1, 3)"


def test_an_old_timm_imports_beside_lgvit(tmp_path):
    # timm 0.3.2 (the LocalViT and LIT authors' dependency) has no timm.models._registry: it must
    # import as it would alone, with one warning, not fail inside lgvit's import hook.
    models = tmp_path / "timm" / "models"
    models.mkdir(parents=True)
    (tmp_path / "timm" / "__init__.py").write_text(
        "__version__ = '0.3.2'\nfrom .models import create_model\n"
    )
    (models / "__init__.py").write_text("def create_model(name):\n    return name\n")
    for order in ("import lgvit, timm", "import timm, lgvit"):
        out = _python(
            f"import sys, warnings; sys.path.insert(0, {str(tmp_path)!r})\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    {order}\n"
            "print(timm.__version__, timm.create_model('x'))\n"
            "print(*(str(m.message) for m in w if 'lgvit' in str(m.message)), sep='\\n')\n"
        )
        lines = out.strip().splitlines()
        assert lines[0] == "0.3.2 x", order
        assert lines[1:] == [
            "lgvit: timm 0.3.2 has no timm.models._registry (timm >= 0.9 has): "
            "lgvit's models are not registered in it"
        ], order


def test_every_model_builds_through_timm():
    for name in ALL:
        with torch.device("meta"):
            m = timm.create_model(name, num_classes=5)
        assert m.num_classes == 5 and m.pretrained_cfg["architecture"] == name, name
        assert m.default_cfg is m.pretrained_cfg
        assert m.pretrained_cfg["pool_size"], name


def test_timm_arguments_mean_what_they_mean_in_lgvit(tmp_path):
    kw = dict(num_classes=4, img_size=48, drop_path_rate=0.1)
    torch.manual_seed(0)
    ours = lgvit.create_model("lsa_micro_cifar", **kw).eval()
    torch.manual_seed(0)
    via_timm = timm.create_model("lsa_micro_cifar", **kw).eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        torch.testing.assert_close(via_timm(x), ours(x), rtol=0, atol=0)
    rates = [[getattr(d, "drop_prob", None) for d in n.modules()] for n in (ours, via_timm)]
    assert rates[0] == rates[1] and max(r or 0 for r in rates[0]) > 0  # drop_path_rate arrived
    path = tmp_path / "w.pth"
    torch.save(ours.state_dict(), path)
    for m in (
        timm.create_model("lsa_micro_cifar", img_size=48, num_classes=4, checkpoint_path=str(path)),
        timm.create_model(
            "lsa_micro_cifar",
            pretrained=True,
            img_size=48,
            pretrained_cfg_overlay=dict(file=str(path)),
        ),  # fmt: skip
    ):
        with torch.no_grad():
            torch.testing.assert_close(m.eval()(x), ours(x), rtol=0, atol=0)
    # timm's meaning of pretrained + another class count: the weights, a new classifier.
    new = timm.create_model(
        "lsa_micro_cifar", pretrained=True, img_size=48, num_classes=9,
        pretrained_cfg_overlay=dict(file=str(path)),
    ).eval()  # fmt: skip
    assert new.num_classes == 9
    with torch.no_grad():
        torch.testing.assert_close(new.forward_features(x), ours.forward_features(x))


def test_timm_global_pool_argument():
    m = timm.create_model("lsa_micro_cifar", num_classes=0, global_pool="").eval()
    with torch.no_grad():
        assert m(torch.randn(1, 3, 32, 32)).shape == (1, 4, 4, 160)  # the unpooled NHWC map
    with pytest.raises(ValueError, match="global_pool"):
        timm.create_model("lsa_micro_cifar", global_pool="max")


def test_features_only_through_timm_is_timms_feature_api():
    fm = timm.create_model("lit_ti", features_only=True, out_indices=(1, 3), img_size=64)
    info = fm.feature_info
    assert info.out_indices == (1, 3)
    assert info.channels() == [128, 512] and info.reduction() == [8, 32]
    assert info.module_name() == ["stages.1", "stages.3"]
    assert [d["index"] for d in info.get_dicts()] == [1, 3]
    assert len(info.info) == 4 and info.channels(0) == 64  # an index means the model's level
    assert fm.default_cfg is fm.pretrained_cfg and fm.pretrained_cfg["architecture"] == "lit_ti"
    maps = fm(torch.randn(1, 3, 64, 96))
    assert [tuple(m.shape) for m in maps] == [(1, 128, 8, 12), (1, 512, 2, 3)]
    with pytest.raises(ValueError, match="feature_cls"):
        timm.create_model("lit_ti", features_only=True, feature_cls="hook")


def _authors_localvit(sd: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """LocalViT-T's state dict as the authors' code stores it: fused qkv, the feed-forward as
    nn.Sequential indices (written independently of the loader's mapping; their fused qkv is
    ours)."""
    out = {}
    for k, v in sd.items():
        if ".mlp." in k:
            blk, rest = k.split(".mlp.", 1)
            name, param = rest.split(".", 1)
            ffn = model.get_submodule(f"{blk}.mlp")
            out[f"{blk}.conv.conv.{ffn.layers().index(getattr(ffn, name))}.{param}"] = v
        else:
            out[k] = v
    return out


def test_authors_layouts_load_through_timms_checkpoint_path(tmp_path):
    torch.manual_seed(0)
    ours = lgvit.create_model("localvit_tiny", img_size=64).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.05)
    path = tmp_path / "localvit_t.pth"
    torch.save(_authors_localvit(ours.state_dict(), ours), path)
    m = timm.create_model("localvit_tiny", img_size=64, checkpoint_path=str(path)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ours(x), rtol=0, atol=0)
    # The LIT authors' released key names and shapes (lit_ti) load strictly through timm too.
    keys = json.loads((FIXTURES / "lit_keys.json").read_text())["lit_ti"]
    g = torch.Generator().manual_seed(0)
    sd = {k: 0.02 * torch.randn(shape, generator=g) for k, shape in keys}
    torch.save(sd, tmp_path / "lit_ti.pth")
    m = timm.create_model("lit_ti", checkpoint_path=str(tmp_path / "lit_ti.pth"))
    ref = lgvit.create_model("lit_ti", checkpoint_path=str(tmp_path / "lit_ti.pth"))
    for k, v in ref.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_timm_reads_save_pretrained_folders(tmp_path, monkeypatch):
    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar", num_classes=7).eval()
    m.pretrained_cfg["label_names"] = [f"c{i}" for i in range(7)]
    m.save_pretrained(tmp_path / "folder")
    x = torch.randn(2, 3, 32, 32)
    t = timm.create_model(f"local-dir:{tmp_path / 'folder'}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(t(x), m(x), rtol=0, atol=0)
    assert t.pretrained_cfg["label_names"] == [f"c{i}" for i in range(7)]
    data = timm.data.resolve_data_config({}, model=t)
    assert tuple(data["mean"]) == tuple(m.pretrained_cfg["mean"])
    assert data["input_size"] == (3, 32, 32)
    # without pretrained=True timm builds the folder's architecture, class count and arguments
    assert timm.create_model(f"local-dir:{tmp_path / 'folder'}").num_classes == 7
    # hf-hub: the same folder, as if downloaded (no network in tests)
    from timm.models import _factory, _hub

    from lgvit.models import hub

    def from_hf(model_id, cache_dir=None):
        cfg = json.loads((tmp_path / "folder" / "config.json").read_text())
        return _hub._parse_model_cfg(cfg, {"hf_hub_id": model_id, "source": "hf-hub"})

    monkeypatch.setattr(_factory, "load_model_config_from_hf", from_hf)
    monkeypatch.setattr(hub, "download", lambda repo_id, revision=None: tmp_path / "folder")
    h = timm.create_model("hf-hub:someone/lsa-micro", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(h(x), m(x), rtol=0, atol=0)


# --------------------------------------------------------------------------- real clients


def _train_step(model: torch.nn.Module, x: torch.Tensor, n_out: int) -> torch.Tensor:
    y = model(x)
    assert y.shape == (x.shape[0], n_out, *x.shape[-2:])
    y.float().logsumexp(1).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    return y


SMP_CASES = [
    # (encoder, Unet keyword arguments, input H x W): non-square inputs; models with a fixed
    # position-embedding grid are built for that size (img_size, passed through to timm).
    ("lit_ti", {}, (64, 96)),
    ("lsa_small_224", dict(encoder_depth=4, decoder_channels=(64, 32, 16, 8), img_size=(64, 96)),
     (64, 96)),
    ("localvit_pvt_tiny", {}, (64, 96)),
    ("swin_tiny", dict(window_size=2, img_size=(64, 128)), (64, 128)),
]  # fmt: skip


@pytest.mark.parametrize("encoder, kwargs, hw", SMP_CASES, ids=[c[0] for c in SMP_CASES])
def test_segmentation_models_pytorch_unet_on_an_lgvit_encoder(encoder, kwargs, hw):
    smp = pytest.importorskip("segmentation_models_pytorch")
    torch.manual_seed(0)
    net = smp.Unet(f"tu-{encoder}", encoder_weights=None, classes=3, **kwargs).train()
    _train_step(net, torch.randn(2, 3, *hw), 3)


def test_segmentation_models_pytorch_refuses_a_plain_vit():
    smp = pytest.importorskip("segmentation_models_pytorch")
    with pytest.raises(ValueError, match="downsampling pattern"):
        smp.Unet("tu-deit_tiny", encoder_weights=None, classes=3)


def test_transformers_upernet_on_lit_ti():
    transformers = pytest.importorskip("transformers")
    backbone = transformers.TimmBackboneConfig(backbone="lit_ti", out_indices=(0, 1, 2, 3))
    cfg = transformers.UperNetConfig(
        backbone_config=backbone, num_labels=5, hidden_size=64, auxiliary_in_channels=320
    )
    torch.manual_seed(0)
    net = transformers.UperNetForSemanticSegmentation(cfg).train()
    assert type(net.backbone._backbone).__name__ == "FeatureMaps"
    assert net.backbone.num_features == [64, 128, 320, 512]
    x, labels = torch.randn(2, 3, 64, 96), torch.randint(0, 5, (2, 64, 96))
    out = net(pixel_values=x, labels=labels)
    assert out.logits.shape == (2, 5, 64, 96)
    out.loss.backward()
    assert all(p.grad is not None for p in net.backbone.parameters() if p.requires_grad)
