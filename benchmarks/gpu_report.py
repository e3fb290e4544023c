"""The report of benchmarks/gpu_check.py: the goals (each with its measured figure and whether
it holds), then the parts, as markdown. Pure functions of the report's JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from gpu_bench import AUTHORS_BATCH, PAIRS

GPU_BATCH, GPU_BATCH_32 = 256, 1024  # the batch every model should train at on one GPU; 32 px
# Issue 56's goals: lgvit's own models' compiled MFU at least timm's deit_small's, the GPU busy
# this share of a compiled step, CIFAR-10 epochs within this of the synthetic step rate, this
# top-1 within these seconds of training, the GPU's JPEG decoding this many times lit_s's rate.
MFU_MODELS, MFU_PEER = ("lit_s", "lsa_small_224"), "deit_small"
BUSY_MIN, RATE_TOL, CIFAR_TOP1, CIFAR_SECONDS, DECODE_RATIO = 0.9, 0.05, 90.0, 150, 1.2
SYNTHETIC_STEP = "synthetic step rate"  # part e's item: the model's step alone


def goals(report: dict[str, Any]) -> list[dict[str, str]]:
    """Each goal of the check, its measured figure and whether it holds (``yes``, ``no``, or
    ``not measured`` where its part did not run or ran out of time before it)."""
    parts = report["parts"]
    items = {k: {i["item"]: i for i in e.get("items", [])} for k, e in parts.items()}
    rows = [*_goals_56(items.get("d", {}), items.get("e", {})),
            _goal_training(parts.get("a"), items.get("a", {})),
            _goal_agreement(parts.get("a"), items.get("a", {})),
            _goal_device_tests(parts.get("b"), items.get("b", {}))]  # fmt: skip
    for name in PAIRS:
        rows.append(_goal_timm(name, items.get("d", {})))
    rows.append(_goal_authors(items.get("d", {})))
    late = {k: e for k, e in parts.items() if e.get("status") == "timeout"}
    spent = [k for k, e in parts.items() if e.get("reason") == "the whole check's time is spent"]
    figure = ", ".join(f"{k} {e.get('seconds', '-')}/{e['budget_s']} s" for k, e in parts.items())
    rows.append(_goal("every part finishes within its budget", figure,
                      None if not parts else not late and not spent))  # fmt: skip
    return rows


def _goal(goal: str, measured: str, holds: bool | None) -> dict[str, str]:
    return {"goal": goal, "measured": measured or "-",
            "holds": "not measured" if holds is None else "yes" if holds else "no"}  # fmt: skip


def _goals_56(d: dict[str, dict], e: dict[str, dict]) -> list[dict[str, str]]:
    """Issue 56's goals, first: part d's compiled rows (at its compiled batch: the goals ask
    for the best batch, which d sweeps eager only) and part e's CIFAR-10 run."""
    rows = {n: (d.get(f"compiled {n}") or {}).get("rows") or [{}] for n in (*MFU_MODELS,
                                                                           MFU_PEER)}  # fmt: skip
    peer = next((r for r in rows[MFU_PEER] if str(r.get("model")).startswith("timm")), {})
    ours = {n: rows[n][0] for n in MFU_MODELS}

    def figure(key: str) -> tuple[str, list[float]]:
        got = [(n, r.get(f"train_{key}"), r.get("batch")) for n, r in ours.items()]
        text = ", ".join(f"{n} {v:.3f} at batch {b}" if v is not None else f"{n} not measured"
                         for n, v, b in got)  # fmt: skip
        return text, [v for _, v, _ in got if v is not None]

    mfu_text, mfu = figure("mfu")
    theirs = peer.get("train_mfu")
    mfu_text += f"; timm {MFU_PEER} {theirs:.3f}" if theirs is not None else ""
    busy_text, busy = figure("busy")
    both = len(MFU_MODELS)
    return [
        _goal(f"{' and '.join(MFU_MODELS)} compiled: training MFU at least timm's {MFU_PEER}'s "
              "(same run)", mfu_text, None if theirs is None or len(mfu) < both else
              all(v >= theirs for v in mfu)),
        _goal(f"the GPU busy at least {BUSY_MIN:.0%} of a compiled training step (profiler)",
              busy_text, None if len(busy) < both else all(v >= BUSY_MIN for v in busy)),
        _goal_cifar_rate(e),
        _goal_cifar_top1(e),
        _goal_decode(d),
    ]  # fmt: skip


def _goal_decode(d: dict[str, dict]) -> dict[str, str]:
    """Part d's decode item (the training loader's batches of 224-px crops, JPEGs decoded on
    the device) against lit_s's compiled training rate, measured before it in d."""
    goal = (f"224-px JPEGs decoded on the GPU at least {DECODE_RATIO}x lit_s's compiled training "
            "rate (all the machine's cores as workers)")  # fmt: skip
    item = d.get("decode 224-px JPEGs") or {}
    rate = item.get("device_img_s")
    train = ((d.get("compiled lit_s") or {}).get("rows") or [{}])[0].get("train_img_s")
    if rate is None:
        return _goal(goal, item.get("error", ""), None)
    text = (f"{rate:.0f} img/s decoded on {item['decode_device']} ({item['workers']} workers; "
            f"PIL in the workers {item['pil_img_s']:.0f})")  # fmt: skip
    if not train:
        return _goal(goal, f"{text}; lit_s not measured", None)
    return _goal(goal, f"{text} / lit_s {train:.0f} = {rate / train:.2f}x",
                 rate / train >= DECODE_RATIO)  # fmt: skip


def _cifar_run(e: dict[str, dict]) -> list[dict]:
    run = next((i for k, i in e.items() if k.startswith("lgvit train")), {})
    return run.get("epochs") or []


def _goal_cifar_rate(e: dict[str, dict]) -> dict[str, str]:
    """The full-size epochs' rate (the first at that size left out: it warms up) against the
    model's step alone on synthetic data, at the same batch and precision."""
    goal = (f"lsa_tiny_cifar: the CIFAR-10 epoch rate within {RATE_TOL:.0%} of its step rate on "
            "synthetic data")  # fmt: skip
    step = (e.get(SYNTHETIC_STEP) or {}).get("img_s")
    full = [r["img_per_s"] for r in _cifar_run(e) if r.get("img_per_s")
            and r.get("train_size") in (None, 32)]  # fmt: skip
    if not step or not full:
        return _goal(goal, f"synthetic {step or '-'} img/s, no epoch at 32 px", None)
    settled = sorted(full[1:] or full)
    rate = settled[len(settled) // 2]  # the median
    ratio = rate / step
    return _goal(goal, f"{rate:.0f} / {step:.0f} img/s = {ratio:.3f}", ratio >= 1 - RATE_TOL)


def _goal_cifar_top1(e: dict[str, dict]) -> dict[str, str]:
    """The first test at or past the goal's top-1, within the seconds (the epochs' own time:
    training, tests and saves; the data's loading before the first epoch not counted)."""
    goal = f"lsa_tiny_cifar on CIFAR-10: at least {CIFAR_TOP1:.0f}% top-1 within {CIFAR_SECONDS} s"
    rows, spent = _cifar_run(e), 0.0
    if not rows:
        return _goal(goal, "", None)
    for r in rows:
        spent += r.get("epoch_time_s") or 0.0
        if (r.get("test_acc1") or 0) >= CIFAR_TOP1:
            return _goal(goal, f"{r['test_acc1']:.2f}% after {spent:.0f} s (epoch "
                               f"{r['epoch'] + 1})", spent <= CIFAR_SECONDS)  # fmt: skip
    best = max((r.get("test_acc1") or 0 for r in rows), default=0)
    return _goal(goal, f"best {best:.2f}% in {spent:.0f} s ({len(rows)} epochs)", False)


def _goal_training(part: dict | None, items: dict[str, dict]) -> dict[str, str]:
    goal = (f"every registered model trains at batch {GPU_BATCH} ({GPU_BATCH_32} at 32 px) "
            "on CUDA without an error")  # fmt: skip
    last: dict[str, dict] = {}
    for name, item in items.items():  # a model's last try counts
        if name.startswith("bf16 step "):
            last[name.removeprefix("bf16 step ").removesuffix(", again")] = item
    if not last:
        return _goal(goal, "", None)
    misses = [f"{m}: {i.get('error', 'failed')}" + (f", trains at {i['trains_at']}" if
              i.get("trains_at") else "") for m, i in last.items() if not i.get("ok")]  # fmt: skip
    total = (part or {}).get("models", len(last))
    figure = f"{len(last) - len(misses)}/{total} models" + (f" ({'; '.join(misses)})" if misses
                                                            else "")  # fmt: skip
    return _goal(goal, figure, None if len(last) < total and not misses else not misses)


def _goal_agreement(part: dict | None, items: dict[str, dict]) -> dict[str, str]:
    goal = "part a passes for every family (IEEE fp32 by the gradient rule, bf16 close)"
    found = {k: i for k, i in items.items() if k.startswith("fp32 ")}
    if not found:
        return _goal(goal, "", None)
    worst = max(found.values(), key=lambda i: i.get("fp32_grad_worst_err", math.inf))
    figure = f"{sum(i['ok'] for i in found.values())}/{len(found)} families; worst gradient " \
        f"{worst.get('fp32_grad_worst_err', '-'):.2g} ({worst['item'][5:]} " \
        f"{worst.get('worst_grad', worst.get('error', ''))})"  # fmt: skip
    complete = len(found) == (part or {}).get("families", len(found))
    ok = all(i["ok"] for i in found.values())
    return _goal(goal, figure, None if ok and not complete else ok)


def _goal_device_tests(part: dict | None, items: dict[str, dict]) -> dict[str, str]:
    runs = [i for k, i in items.items() if "pytest" in k]
    if not runs:
        return _goal("the device tests pass", "", None)
    counts = Counter()
    for i in runs:
        counts.update({k: i[k] for k in ("passed", "failed", "skipped", "error", "errors",
                                         "collected") if isinstance(i.get(k), int)})  # fmt: skip
    figure = ", ".join(f"{n} {k}" for k, n in counts.items())
    complete = len(runs) == (part or {}).get("selections", len(runs))
    ok = all(i["ok"] for i in runs)
    return _goal("the device tests pass", figure, None if ok and not complete else ok)


def _goal_timm(name: str, items: dict[str, dict]) -> dict[str, str]:
    goal = f"{name}: lgvit / timm at least 1.0x, inference and training, eager and compiled"
    figures, ratios = [], []
    for how in ("eager", "compiled"):
        item = items.get(f"{how} {name}")
        if item is None or "infer_ratio" not in item:
            figures.append(f"{how}: not measured")
            continue
        pair = [item.get("infer_ratio"), item.get("train_ratio")]
        ratios += pair
        figures.append(f"{how} " + " / ".join("-" if r is None else f"{r:.2f}x" for r in pair))
    measured = len(ratios) == 4 and None not in ratios
    holds = all(r >= 1.0 for r in ratios) if measured else None
    if ratios and None not in ratios and any(r < 1.0 for r in ratios):
        holds = False
    return _goal(goal, "; ".join(figures) + " (infer / train)", holds)


def _goal_authors(items: dict[str, dict]) -> dict[str, str]:
    goal = (f"lsa_tiny_cifar / the LSA authors' model at batch {AUTHORS_BATCH}: at least 3x "
            "inference, 2x training")  # fmt: skip
    item = next((i for k, i in items.items() if k.startswith("lsa_tiny_cifar beside")), None)
    if item is None or item.get("infer_ratio") is None or item.get("train_ratio") is None:
        why = item.get("error", "") if item else "no --authors-lsa DIR given, or out of time"
        return _goal(goal, why, None)
    r = item["infer_ratio"], item["train_ratio"]
    return _goal(goal, f"{r[0]:.2f}x / {r[1]:.2f}x", r[0] >= 3 and r[1] >= 2)


# -------------------------------------------------------------------------------- the report


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: the goals, a status line per part, then each item's figures."""
    lines = [f"# GPU check: {report['machine']}", "", f"`{report['command']}`", ""]
    if report["smoke"]:
        lines += ["--smoke: tiny sizes on the CPU; the figures prove the check's code, they do "
                  "not measure the goals.", ""]  # fmt: skip
    lines += ["| goal | measured | holds |", "| --- | --- | --- |"]
    for g in report.get("goals", []):
        lines.append(f"| {g['goal']} | {g['measured'].replace('|', '/')} | {g['holds']} |")
    lines += ["", "| part | status | started at s | seconds | budget | |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    shown = {**report["parts"], **({"w": report["warm"]} if "warm" in report else {})}
    for key, e in shown.items():
        cells = (f"{key}. {e['title']}", e["status"], e.get("started_s", ""),
                 e.get("seconds", ""), e["budget_s"], e.get("reason", ""))  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for key, e in shown.items():
        lines += ["", f"## {key}. {e['title']}", ""]
        for note in e.get("notes", []):
            lines.append(f"- {note}")
        for item in e.get("items", []):
            lines.append(f"- **{item['item']}**: {json.dumps(_brief(item), default=str)}")
            if item.get("rows"):
                lines += ["", *_table(item["rows"]), ""]
    return "\n".join(lines) + "\n"


def _brief(item: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in item.items()
            if k not in ("item", "rows") and (k != "tail" or v)}  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return out
