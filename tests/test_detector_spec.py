"""The detector spec (lgvit.checkpoints.kinds.DETECTOR_SPECS) is the one place the detectors differ:
its facts against the detectors built, the Swin question answered without building a model, and no
detector chosen by comparing its name any more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import quick_init

from lgvit.checkpoints.kinds import DETECTOR_SPECS, DETECTORS, detector_spec
from lgvit.core.errors import LgvitError
from lgvit.dense import dense_backbone_names
from lgvit.dense.detection import create_detector
from lgvit.models import create_model
from lgvit.models.registry import model_class
from lgvit.models.swin import SwinTransformer

SRC = Path(__file__).resolve().parent.parent / "src" / "lgvit"
CLASSES = 3


def test_detectors_are_the_specs_names():
    assert DETECTORS == tuple(DETECTOR_SPECS)
    assert all(detector_spec(n).name == n for n in DETECTORS)


def test_unknown_detector_is_one_line_naming_the_known_ones():
    with pytest.raises(LgvitError, match=r"detector 'yolo' is not one of retinanet, maskrcnn$"):
        detector_spec("yolo")
    with pytest.raises(LgvitError, match="'yolo' is not one of"):
        create_detector("yolo", "lit_ti")


@pytest.mark.parametrize("kind", DETECTORS)
def test_spec_matches_the_built_detector(kind):
    """Masks: a mask head exactly where the spec says; the label offset: torchvision's
    background class in front of the object classes (training and evaluation shift labels by
    it); two-stage: an RPN."""
    spec = detector_spec(kind)
    with torch.device("meta"):
        model = create_detector(kind, "lit_ti", num_classes=CLASSES)
    roi = getattr(model, "roi_heads", None)
    assert (roi is not None and roi.has_mask()) == spec.masks
    assert hasattr(model, "rpn") == spec.two_stage
    if spec.two_stage:
        scores = model.roi_heads.box_predictor.cls_score.out_features
    else:
        scores = model.head.classification_head.num_classes
    assert scores == CLASSES + spec.label_offset


@pytest.mark.parametrize("kind", DETECTORS)
def test_swin_backbones_lose_the_stride4_norm_where_the_spec_says(kind):
    spec = detector_spec(kind)
    with torch.device("meta"):
        body = create_detector(kind, "lit_s", num_classes=CLASSES).backbone.body
    unnormed = tuple(i for i, n in zip(body.out_indices, body.norms, strict=True)
                     if isinstance(n, torch.nn.Identity))  # fmt: skip
    assert unnormed == spec.swin_unnormed


def test_swin_question_answered_as_building_the_model_does():
    """model_class answers from the registry what building each dense backbone gives."""
    for name in dense_backbone_names():
        with torch.device("meta"):
            model = create_model(name)
        assert isinstance(model, model_class(name)), name
        swin = isinstance(model, SwinTransformer)
        assert issubclass(model_class(name), SwinTransformer) == swin, name


def test_no_detector_is_chosen_by_its_name():
    names = "|".join(DETECTORS)
    pattern = re.compile(rf"""[!=]= *["']({names})["']""")
    found = [
        f"{p.relative_to(SRC)}:{i}"
        for p in SRC.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found


def test_swin_question_for_a_save_pretrained_folder(tmp_path):
    """A ``local-dir:`` backbone is asked through the architecture its config names, as
    building it did (a Mask R-CNN on a saved LIT-S folder keeps the stride-4 map unnormed)."""
    from lgvit.models.hub import save_pretrained

    with quick_init():
        save_pretrained(create_model("lit_s", num_classes=3), tmp_path / "lit_s")
    assert model_class(f"local-dir:{tmp_path / 'lit_s'}") is model_class("lit_s")
    assert issubclass(model_class("lit_s"), SwinTransformer)
