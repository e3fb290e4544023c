"""Dense backbones and Semantic FPN segmentation: every pyramid at a non-square size, frozen
stages, the authors' mmseg checkpoint layout, mIoU against an independent confusion matrix,
mmseg's pipelines, bad masks, and a short training run through the CLI (train, resume, eval,
predict) on a synthetic set in ADE20K's layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from seg_fixtures import CLASSES, write_seg_set

from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.data.segmentation import (
    ADE20K_CLASSES,
    SegAugment,
    SegSplit,
    SegTrainLoader,
    load_seg_split,
    read_mask,
    rescale_size,
    train_sample,
)
from lgvit.dense import create_backbone
from lgvit.dense.mmseg import mmseg_to_lgvit
from lgvit.dense.semfpn import create_segmenter
from lgvit.tasks.segmentation.evaluate import SegMetrics

FIXTURES = Path(__file__).parent / "fixtures"
# The pyramid models (and LIT's ablations on them); the LSA CIFAR pyramids work too.
PYRAMIDS = [
    "lit_ti", "lit_s", "lit_m", "lit_b", "pvt_tiny", "pvt_small", "pvt_small_dtm",
    "pvt_small_mlp_12", "lit_ti_uniform", "lit_s_uniform", "localvit_pvt_tiny", "swin_tiny",
    "localvit_swin_tiny", "swin_tiny_dtm", "lsa_tiny_224", "lsa_small_224",
]  # fmt: skip


@pytest.fixture(scope="module")
def seg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seg_set(tmp_path_factory.mktemp("seg") / "data", n_train=24, n_val=6)


# --------------------------------------------------------------------------------- backbones


@pytest.mark.parametrize("name", PYRAMIDS)
def test_every_pyramid_gives_its_strides_at_a_non_square_size(name):
    bb = create_backbone(name, drop_path_rate=0.0).eval()
    H, W = 72, 104  # neither a multiple of 32 nor of 7 (Swin's windows are padded)
    with torch.no_grad():
        maps = bb(torch.randn(1, 3, H, W))
    assert len(maps) == len(bb.feature_info)
    for m, info in zip(maps, bb.feature_info, strict=True):
        r = info["reduction"]
        assert m.shape[1] == info["num_chs"]
        assert abs(m.shape[2] - H / r) <= 1 and abs(m.shape[3] - W / r) <= 1, (m.shape, r)
        assert torch.isfinite(m).all()


def test_semantic_fpn_sizes_match_the_authors():
    # Their Semantic FPN LIT-Ti / LIT-S (mmseg 0.13 built from their configs): 23.64M / 31.85M.
    for name, expected in (("lit_ti", 23.64), ("lit_s", 31.85)):
        with torch.device("meta"):
            model = create_segmenter(name, 150)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == expected


def test_frozen_stages_and_norm_eval_hold_through_training():
    bb = create_backbone("lit_ti", frozen_stages=2, norm_eval=True)
    frozen = {id(p) for p in bb.frozen_parameters()}
    stem_and_two = [*bb.model.patch_embed.parameters(), *bb.model.stages[0].parameters(),
                    *bb.model.stages[1].parameters()]  # fmt: skip
    assert {id(p) for p in stem_and_two} <= frozen
    assert all(p.requires_grad for p in bb.model.stages[2].parameters())
    before = {n: p.detach().clone() for n, p in bb.named_parameters()}
    bn_before = bb.model.stages[2].downsample.norm.running_mean.clone()
    bb.train()
    assert not bb.model.stages[1].training and bb.model.stages[2].training
    assert not bb.model.stages[2].downsample.norm.training  # norm_eval: BatchNorm in eval
    opt = torch.optim.SGD([p for p in bb.parameters() if p.requires_grad], lr=0.1)
    sum(m.mean() for m in bb(torch.randn(2, 3, 64, 64))).backward()
    opt.step()
    for n, p in bb.named_parameters():
        changed = not torch.equal(before[n], p)
        if id(p) in frozen:
            assert not changed and p.grad is None, n
        elif p.grad is not None and p.grad.any():
            assert changed, n
    assert any(not torch.equal(before[n], p) for n, p in bb.named_parameters())
    assert torch.equal(bn_before, bb.model.stages[2].downsample.norm.running_mean)


def test_pvt_skeleton_leaves_the_class_token_out():
    # LIT-Ti's (and PVT's) dense backbones: no class token in stage 4, its position row unused.
    bb = create_backbone("lit_ti").eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        a = bb(x)[-1]
        bb.model.stages[3].cls_token.normal_()
        bb.model.stages[3].pos_embed[0].normal_()
        b = bb(x)[-1]
    assert torch.equal(a, b) and a.shape[-2:] == (2, 3)


def test_a_pyramid_less_model_is_refused():
    with pytest.raises(LgvitError, match="no feature pyramid"):
        create_backbone("deit_tiny")


# --------------------------------------------------------------------------------- mmseg


@pytest.mark.parametrize("name", ["lit_ti", "lit_s"])
def test_the_authors_mmseg_checkpoint_layout_loads(name, tmp_path):
    """Their key names and shapes (fixture built from their configs and mmseg 0.13's module
    definitions), random values: every key maps, shapes fit strictly, values land in place."""
    shapes = json.loads((FIXTURES / f"mmseg_semfpn_{name}_keys.json").read_text())
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    sd.update({k: torch.tensor(7) for k in sd if k.endswith("num_batches_tracked")})
    path = tmp_path / f"sem_fpn_{name}.pth"
    torch.save({"meta": {"iter": 80000}, "state_dict": sd}, path)
    from lgvit.tasks.segmentation.evaluate import load_segmenter

    model = load_segmenter(str(path), "cpu", name)
    own = model.state_dict()
    assert torch.equal(own["neck.inner_blocks.2.0.weight"], sd["neck.lateral_convs.2.conv.weight"])
    assert torch.equal(own["neck.layer_blocks.0.0.bias"], sd["neck.fpn_convs.0.conv.bias"])
    assert torch.equal(own["decode_head.scale_heads.3.4.1.running_var"],
                       sd["decode_head.scale_heads.3.4.bn.running_var"])  # fmt: skip
    assert torch.equal(own["decode_head.conv_seg.weight"], sd["decode_head.conv_seg.weight"])
    if name == "lit_s":
        assert torch.equal(own["backbone.norms.2.weight"], sd["backbone.norm2.weight"])
    assert model.seg_info["classes"] == list(ADE20K_CLASSES)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 80)).shape == (1, 150, 64, 80)
    with pytest.raises(LgvitError, match="does not fit Semantic FPN on pvt_small"):
        load_segmenter(str(path), "cpu", "pvt_small")
    mapped = mmseg_to_lgvit(sd, model)
    assert set(mapped) == set(own)


def test_ade20k_has_its_150_classes():
    assert len(ADE20K_CLASSES) == 150 == len(set(ADE20K_CLASSES))
    assert ADE20K_CLASSES[:3] == ("wall", "building", "sky") and ADE20K_CLASSES[-1] == "flag"


# --------------------------------------------------------------------------------- metrics


def test_miou_macc_aacc_against_a_confusion_matrix():
    rng = np.random.default_rng(0)
    n = 5
    m = SegMetrics(n)
    preds, labels = [], []
    for _ in range(3):
        p = rng.integers(0, n, size=(2, 17, 23))
        t = rng.integers(0, n - 1, size=(2, 17, 23))  # class 4 never labelled
        t[rng.random(t.shape) < 0.2] = 255
        p[t == 2] = 2  # class 2 always right
        m.update(torch.from_numpy(p), torch.from_numpy(t))
        preds.append(p.ravel())
        labels.append(t.ravel())
    p, t = np.concatenate(preds), np.concatenate(labels)
    keep = t != 255
    cm = np.zeros((n, n))
    np.add.at(cm, (t[keep], p[keep]), 1)  # rows: truth, columns: prediction
    tp = np.diag(cm)
    iou = tp / (cm.sum(0) + cm.sum(1) - tp)
    present = cm.sum(1) > 0
    acc_present = tp[present] / cm.sum(1)[present]
    res = m.result()
    assert math.isclose(res["mIoU"], 100 * iou.mean(), rel_tol=1e-12)  # class 4: IoU 0, kept
    assert math.isclose(res["mAcc"], 100 * acc_present.mean(), rel_tol=1e-12)
    assert math.isclose(res["aAcc"], 100 * tp.sum() / cm.sum(), rel_tol=1e-12)
    assert res["per_class_iou"] == pytest.approx([round(100 * v, 4) for v in iou], abs=1e-4)
    assert res["per_class_acc"][2] == 100.0  # class 2 is always predicted right
    assert res["per_class_acc"][4] is None  # never labelled: no accuracy


# --------------------------------------------------------------------------------- data


def test_bad_masks_are_one_line_naming_the_file(tmp_path):
    good = np.zeros((6, 8), dtype=np.uint8)
    Image.fromarray(good).save(tmp_path / "ok.png")
    assert read_mask(str(tmp_path / "ok.png"), (6, 8), 3, False).shape == (6, 8)
    with pytest.raises(LgvitError, match=r"small\.png: mask is 6x8 but its image is 7x8"):
        Image.fromarray(good).save(tmp_path / "small.png")
        read_mask(str(tmp_path / "small.png"), (7, 8), 3, False)
    high = good.copy()
    high[0, 0] = 7
    Image.fromarray(high).save(tmp_path / "high.png")
    with pytest.raises(LgvitError, match=r"high\.png: label 7 is out of range \(0\.\.2, 255"):
        read_mask(str(tmp_path / "high.png"), (6, 8), 3, False)
    with pytest.raises(LgvitError, match=r"high\.png: label 7 is out of range \(1\.\.5 \(0 ig"):
        read_mask(str(tmp_path / "high.png"), (6, 8), 5, True)
    Image.fromarray(np.zeros((6, 8, 3), np.uint8)).save(tmp_path / "rgb.png")
    with pytest.raises(LgvitError, match=r"rgb\.png: a RGB image, not a single-channel"):
        read_mask(str(tmp_path / "rgb.png"), (6, 8), 3, False)
    ade = good.copy()
    ade[0, :3] = (0, 1, 150)
    Image.fromarray(ade).save(tmp_path / "ade.png")
    got = read_mask(str(tmp_path / "ade.png"), (6, 8), 150, True)
    assert got[0, :3].tolist() == [255, 0, 149]  # 0 ignored, 1..150 -> 0..149


def test_mmseg_training_pipeline(seg_root):
    assert rescale_size((480, 640), (2048, 512)) == (512, 683)  # short side bound
    assert rescale_size((100, 1000), (2048, 512)) == (205, 2048)  # long side bound
    split = load_seg_split("segfolder", seg_root, "train")
    assert split.classes == CLASSES and len(split) == 24
    img = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)
    mask = torch.zeros(40, 50, dtype=torch.long)
    mask[:, 25:] = 1
    aug = SegAugment(crop=48, scale=(60, 30), ratio_range=(1.0, 1.0))
    rng = np.random.default_rng(0)
    x, y = train_sample(img, mask, aug, rng)
    assert x.shape == (3, 48, 48) and y.shape == (48, 48) and x.dtype == torch.uint8
    # Rescaled to 30x38 (0.75: the short side's bound), then padded to the crop.
    assert (y[30:] == 255).all() and (y[:, 38:] == 255).all() and (x[:, 30:] == 0).all()
    assert set(y[:30, :38].unique().tolist()) == {0, 1}


def test_training_batches_do_not_depend_on_workers_or_resuming(seg_root):
    split = load_seg_split("segfolder", seg_root, "train")
    aug = SegAugment(crop=32, scale=(64, 48))
    loader = SegTrainLoader(split, aug, batch_size=4, seed=3, workers=0)
    loader.set_epoch(1)
    third = list(loader)[2]
    for workers in (0, 2):  # continued at batch 2 (a mid-epoch resume), with or without workers
        loader = SegTrainLoader(split, aug, batch_size=4, seed=3, workers=workers)
        loader.set_epoch(1, batch=2)
        assert len(loader) == 6  # the epoch's steps, as the engine counts them
        got = next(iter(loader))
        assert torch.equal(got[0], third[0]) and torch.equal(got[1], third[1])


def test_a_split_without_its_masks_is_one_line(tmp_path):
    root = write_seg_set(tmp_path / "d", n_train=2, n_val=1)
    (root / "annotations" / "training" / "training_0001.png").unlink()
    with pytest.raises(LgvitError, match="training_0001.png: no mask"):
        load_seg_split("segfolder", root, "train")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "readme.txt").write_text("x")
    with pytest.raises(LgvitError, match="other: no images/ folder"):
        load_seg_split("ade20k", tmp_path / "other", "train")
    assert isinstance(load_seg_split("segfolder", root, "val"), SegSplit)


# --------------------------------------------------------------------------------- CLI


SEG_TRAIN = [
    "train", "--task", "segmentation", "--model", "lsa_micro_cifar", "--data", "segfolder",
    "--img-size", "32", "--batch-size", "8", "--amp", "none", "--workers", "0",
    "--set", "lr=1e-3", "--set", "lr_base_batch=8", "--set", "weight_decay=1e-4",
    "--set", "sched=poly", "--set", "warmup_epochs=0", "--set", "min_lr=0",
    "--set", "seg_scale=[64,48]", "--set", "drop_path=0",
]  # fmt: skip


def test_train_resume_eval_predict(seg_root, tmp_path, capsys):
    """A short run learns (mIoU far above chance), an iteration budget stops it, resuming
    continues it exactly, eval reproduces its mIoU, predict writes masks and overlays."""
    from lgvit.checkpoints.files import load_weights

    base = [*SEG_TRAIN, "--data-dir", str(seg_root)]
    # 24 images at batch 8: 3 steps an epoch; 14 iterations = 5 epochs, the last one cut short.
    assert main([*base, "--iters", "14", "--out", str(tmp_path / "full")]) == 0
    hist = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    # The poly schedule's last step (13 of 14): lr = 1e-3 * (1 - 13/14)^0.9.
    assert len(hist) == 5 and hist[-1]["lr"] == pytest.approx(1e-3 * (1 / 14) ** 0.9)
    miou = hist[-1]["test_mIoU"]
    assert miou > 50  # all-background would score ~28% (its IoU ~0.85, the shapes' 0)
    assert (
        main(
            [*base, "--iters", "14", "--out", str(tmp_path / "cut"), "--set", "time_limit_min=1e-9"]
        )
        == 0
    )  # fmt: skip  (stops after epoch 1)
    assert len((tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()) == 1
    assert main([*base, "--out", str(tmp_path / "cut"), "--resume", "auto",
                 "--set", "time_limit_min=null"]) == 0  # fmt: skip
    a, b = load_weights(tmp_path / "full" / "last"), load_weights(tmp_path / "cut" / "last")
    assert all(torch.equal(a[k], b[k]) for k in a)

    capsys.readouterr()
    ckpt = str(tmp_path / "full" / "last")
    assert main(["eval", "--checkpoint", ckpt, "--data", "segfolder", "--data-dir",
                 str(seg_root), "--amp", "none", "-j", "0", "--json"]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["mIoU"] == pytest.approx(miou, abs=1e-3) and res["count"] == 6
    assert len(res["per_class_iou"]) == 3

    img = seg_root / "images" / "validation" / "validation_0000.png"
    assert main(["predict", "--checkpoint", ckpt, str(img), "--out", str(tmp_path / "pred"),
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)[0]
    mask = np.asarray(Image.open(out["mask"]))
    assert mask.shape == np.asarray(Image.open(img)).shape[:2] and mask.max() <= 2
    assert (tmp_path / "pred" / "validation_0000_overlay.png").is_file()
    assert set(out["classes"]) <= set(CLASSES)


def test_bad_mask_stops_training_with_one_line(tmp_path, capsys):
    root = write_seg_set(tmp_path / "d", n_train=8, n_val=2)
    bad = root / "annotations" / "training" / "training_0003.png"
    Image.fromarray(np.full((5, 5), 9, np.uint8)).save(bad)
    code = main([*SEG_TRAIN, "--data-dir", str(root), "--epochs", "1", "--out",
                 str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "training_0003.png: mask is 5x5 but its image is" in err[0]


def test_backbones_start_from_classification_weights(tmp_path):
    """A classification checkpoint (here a plain .pth, as the authors' releases) becomes the
    backbone; the Swin skeleton built for 512 px gets the 224 px model's bias tables resized."""
    import lgvit
    from lgvit.run.config import TrainConfig
    from lgvit.tasks.segmentation.train import SegmentationTask

    cls = lgvit.create_model("lsa_micro_cifar")
    torch.save(cls.state_dict(), tmp_path / "cls.pth")
    task = SegmentationTask(cfg=TrainConfig(task="segmentation", model="lsa_micro_cifar",
                                            data="segfolder"))  # fmt: skip
    seg = create_segmenter("lsa_micro_cifar", 3, img_size=32)
    line = task.load_initial(seg, str(tmp_path / "cls.pth"))
    assert "classification weights" in line
    inner = seg.backbone.model.state_dict()
    assert all(torch.equal(inner[k], v) for k, v in cls.state_dict().items() if k in inner)
    assert len([k for k in cls.state_dict() if k in inner]) == len(inner)

    lit_s = lgvit.create_model("lit_s")
    table = "stages.2.blocks.0.attn.rel_pos.relative_position_bias_table"
    torch.save(lit_s.state_dict(), tmp_path / "lit_s.pth")
    bb = create_backbone("lit_s", checkpoint_path=str(tmp_path / "lit_s.pth"), img_size=512)
    assert lit_s.state_dict()[table].shape == (27 * 27, 12)  # 14x14 map at 224
    assert bb.model.state_dict()[table].shape == (63 * 63, 12)  # 32x32 map at 512
