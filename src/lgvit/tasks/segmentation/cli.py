"""``lgvit eval`` and ``lgvit predict`` for segmentation checkpoints (Semantic FPN)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lgvit.core.errors import LgvitError
from lgvit.task_table import get_task
from lgvit.tasks.flags import Flag

EVAL_FLAGS = (
    Flag("--cache-dir", help="where an image folder's decoded images are cached"),
    Flag("-j", "--workers", type=int, default=2, help="decoding processes for an image folder"),
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
    from lgvit.core.runtime import Dist, precision_name, resolve_amp
    from lgvit.data.segmentation import SEG_DATASETS, SegEvalLoader, load_seg_split
    from lgvit.tasks.segmentation.evaluate import evaluate_segmentation, load_segmenter

    if args.data not in SEG_DATASETS:
        raise LgvitError(
            f"{args.checkpoint} is a segmentation model; evaluate it on {' or '.join(SEG_DATASETS)}"
        )
    model = load_segmenter(args.checkpoint, args.device, args.model)
    info = model.seg_info
    split = load_seg_split(args.data, args.data_dir, "val", args.cache_dir)
    if len(split.classes) != len(info["classes"]):  # --any-classes too: label i is class i
        raise LgvitError(
            f"{args.checkpoint} has {len(info['classes'])} classes but {args.data_dir} has "
            f"{len(split.classes)}; evaluate it on data with as many classes (--any-classes "
            "allows other names, not another count), or fine-tune it with lgvit train "
            f"--initial-checkpoint {args.checkpoint}"
        )
    if list(split.classes) != list(info["classes"]) and not args.any_classes:
        raise LgvitError(
            f"{args.checkpoint} was trained on {len(info['classes'])} classes "
            f"({', '.join(info['classes'][:3])}, ...) but {args.data_dir} has "
            f"{len(split.classes)} ({', '.join(split.classes[:3])}, ...); pass --any-classes "
            "to evaluate anyway"
        )
    device = next(model.parameters()).device
    loader = SegEvalLoader(split, info["scale"], workers=args.workers, device=device)
    amp = resolve_amp(args.amp, device)
    n = len(info["classes"])
    res = evaluate_segmentation(model, loader, n, Dist(device=device), amp, info["mean"],
                                info["std"], flip=args.tta == "flip")  # fmt: skip
    res.update(checkpoint=str(args.checkpoint), data=args.data, images=len(split),
               classes=list(split.classes), scale=list(info["scale"]), tta=args.tta,
               precision=precision_name(amp))  # fmt: skip
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{args.checkpoint} on {args.data} ({res['count']} images, scale "
          f"{info['scale'][0]}x{info['scale'][1]}, whole image"
          f"{', flip test' if args.tta == 'flip' else ''})")  # fmt: skip
    if len(split.classes) <= 150:
        for name, iou, acc in zip(split.classes, res["per_class_iou"], res["per_class_acc"],
                                  strict=True):  # fmt: skip
            iou_s = "   -  " if iou is None else f"{iou:6.2f}"
            acc_s = "   -  " if acc is None else f"{acc:6.2f}"
            print(f"  {name:24s} IoU {iou_s}%  Acc {acc_s}%")
    print(f"mIoU {res['mIoU']:.2f}%  mAcc {res['mAcc']:.2f}%  aAcc {res['aAcc']:.2f}%  "
          f"({res['precision']})")  # fmt: skip
    return 0


def run_predict(args: argparse.Namespace) -> int:
    """Per image: ``NAME_mask.png`` (class indices, 8-bit) and ``NAME_overlay.png`` (the
    image with the classes' colours at 50%), in ``--out``, NAME distinct per input
    (:func:`~lgvit.inference.output_stems`); a JSON line per image with the files written,
    the classes found and their share of the pixels.

    The image is read as stored, as evaluation reads an image beside its mask: the mask has the
    file's pixel grid (a mask for it as a data set holds one) and the overlay is drawn on those
    pixels; both carry the image's EXIF orientation tag, so a viewer turns them as the photo."""
    from lgvit.core.runtime import precision_name
    from lgvit.data.decode import exif_orientation
    from lgvit.data.segmentation import eval_sample
    from lgvit.inference import expand_images, images_with_outputs, report_predictions
    from lgvit.tasks.segmentation.evaluate import load_segmenter, palette, predict_logits

    if not args.out:
        raise LgvitError("segmentation predict writes PNGs: pass --out DIR")
    images = expand_images(args.images)
    model = load_segmenter(args.checkpoint, args.device, args.model)
    info = model.seg_info
    colours = palette(len(info["classes"]))
    amp = None  # predict takes no --amp: full precision
    results: list[dict] = []
    failed: list[str] = []
    for path, base, img in images_with_outputs(images, args.out, failed, upright=False):
        orientation = exif_orientation(path)
        x = eval_sample(img, info["scale"])[None]
        logits = predict_logits(model, x, tuple(img.shape[-2:]), info["mean"], info["std"], amp)
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

    return report_predictions(results, failed, args.json, line, precision_name(amp))


def save_png(img: Image.Image, path: Path, orientation: int = 1) -> None:
    """``img`` as a PNG at ``path``, atomically; an EXIF ``orientation`` tag other than 1 kept."""
    import io

    from lgvit.core.atomic import atomic_write_bytes
    from lgvit.data.decode import EXIF_ORIENTATION

    buf = io.BytesIO()
    if orientation != 1:
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = orientation
        img.save(buf, format="PNG", exif=exif)
    else:
        img.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
