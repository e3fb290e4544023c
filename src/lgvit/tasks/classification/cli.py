"""``lgvit eval`` and ``lgvit predict`` for classification checkpoints."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from lgvit.core.errors import LgvitError
from lgvit.data.sources import option_help
from lgvit.data.transforms import INTERPOLATIONS
from lgvit.task_table import get_task
from lgvit.tasks.commands import (
    PREDICT_AMP,
    EvalDevice,
    add_eval_keys,
    check_classes,
    check_data,
    check_predictions_path,
    expand_images,
    report_eval,
    report_predictions,
)
from lgvit.tasks.flags import WORKERS_FLAG, Flag, finite_float

TTA_HELP = ("flip: average the logits of each image and its mirror image; flip-translate: also "
            "of the two one-pixel shifts and their mirror images (six views)")  # fmt: skip
EVAL_FLAGS = (
    Flag("--cache-dir", help="where an image folder's decoded images are cached"),
    Flag("--img-size", type=int, help="default: the size it was trained at"),
    Flag("--crop-pct", type=finite_float(0, 1, low_open=True),
         help="in (0, 1]; default: the model's (e.g. 0.875, 0.9)"),
    Flag("--interpolation", help=f"{' | '.join(INTERPOLATIONS)} (default: the model's)"),
    Flag("--mean", type=finite_float(), nargs=3, metavar="V", help="default: the model's"),
    Flag("--std", type=finite_float(0, low_open=True), nargs=3, metavar="V",
         help="positive; default: the model's"),
    Flag("--class-map", help="class index per folder name: one name per line, or 'name index' "
         "lines (default: folders in natural order)"),
    Flag("--real-labels", metavar="FILE",
         help="ImageNet-ReaL's real.json: also report ReaL top-1/top-5"),
    Flag("--predictions", metavar="FILE",
         help="a CSV: image, label, top-5 classes and probabilities"),
    Flag("--input-key", help=option_help("input_key", "image key(s) of a sample or image "
                                         "column", "default: ")),
    Flag("--target-key", help=option_help("target_key", "label key or column", "default: ")),
    Flag("--split", help=option_help("val_split", "the split to evaluate", "default: ")),
    Flag("--batch-size", type=int, default=128, help="images per batch"),
    WORKERS_FLAG,
    Flag("--tta", choices=get_task("classification").eval_tta, default="none", help=TTA_HELP),
    Flag("--any-classes", action="store_true",
         help="evaluate even if the checkpoint's class names differ from the data's"),
    Flag("--compile", action="store_true", help="torch.compile the model (the first batch "
         "compiles it; outputs as eager's)"),
    Flag("--channels-last", action="store_true",
         help="the model in the NHWC memory format (timm's flag)"),
)  # fmt: skip
PREDICT_FLAGS = (
    Flag("--img-size", type=int, help="default: the size it was trained at"),
    Flag("--topk", type=int, default=5, help="how many classes per image"),
    Flag("--compile", action="store_true", help="torch.compile the model (the first image "
         "compiles it; outputs as eager's)"),
)  # fmt: skip


def run_eval(args: argparse.Namespace) -> int:
    """Top-1/top-5, per-class accuracy (and ImageNet-ReaL) of a classifier on a test split,
    preprocessed as the model was trained (each step overridable with timm's flags)."""
    check_data(args, "a classifier", get_task("classification").datasets)
    check_predictions_path(args.predictions)
    import torch

    from lgvit.data.datasets import ImageSet, load_test_split
    from lgvit.data.loader import AugmentConfig
    from lgvit.data.protocol import skipped_in_pass
    from lgvit.data.stream import make_loader
    from lgvit.inference import load_model, resolve_preprocessing
    from lgvit.tasks.classification.evaluate import (
        RealLabels,
        TopKRecorder,
        evaluate,
        real_accuracy,
        write_predictions,
    )

    real = RealLabels(args.real_labels) if args.real_labels else None  # bad file: fail first
    model = load_model(args.checkpoint, args.device, args.model, args.img_size)
    if args.channels_last:  # convolutions then run NHWC whatever the batch's layout
        model = model.to(memory_format=torch.channels_last)
    run = _compiled(model) if args.compile else model
    on = EvalDevice(args, model)
    pre = resolve_preprocessing(model, crop_pct=args.crop_pct, interpolation=args.interpolation,
                                mean=args.mean, std=args.std)  # fmt: skip
    split = load_test_split(args.data, args.data_dir, img_size=pre.size,
                            cache_dir=args.cache_dir, class_map=args.class_map,
                            input_key=args.input_key, target_key=args.target_key,
                            split=args.split)  # fmt: skip
    if getattr(split, "classes_inferred", False) and len(split.classes) < model.num_classes:
        # 0..K-1 from the largest label the split holds (shards without an _info.json) only
        # bound the classes from below: a class no sample of it has is no mismatch.
        split.classes = [str(i) for i in range(model.num_classes)]
    _check_eval_classes(args, model, split.classes)
    names: list[str] = []  # only ReaL and the predictions file need them (shards: a scan)
    if (real or args.predictions) and isinstance(split, ImageSet):  # decoded: by position
        names = [f"{args.data}/test/{i}" for i in range(len(split))]
    elif real or args.predictions:  # read sample by sample: a path, a shard's key, a row
        names = [split.name(i) for i in range(len(split))]

    real_sets = real.for_images(names, model.num_classes) if real else None
    aug = AugmentConfig(img_size=pre.size, crop_pct=pre.crop_pct,
                        interpolation=pre.interpolation, mean=pre.mean, std=pre.std)  # fmt: skip
    # On the model's device: a GPU gets the uint8 batch and resizes and normalises it there.
    loader = make_loader(split, args.batch_size, num_classes=len(split.classes), train=False,
                         aug=aug, with_index=True, workers=args.workers,
                         device=on.device)  # fmt: skip
    if not args.json:
        print(f"preprocessing: {pre.describe()}", flush=True)
    recorder = TopKRecorder(k=5) if real or args.predictions else None  # per-image top-5
    res = evaluate(run, loader, len(split.classes), on.dist, on.amp, tta=args.tta,
                   on_batch=recorder)  # fmt: skip
    add_eval_keys(res, args, len(split), unreadable=len(split) - res["count"],
                  preprocessing=pre.to_dict(), classes=list(split.classes),
                  precision=on.precision)  # fmt: skip
    skipped = skipped_in_pass(loader)  # a split read sample by sample: the first left out
    if skipped is not None and skipped[0] and skipped[1]:
        res["left_out"] = skipped[1]
    if recorder is not None:
        idx, labels, top, probs = recorder.result()
        if real_sets is not None:
            res.update(real_accuracy(top, [real_sets[i] for i in idx.tolist()]))
        if args.predictions:
            names = [names[i] for i in idx.tolist()]
            write_predictions(args.predictions, names, labels, top, probs)
            res["predictions"] = str(args.predictions)
    return report_eval(args, res, lambda r: _print_eval(args, r))


def _check_eval_classes(args: argparse.Namespace, model: Any, classes: Sequence[str]) -> None:
    """The data's classes must be the head's (:func:`~lgvit.tasks.commands.check_classes`): as
    many, and (when the checkpoint names them) the same names in the same order."""
    n_data, n_head = len(classes), model.num_classes
    trained_on = model.pretrained_cfg.get("label_names")
    check_classes(
        args.any_classes, n_head, trained_on, classes,
        lambda: f"{args.checkpoint} has a {n_head}-class head but {args.data} has {n_data} "
        "classes; fine-tune it with `lgvit train`, evaluate on a dataset with the same classes, "
        "or give the class indices with --class-map",
        lambda: f"{args.checkpoint} was trained on classes {_preview(trained_on)} but "
        f"{args.data} has {_preview(classes)}; pass --any-classes to evaluate anyway (class i "
        "of the data is then class i of the model)",
    )  # fmt: skip


def _print_eval(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(f"{args.checkpoint} on {args.data} ({res['count']} test images)")
    if res["unreadable"]:  # the figures above are of the images scored only
        example = f", e.g. {res['left_out']}" if res.get("left_out") else ""
        print(f"  {res['unreadable']} of {res['images']} images left out (unreadable or "
              f"unlabelled){example}")  # fmt: skip
    if len(res["classes"]) <= 100:  # ImageNet's thousand rows are in --json
        for cls, acc in zip(res["classes"], res["per_class_acc"], strict=True):
            print(f"  {cls:20s} {acc:6.2f}%")
    print(f"top-1 {res['acc1']:.2f}%  top-5 {res['acc5']:.2f}%  loss {res['loss']:.4f}  "
          f"({res['precision']})")  # fmt: skip
    if "real_acc1" in res:
        print(f"ReaL top-1 {res['real_acc1']:.2f}%  top-5 {res['real_acc5']:.2f}%  "
              f"({res['real_count']} images with ReaL labels)")  # fmt: skip
    if "predictions" in res:
        print(f"predictions: {res['predictions']}")


def _compiled(model: Any) -> Any:
    """``torch.compile`` of the model, whole (every family compiles without a graph break)."""
    import torch

    return torch.compile(model)


def _preview(names: Sequence[str], n: int = 3) -> str:
    return "[" + ", ".join(list(names)[:n]) + (", ...]" if len(names) > n else "]")


def _label(classes: Sequence[str] | None, i: int) -> str:
    """Class ``i``'s name; a head wider than the named classes (``--num-classes`` above the
    data's) has unnamed outputs: ``class_12``."""
    if not classes:
        return str(i)
    return classes[i] if i < len(classes) else f"class_{i}"


def run_predict(args: argparse.Namespace) -> int:
    """The top-k classes of each image, with their probabilities."""
    import torch

    from lgvit.core.runtime import autocast
    from lgvit.inference import load_model, preprocess_images

    if args.topk < 1:
        raise LgvitError(f"--topk {args.topk}: must be at least 1")
    images = expand_images(args.images)
    model = load_model(args.checkpoint, args.device, args.model, args.img_size)
    run = _compiled(model) if args.compile else model
    device = next(model.parameters()).device
    classes = model.pretrained_cfg.get("label_names")  # the checkpoint's class names
    results, failed = [], []
    for path in images:
        try:
            x = preprocess_images(model, [path], device)  # LgvitError if unreadable
        except LgvitError as e:  # one bad file among good ones: say so (below), go on
            failed.append(str(e))
            continue
        with torch.no_grad(), autocast(device, PREDICT_AMP):
            probs = run(x.to(device)).float().softmax(-1)[0].cpu()
        top = probs.topk(min(args.topk, len(probs)))
        labels = [_label(classes, i) for i in top.indices.tolist()]
        results.append(
            {"image": path, "top": [[lbl, round(p, 4)] for lbl, p in
                                    zip(labels, top.values.tolist(), strict=True)]}
        )  # fmt: skip

    def line(r: dict[str, Any]) -> str:
        return f"{r['image']}: " + ", ".join(f"{lbl} {100 * p:.1f}%" for lbl, p in r["top"])

    return report_predictions(results, failed, args.json, line)
