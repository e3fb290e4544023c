"""The ``lgvit`` command line: ``info``, ``configs``, ``train``, ``eval``, ``predict``, ``bench``,
``export``, ``viz``, ``plot`` and ``weights``; each ``cmd_*`` imports what it runs, lazily.

Every user error ends as one readable line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lgvit.checkpoints.kinds import DETECTORS
from lgvit.checkpoints.run_layout import WEIGHTS_SUFFIX, RunLayout
from lgvit.core.errors import LgvitError
from lgvit.core.runtime import AMP_MODES, COMPILE_MODES
from lgvit.data.device_decode import DECODE_DEVICES
from lgvit.data.sources import option_help
from lgvit.run.config import DEVICES, OPTIMIZERS, SCHEDULES, TrainConfig
from lgvit.task_table import ALL_DATASETS, DEFAULT_TASK, TASK_NAMES
from lgvit.tasks.dispatch import add_task_flags

# What --device takes in the commands that load a model (lgvit.inference.resolve_device).
DEVICE_FORMS = ("cpu", "cuda", "cuda:N")
EVAL_DEVICE_HELP = f"{', '.join(DEVICE_FORMS)} (default: CUDA if any)"  # eval's and predict's


def _fmt(v: object, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _one_of(names: Sequence[str]) -> str:
    """``a, b or c``: the names of a module's list, for a help text or a message."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def cmd_info(args: argparse.Namespace) -> int:
    from lgvit.models import is_model, list_models
    from lgvit.tools.measure import model_info

    names = args.names or list_models()
    for n in names:
        if not is_model(n):
            matches = list_models(n)  # allow wildcards: lgvit info 'lsa_tiny*'
            if not matches:
                raise LgvitError(f"unknown model {n!r}; `lgvit info` lists them all")
    expanded: list[str] = []
    for n in names:
        expanded += [n] if is_model(n) else list_models(n)
    rows = [model_info(n) for n in expanded]
    for r in rows:
        r["weights"] = _released_weights(r["name"])
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = (
        f"{'model':28s} {'input':>6s} {'params(M)':>9s} {'paper':>7s} {'MACs(G)':>8s} "
        f"{'paper':>6s} {'paper top-1':>12s}  {'weights':s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        p = r["paper"]
        top1 = p.get("cifar10_top1") or p.get("imagenet_top1")
        paper_params = p.get("params_m") or p.get("params_int_m")  # whole millions in some tables
        where = "C10" if p.get("cifar10_top1") else "IN1k" if top1 else ""
        print(
            f"{r['name']:28s} {r['input_size'][1]:>4d}px {r['params_m']:9.2f} "
            f"{_fmt(paper_params):>7s} {r['macs_g']:8.2f} {_fmt(p.get('macs_g')):>6s} "
            f"{(_fmt(top1) + ' ' + where) if top1 else '-':>12s}  "
            f"{' '.join(dict.fromkeys(t.split('_')[0] for t in r['weights'])) or '-'}"
        )
    print(
        "MACs: FlopCounterMode total / 2 (matmuls, convs, attention) at the default input size,\n"
        "batch 1. The LSA paper's ImageNet FLOPs count only one of the T embedding convs, so\n"
        "they undercount. weights: the authors' released weights (`lgvit weights list`)."
    )
    return 0


def _released_weights(name: str) -> list[str]:
    """The tags of ``name``'s released weights (``lgvit weights list``)."""
    from lgvit.models.weights import weights_of

    return [w.tag for w in weights_of(name)]


def cmd_weights(args: argparse.Namespace) -> int:
    from lgvit.tools.weights import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.scaling:
        from lgvit.tools.scaling import run_scaling

        for path in run_scaling(args.scaling, args.out or f"scaling_{args.scaling}", args.quick):
            print(path)
        return 0
    from lgvit.tools.bench import FORMATS, BenchOptions, format_result, run_bench

    if args.format not in FORMATS:
        raise LgvitError(f"--format {args.format!r}: choose {_one_of(FORMATS)}")
    opts = BenchOptions(
        device=args.device, amp=args.amp, batch_size=args.batch_size, img_size=args.img_size,
        train=args.train, compile=args.compile, rounds=args.rounds, memory=not args.no_memory,
        channels_last=args.channels_last, busy=not args.no_busy,
    )  # fmt: skip
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.quiet else None
    result = run_bench(args.names, opts, log=progress or (lambda msg: None))
    text = format_result(result, args.format)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lgvit.tools.export import export

    report = export(
        args.source, args.format, args.out, args.img_size, args.dynamic_batch,
        args.dynamic_size, args.opset, not args.no_check, args.images or (),
        log=(lambda m: print(m, file=sys.stderr)) if args.json else print, model_name=args.model,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from lgvit.run.config import load_config_with_explicit
    from lgvit.tasks.run import train

    cli = {
        "task": args.task, "model": args.model, "data": args.data, "data_dir": args.data_dir,
        "detector": args.detector,
        "img_size": args.img_size, "epochs": args.epochs, "iters": args.iters,
        "batch_size": args.batch_size,
        "out": args.out, "resume": args.resume, "amp": args.amp,
        "compile": args.compile, "seed": args.seed,
        "channels_last": True if args.channels_last else None,
        "ema": True if args.model_ema else None,
    }  # fmt: skip
    sets = list(args.set or [])
    for flag, (key, _, _) in TIMM_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is _OFF:  # "--aa none": the key set to null, like --set key=null
            sets.insert(0, f"{key}=null")
        elif value is not None:
            cli[key] = value
    # What this invocation set explicitly: on --resume it overrides the run's saved config.
    cfg, explicit = load_config_with_explicit(args.config, sets, **cli)
    metrics = train(cfg, explicit)
    if metrics.get("test_acc1") is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"final test top-1: {metrics['test_acc1']:.2f}%")
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    from fnmatch import fnmatch

    from lgvit.run.config import config_description, config_text, shipped_configs

    if args.show:  # the file itself, to copy and edit: lgvit configs --show NAME > my.yaml
        sys.stdout.write(config_text(args.show))
        return 0
    shipped = shipped_configs()
    names = [n for n in shipped if not args.names or any(fnmatch(n, w) for w in args.names)]
    if not names:
        raise LgvitError(f"no shipped config matches {' '.join(args.names)}; `lgvit configs` "
                         "lists them all")  # fmt: skip
    width = max(map(len, names))
    for n in names:
        print(f"{n:{width}s}  {config_description(shipped[n])}")
    # The hint goes to stderr: stdout stays one config per line for scripts.
    print("use one: lgvit train --config NAME; see one: lgvit configs --show NAME",
          file=sys.stderr)  # fmt: skip
    return 0


_OFF = object()  # a flag given as "none": the key is switched off


def _none_or(kind: type) -> Any:
    def parse(text: str) -> Any:
        return _OFF if text.lower() in ("none", "null", "off") else kind(text)

    return parse


# timm train.py's flag names -> config keys (type, help). --lr is the rate for a global batch
# of lr_base_batch, scaled to the real batch as DeiT does.
TIMM_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--lr": (
        "lr",
        float,
        f"learning rate for a global batch of {TrainConfig.lr_base_batch} (scaled linearly)",
    ),
    "--min-lr": ("min_lr", float, "lr the schedule decays to"),
    "--warmup-lr": ("warmup_lr", float, "lr the warm-up starts from"),
    "--weight-decay": ("weight_decay", float, "AdamW weight decay"),
    "--layer-decay": ("layer_decay", float, "layer-wise lr decay for fine-tuning (e.g. 0.75)"),
    "--warmup-epochs": ("warmup_epochs", float, "linear warm-up epochs"),
    "--drop-path": ("drop_path", float, "stochastic depth rate"),
    "--smoothing": ("label_smoothing", float, "label smoothing"),
    "--aa": ("rand_augment", _none_or(str), "RandAugment spec, e.g. rand-m9-mstd0.5-inc1, or none"),
    "--mixup": ("mixup", float, "mixup alpha (0: off)"),
    "--cutmix": ("cutmix", float, "cutmix alpha (0: off)"),
    "--reprob": ("reprob", float, "random erasing probability"),
    "--clip-grad": ("clip_grad", _none_or(float), "gradient-norm clip (none: off)"),
    "--opt": ("opt", str, " | ".join(OPTIMIZERS)),
    "--sched": ("sched", str, " | ".join(SCHEDULES)),
    "--momentum": ("momentum", float, "SGD momentum"),
    "--decay-epochs": ("decay_epochs", float, "step schedule: epochs between decays"),
    "--decay-rate": ("decay_rate", float, "step schedule: lr factor per decay"),
    "--model-ema-decay": ("ema_decay", float, "EMA decay per step"),
    "--workers": ("workers", int, "decoding processes (streamed folders, shards, datasets)"),
    "--decode-device": (
        "decode_device",
        str,
        f"{' | '.join(DECODE_DEVICES)}: streamed JPEGs decoded there",
    ),
    "--input-key": ("input_key", str, option_help("input_key", "image key(s) or column")),
    "--target-key": ("target_key", str, option_help("target_key", "label key or column")),
    "--train-split": ("train_split", str, option_help("train_split", "the split trained on")),
    "--val-split": ("val_split", str, option_help("val_split", "the split evaluated")),
    "--grad-accum-steps": ("grad_accum_steps", int, "micro-batches per optimizer step"),
    "--log-interval": ("log_every", int, "steps between progress lines"),
    "--device": ("device", str, " | ".join(DEVICES)),
    "--initial-checkpoint": ("initial_checkpoint", str, "start from these weights (fine-tune)"),
    "--num-classes": ("num_classes", int, "classes of the head (default: the dataset's)"),
    "--patch-size": ("patch_size", int, "patch size (model default otherwise)"),
}


def cmd_eval(args: argparse.Namespace) -> int:
    """The checkpoint's task evaluates it, with the flags that task reads (others refused)."""
    return _run_task_command(args, "eval")


def cmd_predict(args: argparse.Namespace) -> int:
    return _run_task_command(args, "predict")


def _run_task_command(args: argparse.Namespace, command: str) -> int:
    from lgvit.tasks.dispatch import CLI, apply_task_flags, task_of_checkpoint

    task = task_of_checkpoint(args)
    apply_task_flags(args, task, command)
    module = CLI[task.name]
    return module.run_eval(args) if command == "eval" else module.run_predict(args)


def cmd_plot(args: argparse.Namespace) -> int:
    from lgvit.tools.plot import plot_runs

    labels = args.labels.split(",") if args.labels else None
    print(plot_runs(args.run_dirs, args.out, labels))
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from lgvit.tools.average import average_files, sources

    if args.best is not None and args.best < 1:
        raise LgvitError(f"--best {args.best}: must be at least 1")
    files = sources(args.sources, args.best, ema=not args.no_ema)
    average_files(files, args.out)
    print(f"{args.out}: the mean of {len(files)} checkpoint(s): "
          + ", ".join(str(f) for f in files))  # fmt: skip
    return 0


def _pair(text: str) -> tuple[int, int]:
    try:
        y, x = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not Y,X (two integers)") from None
    return y, x


def cmd_viz(args: argparse.Namespace) -> int:
    from lgvit.tools.viz import visualize

    paths = visualize(args.checkpoint, args.images, args.what, args.out, args.per_head,
                      args.query, args.positions or (), args.device, args.model)  # fmt: skip
    for p in paths:
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lgvit", description="Locality-enhanced vision transformers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_info, _add_weights, _add_bench, _add_export, _add_train, _add_configs,
                _add_eval, _add_predict, _add_average, _add_plot, _add_viz):  # fmt: skip
        add(sub)
    return parser


def _add_info(sub: Any) -> None:
    p = sub.add_parser("info", help="params and MACs of registered models, beside the paper's")
    p.add_argument("names", nargs="*", help="model names or wildcards (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)


def _add_bench(sub: Any) -> None:
    from lgvit.tools.bench import AUTO, DEFAULT_BATCH, FORMATS, BenchOptions
    from lgvit.tools.bench import __doc__ as bench_doc
    from lgvit.tools.scaling import STUDY_NAMES

    p = sub.add_parser(
        "bench",
        help="params, MACs, throughput, MFU and memory of models, beside the papers' figures",
        description=bench_doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="*", help="model names or wildcards (default: all)")
    p.add_argument("--device", default=BenchOptions.device,
                   help=f"{_one_of(DEVICE_FORMS)} (default: {BenchOptions.device})")  # fmt: skip
    p.add_argument(
        "--amp",
        choices=AMP_MODES,
        default=BenchOptions.amp,
        help=f"precision: {BenchOptions.amp} = bf16 where the hardware has it (default)",
    )
    p.add_argument(
        "--batch-size",
        type=_batch_or_auto,
        default=DEFAULT_BATCH,
        help=f"default {DEFAULT_BATCH}, the LIT paper's throughput batch (the LSA and "
        f"LocalViT papers name none); {AUTO}: doubled from {DEFAULT_BATCH} until out of memory "
        "or under 5%% gain, the best beside the paper's",
    )
    p.add_argument("--img-size", type=int, help="input size (default: each model's own)")
    p.add_argument(
        "--train",
        action="store_true",
        help="also time a training step (forward, backward, AdamW) and its memory",
    )
    p.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES,
                   metavar="MODE", help="torch.compile every model, in MODE: "
                   f"{_one_of(COMPILE_MODES)} (default: default)")  # fmt: skip
    p.add_argument("--channels-last", action="store_true",
                   help="models and inputs in the NHWC memory format (timm's flag)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=BenchOptions.rounds,
                   help="alternating timed rounds (median)")  # fmt: skip
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    p.add_argument("--no-busy", action="store_true",
                   help="skip the profiler pass that measures how busy the device is")  # fmt: skip
    p.add_argument("--format", default=FORMATS[0], help=_one_of(FORMATS))
    p.add_argument("--out", help="write the table (or, with --scaling, CSV + PNG) here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--scaling",
        choices=STUDY_NAMES,
        help="instead of the table: a paper's complexity claim as a curve (CSV + PNG)",
    )
    p.add_argument("--quick", action="store_true", help="with --scaling: fewer, smaller points")
    p.set_defaults(func=cmd_bench)


def _batch_or_auto(text: str) -> int | str:
    """``--batch-size``: a count, or ``auto`` (the sweep)."""
    from lgvit.tools.bench import AUTO

    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor {AUTO}") from None


def _add_export(sub: Any) -> None:
    from lgvit.tools.export import FORMATS, SUFFIXES

    files = ", ".join(f"NAME{suffix}" for suffix in SUFFIXES.values() if suffix)
    folders = ", ".join(f for f, suffix in SUFFIXES.items() if not suffix)
    p = sub.add_parser(
        "export", help="ONNX, torch.export (.pt2) or the Hugging Face layout, parity-checked"
    )
    p.add_argument(
        "source",
        help=f"a checkpoint (runs/x/{RunLayout.BEST}, {WEIGHTS_SUFFIX}), local-dir:DIR, "
        "hf-hub:ORG/NAME, or a model name (random weights)",
    )
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--model", help="the architecture of a .pth state dict (e.g. lit_ti)")
    p.add_argument("--out", help=f"file ({files}) or folder ({folders}); default: the model name")
    p.add_argument("--img-size", type=int, help="default: the checkpoint's or the model's")
    p.add_argument("--dynamic-batch", action="store_true", help="any batch size")
    p.add_argument(
        "--dynamic-size",
        action="store_true",
        help="any input height/width the model can take (refused in one line where it cannot)",
    )
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip running the file against eager (max abs diff, latency)",
    )
    p.add_argument(
        "--images",
        nargs="+",
        help="check on these images, preprocessed as the model expects (default: random inputs)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_export)


def _add_train(sub: Any) -> None:
    from lgvit.run.config import config_help

    keys = "\n".join(f"  {k:20s} {d:24s} {m}" for k, d, m in config_help())
    p = sub.add_parser(
        "train",
        help="train a model with the papers' DeiT recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (YAML files, --set key=value; precedence: defaults < YAML < flags "
        f"< --set):\n  {'key':20s} {'default':24s} meaning\n{keys}",
    )
    p.add_argument("--task", choices=TASK_NAMES, help=f"default: {DEFAULT_TASK} (or the config's)")
    p.add_argument("--detector", choices=DETECTORS,
                   help=f"detection: default {TrainConfig.detector}")  # fmt: skip
    p.add_argument("--model", help=f"registered model name (default: {TrainConfig.model})")
    p.add_argument("--data", choices=ALL_DATASETS)
    p.add_argument("--data-dir", help="dataset archive or folder (no download needed)")
    p.add_argument("--img-size", type=int, help="input size (segmentation: the crop)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--iters", type=int, help="an iteration budget instead of --epochs")
    p.add_argument("--batch-size", type=int, help="per process")
    p.add_argument("--out", help=f"run directory (config, {RunLayout.METRICS}, checkpoints, log)")
    p.add_argument("--config", help="a shipped config's name (`lgvit configs` lists them) "
                   "or a YAML file of config keys")  # fmt: skip
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--resume", help="'auto' (the last checkpoint in --out) or a checkpoint")
    add_amp(p, None, "mixed precision")
    p.add_argument("--compile", nargs="?", const=COMPILE_MODES[0], choices=COMPILE_MODES,
                   metavar="MODE", help="torch.compile the model once, in MODE: "
                   f"{_one_of(COMPILE_MODES)} (bare: {COMPILE_MODES[0]}); a graph per input "
                   "size, each logged")  # fmt: skip
    p.add_argument("--channels-last", action="store_true",
                   help="model and batches in the NHWC memory format (timm's flag)")  # fmt: skip
    p.add_argument("--seed", type=int)
    p.add_argument("--model-ema", action="store_true", help="keep an EMA of the weights")
    for flag, (_, kind, text) in TIMM_FLAGS.items():
        names = [flag, "-j"] if flag == "--workers" else [flag]
        p.add_argument(*names, type=kind, help=text)
    p.set_defaults(func=cmd_train)


def add_amp(p: argparse.ArgumentParser, default: str | None, text: str) -> None:
    """``--amp`` as train and eval take it: a mode, or bare (timm's flag) for auto."""
    p.add_argument("--amp", choices=AMP_MODES, nargs="?", const="auto", default=default,
                   help=f"{text} (a bare --amp, timm's flag, means auto)")  # fmt: skip


def _add_configs(sub: Any) -> None:
    p = sub.add_parser(
        "configs",
        help="the shipped training configs, one line each (lgvit train --config NAME)",
        description="List the configs installed with lgvit: each name, for `lgvit train "
        "--config NAME`, with the first line of its comment.",
    )
    p.add_argument("names", nargs="*", help="names or wildcards (default: all)")
    p.add_argument("--show", metavar="NAME", help="print this config's YAML (to copy and edit)")
    p.set_defaults(func=cmd_configs)


def _add_eval(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help="a checkpoint on a test split: top-1/top-5 (and ReaL), mIoU, or COCO AP",
        description="Evaluate as the model was trained. The checkpoint says its task "
        "(classification, segmentation, detection; an authors' file by --data or --detector), "
        "and each task reads the flags marked with its name: another task's flag is refused. "
        "Classification: its input size, crop_pct, interpolation and mean/std (from the "
        "checkpoint, or the registered model's for a .pth), each overridable with timm's "
        "validate.py flags; an image folder is read from its files: val/ or test/, or a folder "
        "of class folders (ImageNet-V2).",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help=f"runs/x/{RunLayout.BEST}, a {WEIGHTS_SUFFIX} or .pth file, weights NAME.TAG, or a "
        "save_pretrained folder (DIR, DIR/model.safetensors, local-dir:DIR, hf-hub:ORG/NAME)",
    )
    p.add_argument("--model", help="default: the name stored in the checkpoint")
    p.add_argument("--data", required=True, choices=ALL_DATASETS)
    p.add_argument("--data-dir")
    # Full precision unless asked: the figure papers and timm's validate.py report, the same on
    # every machine (bf16 autocast moved a detector's AP50 from 21.48 to 18.39).
    add_amp(p, "none", "none: fp32 (default); auto: bf16 autocast where the device runs it "
            "fast; bf16; fp16 (CUDA)")  # fmt: skip
    p.add_argument("--device", default="auto", help=EVAL_DEVICE_HELP)
    p.add_argument("--json", action="store_true")
    add_task_flags(p, "eval")
    p.set_defaults(func=cmd_eval)


def _add_predict(sub: Any) -> None:
    p = sub.add_parser(
        "predict",
        help="a checkpoint on image files: top-k labels, masks, or boxes",
        description="Predict on image files (or the images in a directory) with the "
        "checkpoint's task: a classifier's top-k labels, a segmenter's masks, a detector's "
        "boxes. Each task reads the flags marked with its name: another task's flag is "
        "refused. An unreadable file is skipped with a line on stderr and the exit status is "
        "then 1.",
    )
    p.add_argument("--checkpoint", required=True, help="as eval's")
    p.add_argument("--model", help="default: the name stored in the checkpoint")
    p.add_argument("--device", default="auto", help=EVAL_DEVICE_HELP)
    p.add_argument("--json", action="store_true")
    add_task_flags(p, "predict")
    p.add_argument("images", nargs="+")
    p.set_defaults(func=cmd_predict)


def _add_average(sub: Any) -> None:
    from lgvit.tools.average import __doc__ as average_doc

    p = sub.add_parser(
        "average",
        help="average checkpoints' weights (a run's best kept epochs, or files), as timm's "
        "avg_checkpoints.py",
        description=average_doc.split("\n\n", 1)[1],
    )
    p.add_argument("sources", nargs="+", metavar="RUN_OR_FILE",
                   help="a run directory trained with keep_best, or checkpoint files or "
                   "save_pretrained folders (local-dir:DIR, hf-hub:ORG/NAME)")  # fmt: skip
    p.add_argument("--best", type=int, help="the N best kept epochs of the run (default: all)")
    p.add_argument("--no-ema", action="store_true",
                   help="the kept epochs' weights, not their EMA weights")  # fmt: skip
    p.add_argument("--out", required=True, help=f"the averaged {WEIGHTS_SUFFIX} file")
    p.set_defaults(func=cmd_average)


def _add_plot(sub: Any) -> None:
    from lgvit.tools.plot import DEFAULT_OUT, FORMATS

    p = sub.add_parser(
        "plot", help="training curves of runs, overlaid: top-1, top-5, training loss per epoch"
    )
    runs = f"run directories ({RunLayout.METRICS})"
    p.add_argument("run_dirs", nargs="+", metavar="RUN", help=runs)
    kinds = _one_of([f.lstrip(".").upper() for f in FORMATS])
    p.add_argument("--out", help=f"{kinds} (default: RUN/{DEFAULT_OUT}, or ./{DEFAULT_OUT})")
    p.add_argument("--labels", help="comma-separated legend names (default: directory names)")
    p.set_defaults(func=cmd_plot)


def _add_viz(sub: Any) -> None:
    from lgvit.tools.viz import KINDS

    p = sub.add_parser(
        "viz",
        help="what a model learned, on real images: LSA shift attention, LIT offsets, attention",
        description="Figures from a checkpoint (or a registered name, random weights) on images. "
        "lsa-shifts: each position's local attention over the shifted copies (LSA); "
        "dtm-offsets: where LIT's chained deformable token merges sample; attention: a query "
        "pixel's attention per head at the first and last block of every stage, averaged over "
        "the images, and the last stage's attention rollout.",
    )
    source = f"checkpoint (runs/x/{RunLayout.BEST}), local-dir:/hf-hub:, or a name"
    p.add_argument("checkpoint", help=source)
    p.add_argument("images", nargs="+")
    p.add_argument("--what", required=True, choices=KINDS)
    p.add_argument("--out", default="viz", help="output directory (default: viz)")
    p.add_argument("--per-head", action="store_true", help="lsa-shifts: also one figure per head")
    p.add_argument("--query", type=_pair, help="attention: query pixel Y,X (default: centre)")
    p.add_argument("--positions", type=_pair, nargs="+", metavar="Y,X",
                   help="dtm-offsets: output positions on the last merge's grid")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help="the architecture of a .pth state dict (e.g. lit_ti)")
    p.set_defaults(func=cmd_viz)


def _add_weights(sub: Any) -> None:
    p = sub.add_parser(
        "weights",
        help="the authors' released weights: list, download (once, cached), convert",
        description="Released weights by name (model.tag, timm's form): create_model(name, "
        "pretrained=True) and --checkpoint NAME.TAG download them once into the cache "
        "($LGVIT_WEIGHTS_DIR, else torch hub's checkpoints folder).",
    )
    ws = p.add_subparsers(dest="weights_command", required=True)
    q = ws.add_parser("list", help="every released file: task, reported accuracy, licence")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.add_argument("--cache-dir", help="weights cache (default: $LGVIT_WEIGHTS_DIR or torch's)")
    q = ws.add_parser("download", help="download and check weights; prints each file's path")
    q.add_argument("names", nargs="+", metavar="NAME[.TAG]",
                   help="lit_ti, lit_ti.coco_maskrcnn_authors, ...")  # fmt: skip
    q.add_argument("--cache-dir", help="weights cache (default: $LGVIT_WEIGHTS_DIR or torch's)")
    q = ws.add_parser("convert", help="to the hub layout: model.safetensors, config.json and a "
                      "README.md model card")  # fmt: skip
    q.add_argument("source", help="released weights (NAME.TAG) or a .pth file (with --model)")
    q.add_argument("--model", help="the architecture of a file (e.g. lit_ti)")
    q.add_argument("--out", required=True, help="the folder to write")
    p.set_defaults(func=cmd_weights)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        print(f"lgvit {args.command}: warning: {message}", file=sys.stderr)

    warnings.showwarning = one_line_warning  # warnings are one line too, without source lines
    if args.command in ("train", "eval", "predict", "bench", "export", "viz"):  # they run models
        from lgvit.core.runtime import tune_cpu_allocator

        tune_cpu_allocator()  # large activations reuse heap memory (see lgvit.core.runtime)
    try:
        return args.func(args)
    except LgvitError as e:
        code = getattr(e, "exit_code", 2)  # a preempted run: 128 + the signal, as a shell does
        print(f"lgvit {args.command}: {'error: ' if code == 2 else ''}{e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"lgvit {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a path that cannot be written or read: one line naming it
        where = f"{e.filename}: " if e.filename else ""
        print(f"lgvit {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
