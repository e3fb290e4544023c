"""Library users get the CLI's speed with one call: ``lgvit.core.runtime.tune_cpu_allocator()``.

Runs a model the way a user's own script would (``create_model``, ``torch.autocast``, no lgvit
command line) in fresh processes, alternately without and with the call, and prints the median
img/s of each and their ratio. The call only changes glibc's malloc thresholds, so it must be
measured in separate processes (it cannot be undone inside one).

    python benchmarks/bench_allocator.py --model lsa_tiny_cifar --batch-sizes 32 64 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from lgvit.tools.measure import describe_machine, run_in_fresh_process, time_fn


def measure(model_name: str, batch: int, tuned: bool, train: bool, steps: int) -> float:
    """img/s of ``steps`` bf16 steps (after 2 warm-up steps) in this (fresh) process."""
    import lgvit
    from lgvit.core.runtime import tune_cpu_allocator

    if tuned:
        tune_cpu_allocator()
    else:  # create_model tunes it too (lgvit.models.registry) unless told not to
        os.environ["LGVIT_DEFAULT_MALLOC"] = "1"
    torch.manual_seed(0)
    model = lgvit.create_model(model_name)
    size = model.pretrained_cfg["input_size"]
    x = torch.randn(batch, *size)
    y = torch.randint(0, model.num_classes, (batch,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train(train)

    def step() -> None:
        if train:
            with torch.autocast("cpu", torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16):
                model(x)

    return batch / time_fn(step, warmup=2, repeats=steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lsa_tiny_cifar")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    print(describe_machine())
    print(f"{args.model}, bf16 autocast, median of {args.steps} steps per process, "
          f"{args.rounds} alternating rounds (median of rounds)")  # fmt: skip
    print("| step | batch | default malloc img/s | tune_cpu_allocator() img/s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for train in (False, True):
        for batch in args.batch_sizes:
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for tuned in (False, True):
                    job = (args.model, batch, tuned, train, args.steps)
                    runs[tuned].append(run_in_fresh_process(measure, job))
            a, b = statistics.median(runs[False]), statistics.median(runs[True])
            kind = "train" if train else "inference"
            print(f"| {kind} | {batch} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
