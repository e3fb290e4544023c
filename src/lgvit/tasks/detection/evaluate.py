"""COCO evaluation of detectors: detections in COCO's results format, pycocotools' COCOeval,
the whole split across processes, and loading a detector for ``lgvit eval``/``predict``.

As mmdetection 2.11's ``CocoDataset.evaluate``: boxes as ``[x, y, w, h]`` with ``w = x2 - x1``
(no +1), masks thresholded at 0.5 and run-length encoded, each mask scored with its box's score;
bbox and segm are evaluated from separate result lists (segm without boxes, so COCOeval takes
each mask's area and box from the mask), over every image of the split. AP, AP50, AP75, APs,
APm, APl are COCOeval's ``stats[0:6]`` in percent.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from lgvit.checkpoints.kinds import DETECTORS, detector_spec
from lgvit.core.errors import LgvitError
from lgvit.core.progress import StepProgress, on_terminal
from lgvit.core.runtime import Dist, autocast

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")  # COCOeval's stats[0:6]


def detection_results(
    output: dict[str, torch.Tensor], image_id: int, cat_ids: Sequence[int], label_offset: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One image's detections as COCO results: (bbox results, segm results; empty without
    masks). ``label_offset``: 1 where class 0 is the background (Mask R-CNN)."""
    from pycocotools import mask as mask_utils

    boxes = output["boxes"].detach().float().cpu()
    scores = output["scores"].detach().float().cpu().tolist()
    labels = (output["labels"].detach().cpu() - label_offset).tolist()
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()
    cats = [cat_ids[c] for c in labels]
    bbox = [{"image_id": image_id, "category_id": c, "bbox": [round(v, 2) for v in b],
             "score": round(s, 5)} for b, s, c in zip(xywh, scores, cats, strict=True)]  # fmt: skip
    segm: list[dict[str, Any]] = []
    if "masks" in output:
        masks = (output["masks"].detach()[:, 0] > 0.5).cpu().numpy().astype(np.uint8)
        for m, s, c in zip(masks, scores, cats, strict=True):
            rle = mask_utils.encode(np.asfortranarray(m))
            rle["counts"] = rle["counts"].decode("ascii")
            segm.append({"image_id": image_id, "category_id": c, "segmentation": rle,
                         "score": round(s, 5)})  # fmt: skip
    return bbox, segm


def coco_evaluate(
    coco_gt: Any, results: list[dict[str, Any]], iou_type: str, image_ids: Sequence[int]
) -> dict[str, float]:
    """COCOeval's AP, AP50, AP75, APs, APm, APl (%) of ``results`` over ``image_ids``
    (``iou_type``: bbox or segm); all 0 when there is no detection."""
    from pycocotools.cocoeval import COCOeval

    if not results:
        return {f"{iou_type}_{k}": 0.0 for k in STATS}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints as it goes
        dt = coco_gt.loadRes(copy.deepcopy(results))
        ev = COCOeval(coco_gt, dt, iou_type)
        ev.params.imgIds = list(image_ids)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    # COCOeval's -1 (no ground truth in an area range) stays -1, as pycocotools prints it.
    stats = [100 * float(v) if v >= 0 else -1.0 for v in ev.stats[:6]]
    return {f"{iou_type}_{k}": v for k, v in zip(STATS, stats, strict=True)}


def detect(model: nn.Module, images: list[torch.Tensor], amp: torch.dtype | None = None) -> list:
    """torchvision detector outputs (on the CPU) for uint8 ``(3, H, W)`` images."""
    device = next(model.parameters()).device
    x = [im.to(device, non_blocking=True).float().div_(255) for im in images]
    with torch.no_grad(), autocast(device, amp):
        out = model(x)
    return [{k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in o.items()}
            for o in out]  # fmt: skip


def _gather(items: list[Any], d: Dist) -> list[Any]:
    if d.world_size == 1:
        return items
    import torch.distributed as dist

    parts: list[Any] = [None] * d.world_size
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def evaluate_detection(
    model: nn.Module, loader: Any, split: Any, label_offset: int, d: Dist,
    amp: torch.dtype | None, desc: str = "eval", keep_results: bool = False,
    masks: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """COCO bbox (and, with ``masks``, segm) AP over the whole split, all processes.
    ``loader`` yields ``(image uint8 or None if unreadable, image_id)``."""
    was_training = model.training
    model.eval()
    bbox: list[dict[str, Any]] = []
    segm: list[dict[str, Any]] = []
    count = unreadable = 0
    progress = StepProgress(len(loader), desc, d.main and on_terminal())
    for image, image_id in loader:
        progress.update(1)
        if image is None:
            unreadable += 1
            continue
        (out,) = detect(model, [image], amp)
        b, s = detection_results(out, image_id, split.cat_ids, label_offset)
        bbox += b
        segm += s
        count += 1
    progress.close()
    model.train(was_training)
    bbox, segm = _gather(bbox, d), _gather(segm, d)
    count, unreadable = (sum(v) for v in zip(*_gather([(count, unreadable)], d), strict=True))
    # Which images and why (the loader's one-line messages), not only how many.
    examples = _gather(list(getattr(loader, "skipped", []))[:3], d)[:3]
    result: dict[str, Any] = coco_evaluate(split.coco, bbox, "bbox", split.image_ids)
    if masks:
        result.update(coco_evaluate(split.coco, segm, "segm", split.image_ids))
    result.update(count=count, unreadable=unreadable, detections=len(bbox))
    if examples:
        result["unreadable_examples"] = examples
    if keep_results:
        result["results"] = {"bbox": bbox, "segm": segm}
    return result


# --------------------------------------------------------------------------------- loading


def load_detector(
    checkpoint: str, device: str | torch.device | None = None, model_name: str | None = None,
    detector: str | None = None,
) -> nn.Module:  # fmt: skip
    """An eval-mode detector from an lgvit detection checkpoint (its metadata names the
    detector, backbone, classes and COCO category ids, sizes) or from the LIT authors' mmdet
    ``.pth`` (``model_name`` the backbone, ``detector`` retinanet or maskrcnn; COCO's 80
    classes), or their released file by name (``lit_ti.coco_retinanet_authors``, downloaded
    once). ``model.det_info``: ``classes``, ``cat_ids``, ``label_offset``."""
    from lgvit.inference import EvalBuilder, load_eval_model
    from lgvit.tasks.detection import build_released

    builder = EvalBuilder("detection", _build_detector, build_released)
    return load_eval_model(checkpoint, device, builder, model_name, detector)


def _build_detector(
    checkpoint: str, record: Any, model_name: str | None, detector: str | None
) -> nn.Module:
    """Detection's builder for :func:`~lgvit.inference.load_eval_model`: the detector its
    record describes, the weights (lgvit's or the authors' mmdet layout) loaded."""
    from lgvit.checkpoints.files import load_weights
    from lgvit.dense.detection import create_detector
    from lgvit.dense.mmdet import is_mmdet_layout, mmdet_to_lgvit
    from lgvit.inference import load_task_weights

    weights = load_weights(checkpoint)
    name, kind = model_name or record.model, detector or record.detector
    if not name or not kind:
        raise LgvitError(f"{checkpoint}: no backbone or detector stored in it; pass --model "
                         f"NAME and --detector {'|'.join(DETECTORS)}")  # fmt: skip
    classes, cat_ids = list(record.classes or ()), list(record.cat_ids or ())
    scale = record.det_scale  # (long, short) sides
    long, short = max(scale), min(scale)
    model = create_detector(kind, name, len(classes), min_size=short, max_size=long,
                            img_size=record.img_size)  # fmt: skip
    authors = (is_mmdet_layout, mmdet_to_lgvit)
    load_task_weights(model, weights, checkpoint, f"{kind} on {name}", authors)
    model.det_info = {"classes": classes, "cat_ids": cat_ids,
                      "label_offset": detector_spec(kind).label_offset}  # fmt: skip
    return model
