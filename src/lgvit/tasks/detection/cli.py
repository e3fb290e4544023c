"""``lgvit eval`` and ``lgvit predict`` for detection checkpoints (RetinaNet, Mask R-CNN)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from lgvit.checkpoints.kinds import DETECTORS, detector_spec
from lgvit.task_table import get_task
from lgvit.tasks.commands import (
    PREDICT_AMP,
    EvalDevice,
    add_eval_keys,
    check_classes,
    check_data,
    check_predictions_path,
    expand_images,
    images_with_outputs,
    palette,
    predict_precision,
    report_eval,
    report_predictions,
    require_out,
    save_png,
)
from lgvit.tasks.flags import WORKERS_FLAG, Flag, finite_float

_DETECTOR = dict(choices=DETECTORS,
                 help="the detector of an authors' mmdet .pth (with --model)")  # fmt: skip
EVAL_FLAGS = (
    Flag("--cache-dir", help="where an image folder's decoded images are cached"),
    WORKERS_FLAG,
    Flag("--predictions", metavar="FILE",
         help="the detections in COCO's results format (JSON; masks in FILE.segm.json)"),
    Flag("--detector", **_DETECTOR),
    # mmdet's 1x configs test without augmentation: "none" only, the other tasks' default.
    Flag("--tta", choices=get_task("detection").eval_tta, default="none",
         help="none: no test-time augmentation (mmdet's 1x test)"),
    Flag("--any-classes", action="store_true",
         help="evaluate even if the checkpoint's category ids differ from the data's"),
)  # fmt: skip
PREDICT_FLAGS = (
    Flag("--out", help="the folder for each image's boxes drawn (PNG) and listed (JSON) "
         "(required)"),
    Flag("--detector", **_DETECTOR),
    Flag("--score-thr", type=finite_float(0, 1), default=0.3,
         help="draw boxes scoring at least this, in [0, 1]"),
)  # fmt: skip


def run_eval(args: argparse.Namespace) -> int:
    """COCO bbox (and segm) AP of a detection checkpoint on ``--data-dir``'s val split, by
    pycocotools' COCOeval; ``--predictions F.json`` keeps the detections in COCO's results
    format (bbox in F.json, masks in F.segm.json) for anyone to rerun COCOeval on."""
    from lgvit.data.coco import COCO_DATASETS, DetEvalLoader, load_coco_split, require_masks
    from lgvit.tasks.detection.evaluate import evaluate_detection, load_detector

    check_data(args, "a detector", COCO_DATASETS)
    check_predictions_path(args.predictions)
    model = load_detector(args.checkpoint, args.device, args.model, args.detector)
    info = model.det_info
    split = load_coco_split(args.data_dir, "val", args.cache_dir)
    spec = detector_spec(model.detector)
    if spec.masks:  # COCOeval's segm reads every annotation's mask
        require_masks(split)
    trained, found = info["cat_ids"], split.cat_ids
    check_classes(
        args.any_classes, len(trained), trained, found,
        lambda: f"{args.checkpoint} has {len(trained)} categories but {split.ann_file} has "
        f"{len(found)}; evaluate it on data with as many (--any-classes allows other ids, not "
        f"another count), or fine-tune it with lgvit train --initial-checkpoint "
        f"{args.checkpoint}",
        lambda: f"{args.checkpoint} was trained on {len(trained)} categories (ids "
        f"{_ids(trained)}) but {split.ann_file} has {len(found)} (ids {_ids(found)}); pass "
        "--any-classes to evaluate anyway",
    )  # fmt: skip
    on = EvalDevice(args, model)
    loader = DetEvalLoader(split, workers=args.workers, device=on.device)
    res = evaluate_detection(model, loader, split, info["label_offset"], on.dist, on.amp,
                             keep_results=True, masks=spec.masks)  # fmt: skip
    results = res.pop("results")
    if args.predictions:
        res.update(_write_predictions(args.predictions, results, spec.masks))
    add_eval_keys(res, args, len(split), annotations=str(split.ann_file),
                  precision=on.precision, tta=args.tta)  # fmt: skip
    return report_eval(args, res, lambda r: _print_eval(args, r))


def _write_predictions(path: str, results: dict[str, list], masks: bool) -> dict[str, str]:
    """The detections in COCO's results format: boxes in ``path``, masks (``masks``) in
    ``path`` with ``.segm.json`` for ``.json``; the result's keys naming the files."""
    from lgvit.core.atomic import atomic_write_bytes

    out = Path(path)
    atomic_write_bytes(out, json.dumps(results["bbox"]).encode())
    written = {"predictions": str(out)}
    if masks:
        segm = out.with_name(out.name.removesuffix(".json") + ".segm.json")
        atomic_write_bytes(segm, json.dumps(results["segm"]).encode())
        written["predictions_segm"] = str(segm)
    return written


def _print_eval(args: argparse.Namespace, res: dict[str, Any]) -> None:
    from lgvit.tasks.detection.evaluate import STATS

    print(f"{args.checkpoint} on {res['annotations']} ({res['count']} images, "
          f"{res['detections']} detections, {res['precision']})")  # fmt: skip
    if res["unreadable"]:
        print(f"  {res['unreadable']} unreadable image(s) counted as without detections"
              + "".join(f"\n    {m}" for m in res.get("unreadable_examples", [])))  # fmt: skip
    for t in ("bbox", "segm"):
        if f"{t}_AP" in res:
            print(f"{t:4s}  " + "  ".join(f"{k} {res[f'{t}_{k}']:.1f}" for k in STATS))
    for key in ("predictions", "predictions_segm"):
        if key in res:
            print(f"{key.replace('_', ' ')}: {res[key]}")


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")


def run_predict(args: argparse.Namespace) -> int:
    """Per image, in ``--out``: ``NAME_det.png`` (boxes with class names and scores, masks
    tinted, those scoring at least ``--score-thr``) and ``NAME_det.json`` (every detection: box
    ``[x1, y1, x2, y2]`` in pixels, class name, COCO category id, score; also printed with
    ``--json``), NAME distinct per input (:func:`~lgvit.tasks.commands.output_stems`)."""
    from lgvit.core.atomic import atomic_write_bytes
    from lgvit.tasks.detection.evaluate import detect, load_detector

    require_out(args.out, "detection predict draws its boxes")
    images = expand_images(args.images)
    model = load_detector(args.checkpoint, args.device, args.model, args.detector)
    info = model.det_info
    colours = palette(len(info["classes"]) + 1)[1:]
    results: list[dict] = []
    failed: list[str] = []
    for path, base, img in images_with_outputs(images, args.out, failed):
        (det,) = detect(model, [img], PREDICT_AMP)
        dets = _detections(det, info)
        png, js = Path(f"{base}_det.png"), Path(f"{base}_det.json")
        labels = (det["labels"] - info["label_offset"]).numpy()
        save_png(_draw(img, det, dets, colours[labels], args.score_thr), png)
        result = {"image": path, "drawn": str(png), "json": str(js), "detections": dets,
                  "precision": predict_precision()}  # fmt: skip
        atomic_write_bytes(js, json.dumps(result, indent=1).encode())
        results.append(result)

    def line(r: dict[str, Any]) -> str:
        shown = [d for d in r["detections"] if d["score"] >= args.score_thr]
        top = ", ".join(f"{d['class']} {100 * d['score']:.0f}%" for d in shown[:5])
        return f"{r['image']}: {r['drawn']} ({len(shown)} above {args.score_thr}: {top})"

    return report_predictions(results, failed, args.json, line)


def _detections(det: dict[str, Any], info: dict[str, Any]) -> list[dict[str, Any]]:
    labels = (det["labels"] - info["label_offset"]).tolist()
    return [
        {"class": info["classes"][c], "category_id": info["cat_ids"][c],
         "score": round(float(s), 4), "box": [round(float(v), 1) for v in b]}
        for b, s, c in zip(det["boxes"], det["scores"], labels, strict=True)
    ]  # fmt: skip


def _draw(
    img: Any, det: dict[str, Any], dets: list[dict[str, Any]], colours: np.ndarray, thr: float
) -> Image.Image:
    """The image with each detection scoring ``thr`` or more: its mask tinted at 50%, its box
    and a label ``class score``; ``colours[i]``: detection i's class colour."""
    arr = img.permute(1, 2, 0).numpy().astype(np.float32)
    keep = [i for i, d in enumerate(dets) if d["score"] >= thr]
    if "masks" in det:
        for i in keep:
            m = det["masks"][i, 0].numpy() > 0.5
            arr[m] = 0.5 * arr[m] + 0.5 * colours[i]
    canvas = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for i in keep:
        d = dets[i]
        colour = tuple(int(c) for c in colours[i])
        draw.rectangle(d["box"], outline=colour, width=2)
        text = f"{d['class']} {d['score']:.2f}"
        x, y = d["box"][0], max(d["box"][1] - 11, 0)
        draw.rectangle(draw.textbbox((x, y), text), fill=colour)
        draw.text((x, y), text, fill=(255, 255, 255))
    return canvas
