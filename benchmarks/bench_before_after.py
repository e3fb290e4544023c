"""Models before and after a change: img/s and MFU of the same models from two lgvit checkouts,
timed alternately, round by round, each checkout in a process of its own (the same allocator
settings and threads), so machine noise hits both alike. Reports medians and the ratio
after/before (>1: the change is faster).

    git worktree add /tmp/lgvit_old <commit>
    python benchmarks/bench_before_after.py --baseline-src /tmp/lgvit_old/src \\
        --models deit_small swin_tiny lit_s --batch-size 64 --prec bf16 --rounds 5

MFU is the architecture's FLOPs/s (``measure.count_macs``, 3x for a training step) over the
fastest matmul this process measures at that precision (``measure.matmul_peak_flops``), as
``lgvit bench`` reports it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import ProcessRunner, add_device_flag, parse_device  # noqa: E402

import lgvit  # noqa: E402
from lgvit.tools.measure import count_macs, matmul_peak_flops  # noqa: E402

SRC = os.path.join(os.path.dirname(HERE), "src")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", required=True, help="the other checkout's src/ folder")
    ap.add_argument("--models", nargs="+", default=["deit_small", "swin_tiny", "lit_s"])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prec", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
    ap.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    add_device_flag(ap)
    args = ap.parse_args()
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    runners = {
        "before": ProcessRunner("harness:build_lgvit", (), args.threads,
                                pythonpath=args.baseline_src, device=args.device),
        "after": ProcessRunner("harness:build_lgvit", (), args.threads, pythonpath=SRC,
                               device=args.device),
    }  # fmt: skip
    bs = args.batch_size
    sizes, macs = {}, {}
    for name in args.models:
        model = lgvit.create_model(name)
        sizes[name] = tuple(model.pretrained_cfg["input_size"])
        macs[name] = count_macs(model, sizes[name])
        del model
    keys = [(impl, name, mode, prec, bs) for name in args.models for mode in args.modes
            for prec in args.prec for impl in runners]  # fmt: skip
    for k in keys:
        runners[k[0]].prepare(k, k[1], sizes[k[1]], k[2] == "train", k[3] == "bf16")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    peaks: dict[str, list[float]] = {p: [] for p in args.prec}
    times: dict[tuple, list[float]] = {k: [] for k in keys}
    for r in range(args.rounds):
        for p in args.prec:
            peaks[p].append(matmul_peak_flops(dtypes[p], device=device))
        for k in keys:
            times[k].append(runners[k[0]].time(k))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for runner in runners.values():
        runner.close()
    peak = {p: max(v) for p, v in peaks.items()}
    print(f"\nthreads {args.threads}, torch {torch.__version__}, batch {bs}, {args.rounds} rounds")
    print(f"{'model':22s} {'mode':5s} {'prec':4s} {'before':>8s} {'after':>8s} "
          f"{'MFU b':>6s} {'MFU a':>6s} {'after/before':>12s}")  # fmt: skip
    for name in args.models:
        for mode in args.modes:
            for p in args.prec:
                med = {i: statistics.median(times[(i, name, mode, p, bs)]) for i in runners}
                flops = 2 * macs[name] * bs * (3 if mode == "train" else 1)
                ips = {i: bs / t for i, t in med.items()}
                mfu = {i: flops / t / peak[p] for i, t in med.items()}
                print(f"{name:22s} {mode:5s} {p:4s} {ips['before']:8.1f} {ips['after']:8.1f} "
                      f"{mfu['before']:6.1%} {mfu['after']:6.1%} "
                      f"{med['before'] / med['after']:12.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
