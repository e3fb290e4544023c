"""One checkpoint -> ready eval model path for every task: classification (``eval``, ``predict``,
``export``, ``viz``), segmentation and detection each add their builder to
:func:`lgvit.inference.load_eval_model`, which does the shared work once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lgvit
import lgvit.inference as inference
from lgvit.cli import main
from lgvit.core.atomic import atomic_save_safetensors
from lgvit.dense.detection import create_detector
from lgvit.dense.semfpn import create_segmenter

BACKBONE = "lsa_micro_cifar"  # the smallest registered model: 32 px
HEADERS = {  # each task's header as its writer makes it
    "classification": {
        "model": BACKBONE, "img_size": "32", "num_classes": "3",
        "classes": '["cat", "dog", "frog"]', "dataset": "cifar10",
    },
    "segmentation": {
        "task": "segmentation", "model": BACKBONE, "img_size": "32", "num_classes": "3",
        "classes": '["background", "disc", "square"]', "dataset": "segfolder",
        "seg_scale": "[64, 48]",
    },
    "detection": {
        "task": "detection", "detector": "retinanet", "model": BACKBONE, "img_size": "32",
        "num_classes": "2", "classes": '["disc", "square"]', "cat_ids": "[3, 7]",
        "dataset": "coco", "det_scale": "[48, 32]",
    },
}  # fmt: skip


def _model(task: str) -> torch.nn.Module:
    if task == "segmentation":
        return create_segmenter(BACKBONE, 3, img_size=32)
    if task == "detection":
        return create_detector("retinanet", BACKBONE, 2, min_size=32, max_size=48, img_size=32)
    return lgvit.create_model(BACKBONE, num_classes=3, img_size=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per task: a tiny dense checkpoint (``ok``) and a copy whose weights are all NaN."""
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    out: dict[str, dict[str, Path]] = {}
    for task, meta in HEADERS.items():
        sd = {k: v.contiguous() for k, v in _model(task).state_dict().items()}
        nan = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for k, v in sd.items()}  # fmt: skip
        out[task] = {}
        for kind, weights in (("ok", sd), ("nan", nan)):
            path = root / f"{task}_{kind}.safetensors"
            atomic_save_safetensors(weights, path, meta)
            out[task][kind] = path
    return out


def _loaders() -> dict[str, Any]:
    from lgvit.tasks.detection.evaluate import load_detector
    from lgvit.tasks.segmentation.evaluate import load_segmenter
    from lgvit.tools.export import load_source

    return {
        "classification": lambda p: inference.load_model(p, "cpu"),
        "export": lambda p: load_source(p)[0],  # viz loads through it too
        "segmentation": lambda p: load_segmenter(p, "cpu"),
        "detection": lambda p: load_detector(p, "cpu"),
    }


@pytest.mark.parametrize("loader", ["classification", "export", "segmentation", "detection"])
def test_every_tasks_loader_goes_through_the_one_path(monkeypatch, checkpoints, loader):
    calls: list[tuple[str, Any]] = []
    real = inference.load_eval_model

    def spy(checkpoint: str, device: Any, builder: Any, *args: Any) -> torch.nn.Module:
        calls.append((checkpoint, builder.task))
        return real(checkpoint, device, builder, *args)

    monkeypatch.setattr(inference, "load_eval_model", spy)
    task = "classification" if loader == "export" else loader
    path = str(checkpoints[task]["ok"])
    model = _loaders()[loader](path)
    assert calls == [(path, None if task == "classification" else task)]
    assert not model.training and next(model.parameters()).device.type == "cpu"
    info = {"segmentation": "seg_info", "detection": "det_info"}.get(task)
    assert info is None or getattr(model, info)["classes"]  # the task's builder still ran


@pytest.mark.parametrize("task", sorted(HEADERS))
def test_non_finite_weights_are_the_same_one_line_for_every_task(
    checkpoints, image, tmp_path, capsys, task
):
    nans = str(checkpoints[task]["nan"])
    out = tmp_path / "out"
    args = ["predict", "--checkpoint", nans, image]
    rc = main(args if task == "classification" else [*args, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"{nans}: " in err[0] and "holds non-finite values (NaN or inf)" in err[0]
    assert not out.exists()  # refused before anything was written
