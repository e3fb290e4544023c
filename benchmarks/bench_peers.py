"""lgvit against timm on the models both have: inference and training step (forward,
cross-entropy, backward, AdamW), alternating in one process, as a library user runs them.

    python benchmarks/bench_peers.py                       # DeiT-T/S, Swin-T; batch 32, 64
    python benchmarks/bench_peers.py --models deit_tiny --batch-sizes 32 --rounds 5

Every configuration is timed once per round, round after round (medians), so machine noise
hits lgvit and timm alike; the ratio column is lgvit's img/s over timm's. bf16 (autocast) rows
are added where the CPU has native bf16 (AVX-512 bf16 or AMX), on CUDA, or with ``--bf16``.
``--device cuda`` runs both on the GPU (timed as ``lgvit.tools.measure`` times a GPU step).
``--no-tune`` leaves glibc's allocator as a user's script would find it (lgvit's CLI tunes it:
``lgvit.core.runtime.tune_cpu_allocator``).

Both are built with the same stochastic depth, lgvit's default (the papers' recipe: DeiT 0.1,
Swin-T 0.2; timm's defaults are 0 and 0.1), so a training step does the same work on both sides.

Exact counterparts (same architecture, parameter count and timm weights load into ours):
DeiT-T/S and Swin-T. The other lgvit models have none in timm: LSA, LocalViT and LIT are not in
timm; timm's PVT is PVT-v2 only (ours is v1), it has no T2T-ViT, and its TNT is TNT-S/B (ours is
the LocalViT paper's TNT-T).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import add_device_flag, alternate_fns, describe_machine, parse_device  # noqa: E402

PEERS = {
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "swin_tiny": "swin_tiny_patch4_window7_224",
}


def build_pair(name: str) -> dict[str, torch.nn.Module]:
    """lgvit's model with its defaults, and timm's with the same stochastic depth (lgvit's
    defaults are the papers' recipes: DeiT 0.1, Swin-T 0.2; timm's are 0 and 0.1)."""
    import timm

    import lgvit

    torch.manual_seed(0)
    ours = lgvit.create_model(name)
    torch.manual_seed(0)
    theirs = timm.create_model(PEERS[name], drop_path_rate=max(drop_path_rates(ours)))
    return {"lgvit": ours, "timm": theirs}


def drop_path_rates(model: torch.nn.Module) -> list[float]:
    return [round(float(m.drop_prob), 6) for m in model.modules() if hasattr(m, "drop_prob")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--modes", nargs="+", default=["infer", "train"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 rows even where it is emulated")
    ap.add_argument("--no-tune", action="store_true", help="leave glibc's allocator untuned")
    add_device_flag(ap)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = parse_device(args.device)

    from lgvit.core.runtime import cpu_bf16_support, tune_cpu_allocator
    from lgvit.tools.measure import make_step

    torch.set_num_threads(args.threads)
    if not args.no_tune:
        tune_cpu_allocator()
    else:  # create_model would tune it otherwise
        os.environ["LGVIT_DEFAULT_MALLOC"] = "1"
    native = cpu_bf16_support() if device.type == "cpu" else torch.cuda.is_bf16_supported()
    precs = ["fp32"] + (["bf16"] if args.bf16 or native else [])
    machine = describe_machine(device)
    print(machine, "| allocator", "untuned" if args.no_tune else "tuned", flush=True)
    impls = ("lgvit", "timm")
    models = {
        (impl, m): model.to(device) for m in args.models for impl, model in build_pair(m).items()
    }
    for m in args.models:  # same architecture: same parameter count
        n = {impl: sum(p.numel() for p in models[impl, m].parameters()) for impl in impls}
        assert n["lgvit"] == n["timm"], (m, n)
        rates = {impl: [r for r in drop_path_rates(models[impl, m]) if r] for impl in impls}
        assert rates["lgvit"] == rates["timm"], (m, rates)  # the same stochastic depth
    rows = []
    for batch in args.batch_sizes:
        for mode in args.modes:
            for prec in precs:
                for m in args.models:
                    amp = torch.bfloat16 if prec == "bf16" else None
                    fns = {
                        impl: make_step(models[impl, m], (3, 224, 224), batch, mode == "train",
                                        amp, device=device)
                        for impl in impls
                    }  # fmt: skip
                    ms = alternate_fns(fns, args.rounds, device)  # warm-up, alternating rounds
                    ips = {k: 1000 * batch / v for k, v in ms.items()}
                    row = dict(model=m, mode=mode, prec=prec, batch=batch,
                               lgvit=ips["lgvit"], timm=ips["timm"],
                               ratio=ips["lgvit"] / ips["timm"])  # fmt: skip
                    rows.append(row)
                    print(f"{m:11s} {mode:5s} {prec:4s} batch {batch:3d}: lgvit "
                          f"{row['lgvit']:6.1f} img/s, timm {row['timm']:6.1f} img/s, "
                          f"{row['ratio']:.2f}x", flush=True)  # fmt: skip
    print("\n| model | mode | precision | batch | lgvit img/s | timm img/s | lgvit / timm |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['prec']} | {r['batch']} | {r['lgvit']:.1f} | "
              f"{r['timm']:.1f} | {r['ratio']:.2f}x |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, device=str(device), tuned=not args.no_tune, rows=rows),
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
