"""Semantic FPN with each LIT Table 7 backbone at 512x512: params, MACs, inference and training
img/s, peak memory, beside the paper's params and mIoU.

    python benchmarks/bench_semfpn.py [--backbones lit_ti lit_s pvt_small swin_tiny lsa_small_224]
                                      [--size 512] [--batch 2] [--steps 3] [--amp none|bf16]

Every backbone runs alone in a fresh spawned process (peak RSS is that process's, counted from
just before its first training step; on CUDA: allocated memory); times are medians of
``--steps`` rounds after warm-up, timed as ``lgvit.tools.measure.time_fn`` times on the device.
Training step: forward, per-pixel cross-entropy (255 ignored), backward, the optimizer
``lgvit train`` builds. ``--device cuda`` runs on the GPU.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from harness import add_device_flag, parse_device, time_infer_train

from lgvit.tools.measure import (
    count_macs_of,
    describe_machine,
    run_in_fresh_process,
)

# LIT's Table 7 (Semantic FPN on ADE20K): params (M) and mIoU (%).
PAPER = {"pvt_small": (28, 39.8), "lit_ti": (24, 41.3), "swin_tiny": (32, 41.5),
         "lit_s": (32, 41.7)}  # fmt: skip


def measure(
    name: str, size: int, batch: int, steps: int, amp: str, threads: int, device: str = "cpu"
) -> dict:
    from lgvit.dense.semfpn import create_segmenter

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = create_segmenter(name, 150, img_size=size)
    params = sum(p.numel() for p in meta.parameters())
    macs = count_macs_of(lambda: meta.eval()(torch.zeros(1, 3, size, size, device="meta")))
    model = create_segmenter(name, 150, img_size=size).to(device)
    bf16 = amp == "bf16"
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 150, (batch, size, size), device=device)

    t_inf, t_train, peak_gb = time_infer_train(
        model, lambda: model(x), lambda: F.cross_entropy(model(x).float(), y, ignore_index=255),
        steps, bf16, device,
    )  # fmt: skip
    return {
        "backbone": name, "params_m": params / 1e6, "gmacs": macs / 1e9,
        "infer_img_s": batch / t_inf, "train_img_s": batch / t_train,
        "peak_train_gb": peak_gb,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ["lit_ti", "lit_s", "pvt_small", "swin_tiny", "lsa_small_224"]
    p.add_argument("--backbones", nargs="+", default=default)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_device_flag(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    device = parse_device(args.device)
    rows = [
        run_in_fresh_process(
            measure, (n, args.size, args.batch, args.steps, args.amp, args.threads, args.device)
        )
        for n in args.backbones
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"Semantic FPN, 150 classes, {args.size}x{args.size}, batch {args.batch}, "
          f"amp {args.amp}, {args.threads} threads; {describe_machine(device)}")  # fmt: skip
    print("| backbone | params (M) | paper params (M) | GMACs | inference img/s | "
          "training img/s | peak memory, training (GB) | paper mIoU |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        pp, miou = PAPER.get(r["backbone"], ("-", "-"))
        print(f"| {r['backbone']} | {r['params_m']:.2f} | {pp} | {r['gmacs']:.1f} | "
              f"{r['infer_img_s']:.2f} | {r['train_img_s']:.2f} | {r['peak_train_gb']:.2f} | "
              f"{miou} |")  # fmt: skip


if __name__ == "__main__":
    main()
