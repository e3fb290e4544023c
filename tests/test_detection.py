"""RetinaNet and Mask R-CNN (torchvision's) on the pyramid backbones, set as LIT's mmdetection
configs: sizes against the authors' detectors, their checkpoint layout, training losses and
detections at non-square sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lgvit.dense.detection import create_detector, retinanet_anchors
from lgvit.dense.mmdet import mmdet_to_lgvit

FIXTURES = Path(__file__).parent / "fixtures"
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _fixture(kind: str, name: str) -> dict[str, list[int]]:
    return json.loads((FIXTURES / f"mmdet_{kind}_{name}_keys.json").read_text())


@pytest.mark.parametrize("kind", ["retinanet", "maskrcnn"])
@pytest.mark.parametrize("name", ["lit_ti", "lit_s"])
def test_sizes_match_the_authors_detectors(kind, name):
    """The authors' detectors built from their configs (the fixtures): ours differ only by what
    torchvision adds (a background row in Mask R-CNN's box regression and mask logits) and by
    LIT-Ti's class token, unused in dense mode."""
    theirs = sum(math.prod(s) for k, s in _fixture(kind, name).items() if not k.endswith(BUFFERS))
    with torch.device("meta"):
        ours = sum(p.numel() for p in create_detector(kind, name).parameters())
    extra = (4 * 1024 + 4) + (256 + 1) if kind == "maskrcnn" else 0
    extra += 512 if name == "lit_ti" else 0
    assert ours - theirs == extra


@pytest.mark.parametrize("kind", ["retinanet", "maskrcnn"])
@pytest.mark.parametrize("name", ["lit_ti", "lit_s"])
def test_the_authors_mmdet_checkpoint_layout_loads(kind, name):
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g) for k, s in _fixture(kind, name).items()}
    sd.update({k: torch.tensor(5) for k in sd if k.endswith("num_batches_tracked")})
    model = create_detector(kind, name)
    mapped = mmdet_to_lgvit({"meta": {}, "state_dict": sd}, model)
    model.load_state_dict(mapped)  # strict: every key, every shape
    own = model.state_dict()
    if kind == "retinanet":
        assert torch.equal(own["head.classification_head.cls_logits.weight"],
                           sd["bbox_head.retina_cls.weight"])  # fmt: skip
        assert torch.equal(
            own["backbone.fpn.extra_blocks.p6.weight"], sd["neck.fpn_convs.3.conv.weight"]
        )
    else:
        cls = sd["roi_head.bbox_head.fc_cls.weight"]  # background last -> first
        assert torch.equal(own["roi_heads.box_predictor.cls_score.weight"][0], cls[80])
        assert torch.equal(own["roi_heads.box_predictor.cls_score.weight"][1:], cls[:80])
        reg = own["roi_heads.box_predictor.bbox_pred.weight"]
        assert not reg[:4].any() and torch.equal(reg[4:], sd["roi_head.bbox_head.fc_reg.weight"])
        logits = own["roi_heads.mask_predictor.mask_fcn_logits.weight"]
        assert torch.equal(logits[1:], sd["roi_head.mask_head.conv_logits.weight"])
    if name == "lit_s":
        i = 0 if kind == "retinanet" else 1  # RetinaNet outputs stages 2-4 only
        assert torch.equal(own[f"backbone.body.norms.{i}.weight"], sd["backbone.norm1.weight"])


def test_retinanet_anchors_are_mmdets():
    # octave base scale 4, 3 scales per octave: stride 8 -> 32, 40.3, 50.8; not rounded.
    sizes = retinanet_anchors().sizes[0]
    assert sizes == pytest.approx((32.0, 32 * 2 ** (1 / 3), 32 * 2 ** (2 / 3)))
    base = retinanet_anchors().cell_anchors[0]
    assert base.shape == (9, 4) and not torch.equal(base, base.round())


@pytest.mark.parametrize("kind", ["retinanet", "maskrcnn"])
@pytest.mark.parametrize("name", ["lit_ti", "swin_tiny", "lsa_small_224"])
def test_detectors_train_and_detect_at_a_non_square_size(kind, name):
    torch.manual_seed(0)
    model = create_detector(kind, name, num_classes=3, min_size=64, max_size=112,
                            drop_path_rate=0.0)  # fmt: skip
    images = [torch.rand(3, 60, 100), torch.rand(3, 70, 80)]
    mask = torch.zeros(1, 60, 100, dtype=torch.uint8)
    mask[0, 10:40, 20:60] = 1
    targets = [
        {"boxes": torch.tensor([[20.0, 10, 60, 40]]), "labels": torch.tensor([1]), "masks": mask},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long),
         "masks": torch.zeros(0, 70, 80, dtype=torch.uint8)},  # an image without objects
    ]  # fmt: skip
    model.train()
    losses = model(images, targets)
    total = sum(losses.values())
    assert torch.isfinite(total)
    total.backward()
    model.eval()
    with torch.no_grad():
        out = model(images)
    assert len(out) == 2 and out[0]["boxes"].shape[-1] == 4
    if kind == "maskrcnn":
        assert out[1]["masks"].shape[-2:] == (70, 80)


def test_every_pyramid_builds_both_detectors():
    """Every dense backbone: both detectors build (on the meta device), with an anchor size per
    pyramid level and the FPN reading the backbone's channels."""
    from lgvit.dense import dense_backbone_names

    for name in dense_backbone_names():
        for kind, extra in (("retinanet", 2), ("maskrcnn", 1)):
            with torch.device("meta"):
                model = create_detector(kind, name, num_classes=3)
            body = model.backbone.body
            levels = len(body.feature_info.channels()) + extra
            gen = model.anchor_generator if kind == "retinanet" else model.rpn.anchor_generator
            assert len(gen.sizes) == levels, (name, kind)
            inner = model.backbone.fpn.inner_blocks
            assert [b[0].in_channels for b in inner] == body.feature_info.channels()


# ------------------------------------------------------------------- training and evaluation

DET_TRAIN = [
    "train", "--task", "detection", "--model", "lsa_micro_cifar", "--data", "coco",
    "--batch-size", "4", "--amp", "none", "--workers", "0", "--set", "drop_path=0",
    "--set", "lr=5e-4", "--set", "lr_base_batch=4", "--set", "weight_decay=1e-4",
    "--set", "clip_grad=1", "--set", "warmup_iters=10", "--set", "warmup_lr=5e-7",
    "--set", "sched=step", "--set", "min_lr=0", "--set", "det_scale=[48,32]",
]  # fmt: skip


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    from det_fixtures import write_coco_set

    # 32x48 images (every third 48x32), 1-3 shapes of 2 classes, two empty training images,
    # a crowd region: 30 kept training images = 7 steps an epoch at batch 4.
    return write_coco_set(tmp_path_factory.mktemp("coco"), n_train=32, n_val=8, size=(32, 48))


def test_retinanet_learns_and_eval_is_cocoeval(coco_root, tmp_path, capsys):
    """A short run learns (bbox AP50 far above zero), the lr follows mmdet's step schedule,
    ``lgvit eval`` reproduces the run's AP and writes COCO results on which COCOeval, run
    here on its own, gives that AP; ``lgvit predict`` draws boxes and lists detections."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from lgvit.cli import main

    run = tmp_path / "run"
    assert main([*DET_TRAIN, "--data-dir", str(coco_root), "--detector", "retinanet",
                 "--epochs", "6", "--set", "decay_milestones=[5]", "--set", "eval_every=6",
                 "--out", str(run)]) == 0  # fmt: skip
    hist = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    # The lr of each epoch's last step (7 an epoch): warm-up step 6 of 10, then base, then x0.1.
    assert len(hist) == 6 and hist[0]["lr"] == pytest.approx(5e-7 + (5e-4 - 5e-7) * 6 / 10)
    assert hist[4]["lr"] == pytest.approx(5e-4) and hist[5]["lr"] == pytest.approx(5e-5)
    ap50 = hist[-1]["test_bbox_AP50"]
    assert ap50 > 20, hist[-1]

    capsys.readouterr()
    preds = tmp_path / "dets.json"
    assert main(["eval", "--checkpoint", str(run / "last"), "--data", "coco", "--data-dir",
                 str(coco_root), "--amp", "none", "-j", "0", "--json",
                 "--predictions", str(preds)]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["bbox_AP50"] == pytest.approx(ap50, abs=1e-3) and res["count"] == 8
    assert "segm_AP" not in res
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(coco_root / "annotations" / "instances_val2017.json"))
        ev = COCOeval(gt, gt.loadRes(str(preds)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert 100 * ev.stats[0] == pytest.approx(res["bbox_AP"], abs=1e-6)
    assert 100 * ev.stats[1] == pytest.approx(res["bbox_AP50"], abs=1e-6)
    dets = json.loads(preds.read_text())
    assert {d["category_id"] for d in dets} <= {3, 7}  # COCO's ids, not label indices

    img = sorted((coco_root / "val2017").iterdir())[0]
    assert main(["predict", "--checkpoint", str(run / "last"), str(img), "--out",
                 str(tmp_path / "pred"), "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)[0]
    assert Path(out["drawn"]).is_file() and out["detections"]
    assert json.loads(Path(out["drawn"]).with_suffix(".json").read_text()) == out
    assert {d["class"] for d in out["detections"]} <= {"disc", "square"}


def test_maskrcnn_trains_and_scores_masks(coco_root, tmp_path, capsys):
    """Mask R-CNN through the CLI: two steps, an evaluation with bbox and segm AP from COCOeval,
    masks in the results file and drawn by predict."""
    from lgvit.cli import main

    run = tmp_path / "run"
    assert main([*DET_TRAIN, "--data-dir", str(coco_root), "--detector", "maskrcnn",
                 "--iters", "2", "--batch-size", "2", "--out", str(run)]) == 0  # fmt: skip
    hist = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert {"test_bbox_AP", "test_segm_AP"} <= set(hist[-1])
    capsys.readouterr()
    preds = tmp_path / "dets.json"
    assert main(["eval", "--checkpoint", str(run / "last"), "--data", "coco", "--data-dir",
                 str(coco_root), "-j", "0", "--amp", "none", "--json", "--predictions",
                 str(preds)]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert res["segm_AP"] == pytest.approx(hist[-1]["test_segm_AP"], abs=1e-3)
    segm = json.loads((tmp_path / "dets.segm.json").read_text())
    assert len(segm) == res["detections"] and all("counts" in d["segmentation"] for d in segm)


def test_bad_annotation_file_is_one_line(coco_root, tmp_path, capsys):
    import shutil

    from lgvit.cli import main

    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    ann = root / "annotations" / "instances_train2017.json"
    data = json.loads(ann.read_text())
    data["annotations"][3]["bbox"] = [1, 2, 3]
    ann.write_text(json.dumps(data))
    code = main([*DET_TRAIN, "--data-dir", str(root), "--epochs", "1", "--out",
                 str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "instances_train2017.json" in err[0]


def test_step_schedule_milestones_and_iteration_warmup():
    from lgvit.run.config import TrainConfig
    from lgvit.run.optim import lr_at, warmup_steps

    cfg = TrainConfig(sched="step", decay_milestones=(8, 11), warmup_iters=500, warmup_lr=1e-7,
                      min_lr=0.0)  # fmt: skip
    sch = dict(total_steps=1200, warmup_steps=warmup_steps(cfg, 100), cfg=cfg, base_lr=1e-4,
               steps_per_epoch=100)  # fmt: skip
    assert sch["warmup_steps"] == 500
    assert lr_at(250, **sch) == pytest.approx(1e-7 + (1e-4 - 1e-7) / 2)  # mmdet's linear ramp
    assert lr_at(799, **sch) == pytest.approx(1e-4)  # epoch 8 (0-based 7) still at the base
    assert lr_at(800, **sch) == pytest.approx(1e-5)  # after epoch 8
    assert lr_at(1100, **sch) == pytest.approx(1e-6)  # after epoch 11
