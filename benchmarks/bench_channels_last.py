"""``--channels-last`` (NHWC) against the default layout, alternately in one process.

For each model: two copies with the same weights, one converted to ``torch.channels_last``
with NHWC inputs, timed alternately (NCHW, NHWC, NCHW, ...) for ``--rounds`` rounds after
warm-up, as the training step (``lgvit.tools.measure.make_step``: forward, cross-entropy,
backward, fused AdamW) and as inference; prints the median img/s of each and their ratio.

    python benchmarks/bench_channels_last.py --models localvit_tiny lit_ti lsa_tiny_224 \\
        --batch-size 16 --rounds 5 --amp auto
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import lgvit
from lgvit.core.runtime import resolve_amp, tune_cpu_allocator
from lgvit.tools.measure import describe_machine, make_step, step_timing, timed, warm_up


def measure(
    name: str, batch: int, train: bool, amp: torch.dtype | None, rounds: int, device: str
) -> tuple:
    """Median img/s of the NCHW and the NHWC model, timed alternately."""
    torch.manual_seed(0)
    plain = lgvit.create_model(name).to(device)
    nhwc = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    size = tuple(plain.pretrained_cfg["input_size"])
    steps = [make_step(m, size, batch, train, amp, device=device, channels_last=m is nhwc)
             for m in (plain, nhwc)]  # fmt: skip
    calls = [warm_up(step, device, step_timing(device))[1] for step in steps]
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i].append(timed(step, device, calls[i]))
    return tuple(batch / statistics.median(t) for t in times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["localvit_tiny", "lit_ti", "lsa_tiny_224"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--amp", default="auto", help="auto | bf16 | fp16 | none")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    args = p.parse_args()
    tune_cpu_allocator()
    amp = resolve_amp(args.amp, torch.device(args.device))
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp]
    print(f"{describe_machine(args.device)}; {torch.get_num_threads()} threads; {precision}; "
          f"batch {args.batch_size}; median of {args.rounds} alternating rounds")  # fmt: skip
    print("| model | step | NCHW img/s | NHWC img/s | NHWC / NCHW |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.models:
        for train in (False, True):
            a, b = measure(name, args.batch_size, train, amp, args.rounds, args.device)
            kind = "train" if train else "infer"
            print(f"| {name} | {kind} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
