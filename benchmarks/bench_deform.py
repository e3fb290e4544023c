"""Deformable convolution at LIT-Ti's shapes: torchvision's kernel against lgvit's pure path.

    python benchmarks/bench_deform.py [--batch 32] [--rounds 5]

LIT-Ti merges tokens three times (deformable 2x2 stride-2 convolutions): 56x56x64 -> 128,
28x28x128 -> 320, 14x14x320 -> 512. For each shape, precision (fp32; bf16 autocast too) and
direction (forward without gradients; forward + backward), ``deform_conv2d`` runs with
``use_torchvision=True`` (``torchvision.ops.deform_conv2d``) and ``False`` (one ``grid_sample``
plus a stride-k convolution), on the tokens' channels-last map exactly as
``DeformableTokenMerging`` hands it over, with offsets of a trained model's size (a few pixels).
The two alternate round by round in one process; the table gives medians (ms) and pure /
torchvision (above 1: torchvision is faster). ``--device cuda`` runs both on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import add_device_flag, alternate_fns, parse_device  # noqa: E402

from lgvit.core.runtime import cpu_bf16_support, tune_cpu_allocator  # noqa: E402
from lgvit.models.layers.deform import deform_conv2d  # noqa: E402
from lgvit.tools.measure import describe_machine  # noqa: E402

# (map side, in channels, out channels) of LIT-Ti's three merges.
LIT_TI_MERGES = ((56, 64, 128), (28, 128, 320), (14, 320, 512))


def _inputs(
    batch: int, side: int, cin: int, cout: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(batch, side * side, cin, generator=g).to(device)
    x = tokens.view(batch, side, side, cin).permute(0, 3, 1, 2)  # DTM's channels-last view
    offset = 1.5 * torch.randn(batch, 8, side // 2, side // 2, generator=g).to(device)
    weight = (torch.randn(cout, cin, 2, 2, generator=g) / (4 * cin) ** 0.5).to(device)
    bias = torch.zeros(cout, device=device)
    return x, offset, weight, bias


def _step(inputs: tuple[torch.Tensor, ...], tv: bool, backward: bool, bf16: bool):  # noqa: ANN202
    x, offset, weight, bias = (t.detach().requires_grad_(backward) for t in inputs)

    def run() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            with torch.set_grad_enabled(backward):
                y = deform_conv2d(x, offset, weight, bias, 2, 0, use_torchvision=tv)
        if backward:
            y.float().sum().backward()

    return run


def measure(
    batch: int, rounds: int, precisions: list[str], device: torch.device | str = "cpu"
) -> list[dict]:
    device = torch.device(device)
    rows = []
    for side, cin, cout in LIT_TI_MERGES:
        inputs = _inputs(batch, side, cin, cout, device)
        for prec in precisions:
            for backward in (False, True):
                steps = {
                    impl: _step(inputs, impl == "torchvision", backward, prec == "bf16")
                    for impl in ("pure", "torchvision")
                }
                ms = alternate_fns(steps, rounds, device)
                rows.append(
                    dict(
                        shape=f"{side}x{side}x{cin}->{cout}",
                        precision=prec,
                        direction="fwd+bwd" if backward else "forward",
                        pure_ms=ms["pure"],
                        torchvision_ms=ms["torchvision"],
                        pure_over_tv=ms["pure"] / ms["torchvision"],
                    )
                )
                r = rows[-1]
                print(
                    f"| {r['shape']} | {prec} | {r['direction']} | {r['pure_ms']:.1f} | "
                    f"{r['torchvision_ms']:.1f} | {r['pure_over_tv']:.2f} |",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--bf16", choices=("auto", "yes", "no"), default="auto",
        help="also time bf16 autocast (auto: where the CPU has native bf16)",
    )  # fmt: skip
    add_device_flag(ap)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    native = cpu_bf16_support() if device.type == "cpu" else torch.cuda.is_bf16_supported()
    bf16 = args.bf16 == "yes" or (args.bf16 == "auto" and bool(native))
    precisions = ["fp32", "bf16"] if bf16 else ["fp32"]
    print(f"{describe_machine(device)}; native bf16: {native or 'none'}; batch {args.batch}, "
          f"{args.rounds} alternating rounds (median ms)")  # fmt: skip
    print("| merge | precision | direction | pure (ms) | torchvision (ms) | pure / torchvision |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = measure(args.batch, args.rounds, precisions, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=describe_machine(device), device=str(device),
                           native_bf16=native, rows=rows), f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
