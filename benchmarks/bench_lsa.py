"""Speed of lsa_tiny_cifar: inference and training step, fp32 and bf16, ours vs the authors'.

Prints a table of img/s, MFU (the architecture's FLOPs/s over a bf16 or fp32 matmul peak measured
in the same run: the fastest 2048^3 matmul of every round) and GEMM utilisation (the FLOPs each
implementation's matmuls and convolutions execute, counted by torch's FlopCounterMode, over the
same peak). Configurations are timed alternately, round by round, so machine noise hits all of
them alike; the table reports per-configuration medians and the speed-up ratios. Against the
authors' code it also prints the ceiling: the img/s our executed FLOPs would reach at the
matmul peak, as a multiple of theirs -- no kernel work on this machine can beat that ratio.

    python benchmarks/bench_lsa.py                      # ours only
    python benchmarks/bench_lsa.py --authors-repo /tmp/Locally-SAG-Transformer --one-process
    python benchmarks/bench_lsa.py --authors-repo /tmp/Locally-SAG-Transformer   # as users run
    python benchmarks/bench_lsa.py --baseline-src /tmp/lgvit_old/src   # before/after a change

``--authors-repo`` points to a checkout of github.com/shellysheynin/Locally-SAG-Transformer
(it needs ``pip install einops``); their ``cifar/cifar_model.py`` model is built with the
configuration of their ``main_tiny_cifar.py``. Nothing of theirs is part of lgvit. With
``--one-process`` their model runs in this process beside ours, alternating: the same
allocator (the one ``lgvit.create_model`` tunes), threads and precision, so the ratio is the
implementations' own (equal footing); without it, in a process of its own with the default
allocator, as their scripts run.
``--baseline-src`` points to the ``src`` folder of another lgvit checkout (``git worktree add
/tmp/lgvit_old <commit>``): the same model from that code runs in the second process, so a
change is measured against what came before it, alternating in one run.
``--device cuda`` runs every configuration on the GPU (default: the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.nn as nn
from harness import ProcessRunner, add_device_flag, make_step, parse_device

import lgvit
from lgvit.core.runtime import tune_cpu_allocator
from lgvit.tools.measure import count_macs, count_params, matmul_peak_flops, timed, warm_up


def build_authors_model(repo: str) -> nn.Module:  # runs in the authors' worker process
    """Their tiny CIFAR model, configured as in their main_tiny_cifar.py."""
    sys.path.insert(0, repo)
    try:
        from cifar.cifar_model import ShiftingTransformer  # type: ignore[import-not-found]
    except ImportError as e:
        sys.exit(f"bench_lsa: cannot import the authors' model from {repo}: {e}")
    out = tempfile.mkdtemp(prefix="lsa_authors_")
    with contextlib.redirect_stdout(None):  # their constructor prints the pyramid
        return ShiftingTransformer(
            scaling_factor=4,
            output_dir=out,
            num_variants=18,
            image_size=32,
            patch_size=1,
            embedding_dim=((192, 192),) * 4,
            heads=4,  # their script's value; the paper's is 3
            num_hierarchies=4,
            num_layers_per_block=(2, 4, 4, 4),
            num_classes=10,
            init_patch_embed_size=1,
            kernel_size=3,
            stride_size=1,
            padding_size=1,
        )


class LocalRunner:
    """Times step functions in this process, on ``device`` (``measure.warm_up`` / ``timed``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: dict[tuple, Callable[[], None]] = {}
        self.calls: dict[tuple, int] = {}

    def prepare(
        self, key: tuple, model: nn.Module, batch: int, train: bool, bf16: bool, fused: bool = True
    ) -> None:
        amp = torch.bfloat16 if bf16 else None  # fused: lgvit's AdamW (their scripts: plain)
        self.steps[key] = make_step(model, (3, 32, 32), batch, train, amp, fused, self.device)
        # warm-up (allocations, oneDNN kernel selection; on CUDA until stable)
        self.calls[key] = warm_up(self.steps[key], self.device)[1]

    def time(self, key: tuple) -> float:
        return timed(self.steps[key], self.device, self.calls[key])


def build_authors(name: str, repo: str) -> nn.Module:  # runs in the authors' process
    return build_authors_model(repo)


def executed_macs(model: nn.Module, batch: int, train: bool, device: torch.device) -> float:
    """Multiply-accumulates per image that ``model``'s matmuls and convolutions execute in one
    forward (``train``: forward and backward) at ``batch``: what a matmul roofline counts."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(batch, 3, 32, 32, device=device)
    model.train(train)
    with FlopCounterMode(display=False) as counter:
        if train:
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2 / batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lsa_tiny_cifar")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (alternating)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--authors-repo", default=None)
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="the authors' model in this process (equal footing), not in its own",
    )
    ap.add_argument("--baseline-src", default=None, help="another lgvit checkout's src/ folder")
    ap.add_argument("--modes", nargs="+", default=["infer", "train"])
    add_device_flag(ap)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="do not apply lgvit.core.runtime.tune_cpu_allocator() to our process",
    )
    ap.add_argument(
        "--authors-tuned-malloc",
        action="store_true",
        help="apply the same allocator tuning to the authors' process",
    )
    args = ap.parse_args()
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    if not args.default_malloc:
        tune_cpu_allocator()  # lgvit's default runtime (lgvit.core.runtime), as `lgvit train` does
    else:  # create_model would tune it otherwise
        os.environ["LGVIT_DEFAULT_MALLOC"] = "1"
    ours = lgvit.create_model(args.model).to(device)
    macs = count_macs(ours, (3, 32, 32))
    authors = None
    if args.authors_repo and args.baseline_src:
        sys.exit("bench_lsa: give --authors-repo or --baseline-src, not both")
    other = "authors" if args.authors_repo else "baseline"
    theirs = build_authors_model(args.authors_repo) if args.one_process else None
    if theirs is not None:
        theirs = theirs.to(device)
        authors = LocalRunner(device)
    elif args.authors_repo:
        authors = ProcessRunner(
            "bench_lsa:build_authors", (args.authors_repo,), args.threads,
            tuned_malloc=args.authors_tuned_malloc, device=args.device, fused=False,
        )  # fmt: skip
    elif args.baseline_src:
        authors = ProcessRunner(
            "harness:build_lgvit", (), args.threads, pythonpath=args.baseline_src,
            tuned_malloc=not args.default_malloc, device=args.device,
        )  # fmt: skip
    other_tuned = (args.authors_tuned_malloc or (args.baseline_src and not args.default_malloc)
                   or (theirs is not None and not args.default_malloc))  # fmt: skip
    print(
        f"threads {args.threads}, torch {torch.__version__}, model {args.model}: "
        f"{count_params(ours) / 1e6:.2f}M params, {macs / 1e9:.2f} GMACs/img (ours); "
        f"allocator: lgvit {'default' if args.default_malloc else 'tuned'}"
        + (
            f", {other} {'tuned' if other_tuned else 'default'} "
            f"({count_params(theirs) / 1e6:.2f}M params, this process: equal footing)"
            if theirs is not None
            else f"({authors.params(args.model) / 1e6:.2f}M params, separate process)"
            if authors
            else ""
        )
    )

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    peaks = {p: matmul_peak_flops(d, device=device) for p, d in dtypes.items()}
    # What each implementation's matmuls and convolutions execute per image (theirs is built here
    # for the count when it runs in a process of its own).
    counted = {"lgvit": ours}
    if args.authors_repo:
        counted["authors"] = (
            theirs if theirs is not None else build_authors_model(args.authors_repo).to(device)
        )
    executed = {
        (impl, mode, bs): executed_macs(model, bs, mode == "train", device)
        for impl, model in counted.items()
        for mode in args.modes
        for bs in args.batch_sizes
    }
    counted.clear()

    impls = ["lgvit"] + ([other] if authors else [])
    configs = []
    for bs in args.batch_sizes:
        for mode in args.modes:
            for impl in impls:
                for prec in ("fp32", "bf16"):
                    configs.append((impl, mode, prec, bs))
    local = LocalRunner(device)
    for c in configs:
        impl, mode, prec, bs = c
        if impl == "lgvit":
            local.prepare(c, ours, bs, mode == "train", prec == "bf16")
        elif theirs is not None:
            authors.prepare(c, theirs, bs, mode == "train", prec == "bf16", fused=False)
        else:
            authors.prepare(c, args.model, (3, 32, 32), mode == "train", prec == "bf16")
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs:  # alternate: one timed run of every configuration per round
            times[c].append((local if c[0] == "lgvit" else authors).time(c))
        for p, d in dtypes.items():  # a peak: the best of every round's measurement
            peaks[p] = max(peaks[p], matmul_peak_flops(d, device=device))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    print(
        f"\nmatmul peak: bf16 {peaks['bf16'] / 1e12:.3f} TFLOP/s, fp32 "
        f"{peaks['fp32'] / 1e12:.3f} TFLOP/s (fastest 2048^3 mm of the run). Executed GMACs per "
        "image (matmuls and convolutions; architecture: "
        f"{macs / 1e9:.2f} forward, x3 for a training step):"
    )
    for (impl, mode, bs), m in executed.items():
        print(f"  {impl:8s} {mode:5s} batch {bs:3d}: {m / 1e9:.2f}")
    rows = []
    print()
    print(
        f"{'impl':8s} {'mode':5s} {'prec':4s} {'batch':>5s} {'img/s':>8s} {'MFU':>6s} {'GEMM':>6s}"
    )
    for c in configs:
        impl, mode, prec, bs = c
        sec = statistics.median(times[c])
        ips = bs / sec
        mfu = 2 * macs * (3 if mode == "train" else 1) * ips / peaks[prec]
        gemm = 2 * executed.get((impl, mode, bs), float("nan")) * ips / peaks[prec]
        rows.append(dict(impl=impl, mode=mode, prec=prec, batch=bs, img_s=ips, mfu=mfu, gemm=gemm))
        print(
            f"{impl:8s} {mode:5s} {prec:4s} {bs:5d} {ips:8.1f} {100 * mfu:5.1f}% {100 * gemm:5.1f}%"
        )
    if authors and other == "baseline":
        print(f"\nlgvit ({lgvit.__file__}) over the baseline ({args.baseline_src}), same setting:")
        for c in configs:
            if c[0] == "lgvit":
                b = (other, *c[1:])
                ratio = statistics.median(times[b]) / statistics.median(times[c])
                print(f"  {c[1]:5s} {c[2]:4s} batch {c[3]:3d}: {ratio:5.2f}x")
    elif authors:
        print("\nspeed-up of lgvit bf16 (our default) over the authors' fp32, same batch:")
        for bs in args.batch_sizes:
            for mode in args.modes:
                get = {
                    (r["impl"], r["prec"]): r["img_s"]
                    for r in rows
                    if r["batch"] == bs and r["mode"] == mode
                }
                ratio = {p: get["lgvit", p] / get["authors", p] for p in ("fp32", "bf16")}
                main_ratio = get["lgvit", "bf16"] / get["authors", "fp32"]
                print(
                    f"  {mode:5s} batch {bs:3d}: {main_ratio:5.1f}x   (fp32 vs fp32: "
                    f"{ratio['fp32']:4.1f}x; bf16 vs bf16: {ratio['bf16']:4.1f}x)"
                )
        print(
            "\nlgvit over the authors' code at equal precision, and its ceiling: our executed "
            "matmul FLOPs at the matmul peak (every other op free), over their measured img/s:"
        )
        for bs in args.batch_sizes:
            for mode in args.modes:
                for prec in ("fp32", "bf16"):
                    get = {
                        r["impl"]: r["img_s"]
                        for r in rows
                        if (r["batch"], r["mode"], r["prec"]) == (bs, mode, prec)
                    }
                    ceiling = peaks[prec] / (2 * executed["lgvit", mode, bs]) / get["authors"]
                    ratio = get["lgvit"] / get["authors"]
                    print(
                        f"  {mode:5s} {prec:4s} batch {bs:3d}: {ratio:4.2f}x, "
                        f"ceiling {ceiling:4.2f}x"
                    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"\npeak RSS: lgvit process {rss:.1f} GB"
        + (
            f", {other}'s process {authors.close():.1f} GB" if authors and theirs is None else ""
        )  # fmt: skip
        + " (all configurations of each together)"
    )
    if args.json:
        with open(args.json, "w") as f:
            executed_rows = [
                dict(impl=i, mode=m, batch=b, macs=v) for (i, m, b), v in executed.items()
            ]
            json.dump(dict(macs=macs, peaks=peaks, executed=executed_rows, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
