"""Run timm's own ``tests/test_models.py`` against lgvit's models, through lgvit's registration.

    python benchmarks/run_timm_model_tests.py TIMM_CHECKOUT [--workdir DIR] [-k EXPR]

TIMM_CHECKOUT is a checkout (or an unpacked archive) of huggingface/pytorch-image-models; its
``tests/test_models.py`` is copied into a scratch folder (nothing of timm's enters this
repository) beside a ``conftest.py`` that does ``import lgvit`` -- the registration a user gets --
and keeps only the test items whose id names one of ``timm.list_models(module="lgvit")``.

One change is made to the copy, and printed: timm routes its models between
``test_model_default_cfgs`` (spatial ``forward_features`` maps) and
``test_model_default_cfgs_non_std`` (token outputs) by a list of name patterns (``vit_*``,
``deit*``, ``tnt_*``, ...), which names timm's own transformer families. lgvit's models whose
final features are tokens with a class token (``output_fmt == "NLC"``) are added to that list
for those two tests only, as timm adds each of its own token-output families; the features, fx
and backward tests run on every model unchanged. ``-k`` defaults to leaving out TorchScript
(deprecated in torch 2.14; lgvit exports through torch.export and ONNX).

Prints one row per timm test function (passed / failed / skipped) and each failure's message.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import torch

import lgvit

CONFTEST = """\
import re

import lgvit  # noqa: F401  (registers lgvit's models in timm's registry)
import timm

OURS = set(timm.list_models(module="lgvit"))


def pytest_collection_modifyitems(config, items):
    items[:] = [i for i in items if set(re.split(r"[\\[\\]-]", i.nodeid)) & OURS]
"""
# (what timm's file says, what the copy says): the name routing of the two default_cfgs tests
ROUTING = (
    ("exclude_filters=EXCLUDE_FILTERS + NON_STD_FILTERS, include_tags=True))",
     "exclude_filters=EXCLUDE_FILTERS + NON_STD_FILTERS + LGVIT_TOKEN_MODELS, include_tags=True))"),
    ("list_models(filter=NON_STD_FILTERS, exclude",
     "list_models(filter=NON_STD_FILTERS + LGVIT_TOKEN_MODELS, exclude"),
)  # fmt: skip
ANCHOR = "NUM_NON_STD = len(NON_STD_FILTERS)"


def token_output_models() -> list[str]:
    """lgvit's models whose final features are tokens (``output_fmt`` NLC), built on meta."""
    out = []
    for name in lgvit.list_models():
        with torch.device("meta"):
            model = lgvit.create_model(name)
        if getattr(model, "output_fmt", "NCHW") == "NLC":
            out.append(name)
    return out


def prepare(checkout: Path, workdir: Path) -> list[str]:
    """Copy timm's test file into ``workdir`` with the conftest and the routing change."""
    src = checkout / "tests" / "test_models.py"
    if not src.is_file():
        raise SystemExit(f"error: {src} not found (pass a checkout of pytorch-image-models)")
    text = src.read_text()
    tokens = token_output_models()
    for old, new in ROUTING:
        if text.count(old) != 1:
            raise SystemExit(
                f"error: {src}: the line `{old}` is not there once; timm's file changed"
            )
        text = text.replace(old, new)
    if text.count(ANCHOR) != 1:
        raise SystemExit(f"error: {src}: `{ANCHOR}` is not there once; timm's file changed")
    text = text.replace(ANCHOR, f"{ANCHOR}\nLGVIT_TOKEN_MODELS = {tokens!r}")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "test_models.py").write_text(text)
    (workdir / "conftest.py").write_text(CONFTEST)
    (workdir / "pytest.ini").write_text("[pytest]\naddopts =\n")
    return tokens


def summarise(junit: Path) -> int:
    """One row per test function; returns the number of failures."""
    counts: dict[str, Counter] = {}
    failures = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        func = case.get("name", "").split("[")[0]
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        state = (
            "failed"
            if bad is not None
            else "skipped"
            if case.find("skipped") is not None
            else "passed"
        )
        counts.setdefault(func, Counter())[state] += 1
        if bad is not None:
            failures.append(
                f"{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:200]}"
            )
    total = Counter()
    print("| test (timm's) | passed | failed | skipped |\n| --- | --- | --- | --- |")
    for func, c in counts.items():
        total += c
        print(f"| {func} | {c['passed']} | {c['failed']} | {c['skipped']} |")
    print(f"| total | {total['passed']} | {total['failed']} | {total['skipped']} |")
    for line in failures:
        print("FAILED", line)
    return total["failed"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path, help="a checkout of huggingface/pytorch-image-models")
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one)")
    p.add_argument("-k", default="not torchscript", help="pytest -k expression")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="timm_tests_"))
    tokens = prepare(args.checkout, workdir)
    print(
        f"timm tests in {workdir}; routed to test_model_default_cfgs_non_std: {', '.join(tokens)}"
    )
    junit = workdir / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "test_models.py", "-q", "-p", "no:cacheprovider",
           "-k", args.k, f"--junitxml={junit}"]  # fmt: skip
    subprocess.run(cmd, cwd=workdir, check=False)
    failed = summarise(junit)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
