"""The ``lgvit`` command line: ``info`` (and, with the training issue, ``train``/``eval``/...).

Every user error ends as one readable line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lgvit.errors import LgvitError


def _fmt(v: object, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def cmd_info(args: argparse.Namespace) -> int:
    from lgvit.measure import model_info
    from lgvit.models import is_model, list_models

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
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = (
        f"{'model':28s} {'input':>6s} {'params(M)':>9s} {'paper':>7s} {'MACs(G)':>8s} "
        f"{'paper':>6s} {'paper top-1':>12s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        p = r["paper"]
        top1 = p.get("cifar10_top1") or p.get("imagenet_top1")
        where = "C10" if p.get("cifar10_top1") else "IN1k" if top1 else ""
        print(
            f"{r['name']:28s} {r['input_size'][1]:>4d}px {r['params_m']:9.2f} "
            f"{_fmt(p.get('params_m')):>7s} {r['macs_g']:8.2f} {_fmt(p.get('macs_g')):>6s} "
            f"{(_fmt(top1) + ' ' + where) if top1 else '-':>12s}"
        )
    print(
        "MACs: FlopCounterMode total / 2 (matmuls, convs, attention) at the default input size,\n"
        "batch 1. The paper's ImageNet FLOPs count only one of the T embedding convs, so they\n"
        "undercount (SPEC.md section 1)."
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lgvit", description="Locality-enhanced vision transformers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="params and MACs of registered models, beside the paper's")
    p.add_argument("names", nargs="*", help="model names or wildcards (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LgvitError as e:
        print(f"lgvit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lgvit {args.command}: interrupted", file=sys.stderr)
        return 130
