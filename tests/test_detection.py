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
