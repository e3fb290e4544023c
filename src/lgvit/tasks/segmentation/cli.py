"""``lgvit eval`` and ``lgvit predict`` for segmentation checkpoints (Semantic FPN)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from lgvit.task_table import get_task
from lgvit.tasks.commands import (
    PREDICT_AMP,
    EvalDevice,
    add_eval_keys,
    check_classes,
    check_data,
    expand_images,
    images_with_outputs,
    palette,
    report_eval,
    report_predictions,
    require_out,
    save_png,
)
from lgvit.tasks.flags import WORKERS_FLAG, Flag

EVAL_FLAGS = (
    Flag("--cache-dir", help="where an image folder's decoded images are cached"),
    WORKERS_FLAG,
    Flag("--tta", choices=get_task("segmentation").eval_tta, default="none",
         help="flip: mmseg's flip test (the mean softmax of each image and its mirror image)"),
    Flag("--any-classes", action="store_true",
         help="evaluate even if the checkpoint's class names differ from the data's"),
)  # fmt: skip
PREDICT_FLAGS = (
    Flag("--out", help="the folder for each image's mask and overlay PNGs (required)"),
)
REFUSAL_HINTS = {  # (command, flag): what to do instead, after the one-line refusal
    ("eval", "predictions"): "`lgvit predict --checkpoint CHECKPOINT IMAGES --out DIR` writes "
    "each image's mask",
}


def run_eval(args: argparse.Namespace) -> int:
    """mIoU, mAcc, aAcc and per-class IoU of a segmentation checkpoint on a split's whole
    images (mmseg's single-scale ``whole`` inference; ``--tta flip``: its flip test)."""
    from lgvit.data.segmentation import SEG_DATASETS, SegEvalLoader, load_seg_split
    from lgvit.tasks.segmentation.evaluate import evaluate_segmentation, load_segmenter

    check_data(args, "a segmentation model", SEG_DATASETS)
    model = load_segmenter(args.checkpoint, args.device, args.model)
    info = model.seg_info
    split = load_seg_split(args.data, args.data_dir, "val", args.cache_dir)
    trained, found = info["classes"], split.classes
    check_classes(
        args.any_classes, len(trained), trained, found,
        lambda: f"{args.checkpoint} has {len(trained)} classes but {args.data_dir} has "
        f"{len(found)}; evaluate it on data with as many classes (--any-classes allows other "
        f"names, not another count), or fine-tune it with lgvit train --initial-checkpoint "
        f"{args.checkpoint}",
        lambda: f"{args.checkpoint} was trained on {len(trained)} classes "
        f"({', '.join(trained[:3])}, ...) but {args.data_dir} has {len(found)} "
        f"({', '.join(found[:3])}, ...); pass --any-classes to evaluate anyway",
    )  # fmt: skip
    on = EvalDevice(args, model)
    loader = SegEvalLoader(split, info["scale"], workers=args.workers, device=on.device)
    res = evaluate_segmentation(model, loader, len(trained), on.dist, on.amp, info["mean"],
                                info["std"], flip=args.tta == "flip")  # fmt: skip
    add_eval_keys(res, args, len(split), classes=list(found), scale=list(info["scale"]),
                  tta=args.tta, precision=on.precision)  # fmt: skip
    return report_eval(args, res, lambda r: _print_eval(args, r))


def _print_eval(args: argparse.Namespace, res: dict[str, Any]) -> None:
    scale = res["scale"]
    print(f"{args.checkpoint} on {args.data} ({res['count']} images, scale "
          f"{scale[0]}x{scale[1]}, whole image"
          f"{', flip test' if args.tta == 'flip' else ''})")  # fmt: skip
    if len(res["classes"]) <= 150:
        for name, iou, acc in zip(res["classes"], res["per_class_iou"], res["per_class_acc"],
                                  strict=True):  # fmt: skip
            iou_s = "   -  " if iou is None else f"{iou:6.2f}"
            acc_s = "   -  " if acc is None else f"{acc:6.2f}"
            print(f"  {name:24s} IoU {iou_s}%  Acc {acc_s}%")
    print(f"mIoU {res['mIoU']:.2f}%  mAcc {res['mAcc']:.2f}%  aAcc {res['aAcc']:.2f}%  "
          f"({res['precision']})")  # fmt: skip


def run_predict(args: argparse.Namespace) -> int:
    """Per image: ``NAME_mask.png`` (class indices, 8-bit) and ``NAME_overlay.png`` (the
    image with the classes' colours at 50%), in ``--out``, NAME distinct per input
    (:func:`~lgvit.tasks.commands.output_stems`); a JSON line per image with the files written,
    the classes found and their share of the pixels.

    The image is read as stored, as evaluation reads an image beside its mask: the mask has the
    file's pixel grid (a mask for it as a data set holds one) and the overlay is drawn on those
    pixels; both carry the image's EXIF orientation tag, so a viewer turns them as the photo."""
    from lgvit.data.decode import exif_orientation
    from lgvit.data.segmentation import eval_sample
    from lgvit.tasks.segmentation.evaluate import load_segmenter, predict_logits

    require_out(args.out, "segmentation predict writes PNGs")
    images = expand_images(args.images)
    model = load_segmenter(args.checkpoint, args.device, args.model)
    info = model.seg_info
    colours = palette(len(info["classes"]))
    results: list[dict] = []
    failed: list[str] = []
    for path, base, img in images_with_outputs(images, args.out, failed, upright=False):
        orientation = exif_orientation(path)
        x = eval_sample(img, info["scale"])[None]
        logits = predict_logits(model, x, tuple(img.shape[-2:]), info["mean"], info["std"],
                                PREDICT_AMP)  # fmt: skip
        pred = logits.argmax(1)[0].to(torch.uint8).cpu().numpy()
        mask, over = Path(f"{base}_mask.png"), Path(f"{base}_overlay.png")
        save_png(Image.fromarray(pred), mask, orientation)
        overlay = 0.5 * img.permute(1, 2, 0).numpy() + 0.5 * colours[pred]
        save_png(Image.fromarray(overlay.astype(np.uint8)), over, orientation)
        counts = np.bincount(pred.ravel(), minlength=len(colours))
        share = {info["classes"][c]: round(float(counts[c] / pred.size), 4)
                 for c in np.argsort(-counts) if counts[c]}  # fmt: skip
        results.append({"image": path, "mask": str(mask), "overlay": str(over),
                        "classes": share})  # fmt: skip

    def line(r: dict) -> str:
        top = ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(r["classes"].items())[:5])
        return f"{r['image']}: {r['mask']}, {r['overlay']} ({top})"

    return report_predictions(results, failed, args.json, line)
