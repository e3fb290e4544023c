"""CPU speed of LocalViT-T and DeiT-T: inference and training step, fp32 and bf16, lgvit vs the
LocalViT authors' implementation, alternating in one run.

    python benchmarks/bench_localvit.py --authors-repo /tmp/LocalViT --timm-src /tmp/timm032

``--authors-repo``: a checkout of github.com/ofsoundof/LocalViT; ``--timm-src``: the folder
holding the ``timm`` package of timm 0.3.2 (their dependency; from the history of
pytorch-image-models, with ``torch._six`` imports replaced by ``collections.abc``). Their
``localvit_tiny_mlp4_act3_r192`` and ``deit_tiny_patch16_224`` are built in a spawned process
(torchvision is stubbed there: the models never call it); ours in another spawned process. Nothing
of theirs is part of lgvit. Without ``--authors-repo`` only lgvit is timed. ``--device cuda``
runs both on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402
    ProcessRunner,
    add_authors_malloc_flag,
    add_device_flag,
    alternate,
    describe_machine,
    parse_device,
    results_table,
    stub_torchvision,
)

AUTHORS_NAMES = {
    "localvit_tiny": "localvit_tiny_mlp4_act3_r192",
    "deit_tiny": "deit_tiny_patch16_224",
}


def build_authors(name: str):  # runs in the authors' process
    stub_torchvision()
    import models.deit  # noqa: F401  (their registrations)
    import models.localvit  # noqa: F401
    import timm

    return timm.create_model(AUTHORS_NAMES[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["localvit_tiny", "deit_tiny"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--modes", nargs="+", default=["infer", "train"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--authors-repo")
    ap.add_argument("--timm-src", help="folder with timm 0.3.2's `timm` package")
    add_authors_malloc_flag(ap)
    ap.add_argument("--quick", action="store_true", help="batch 2, one round, inference only")
    add_device_flag(ap)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = parse_device(args.device)
    if args.quick:
        args.batch_sizes, args.rounds, args.modes = [2], 1, ["infer"]
    print(describe_machine(device), f"(children: {args.threads} threads)", flush=True)

    runners = {
        "lgvit": ProcessRunner("harness:build_lgvit", threads=args.threads, device=args.device)
    }
    if args.authors_repo:
        paths = [args.authors_repo] + ([args.timm_src] if args.timm_src else [])
        runners["authors"] = ProcessRunner(
            "bench_localvit:build_authors",
            threads=args.threads,
            paths=paths,
            tuned_malloc=args.authors_tuned_malloc,
            device=args.device,
            fused=False,  # their scripts' plain AdamW; ours: the one lgvit train builds
        )
    keys = []
    for batch in args.batch_sizes:
        for mode in args.modes:
            for model in args.models:
                for impl in runners:
                    for prec in ("fp32", "bf16"):
                        key = (impl, model, mode, prec, batch)
                        runners[impl].prepare(
                            key, model, (3, 224, 224), mode == "train", prec == "bf16"
                        )
                        keys.append(key)
    medians = alternate(runners, keys, args.rounds)
    rows = results_table(medians)
    if "authors" in runners:
        ips = {(r["impl"], r["model"], r["mode"], r["prec"], r["batch"]): r["img_s"] for r in rows}
        print("\nlgvit over the authors' code, same model and batch:")
        for batch in args.batch_sizes:
            for mode in args.modes:
                for model in args.models:
                    ours = {p: ips["lgvit", model, mode, p, batch] for p in ("fp32", "bf16")}
                    theirs = {p: ips["authors", model, mode, p, batch] for p in ("fp32", "bf16")}
                    print(
                        f"  {model:14s} {mode:5s} batch {batch:3d}: our bf16 / their fp32 "
                        f"{ours['bf16'] / theirs['fp32']:4.2f}x; fp32/fp32 "
                        f"{ours['fp32'] / theirs['fp32']:4.2f}x; bf16/bf16 "
                        f"{ours['bf16'] / theirs['bf16']:4.2f}x"
                    )
    rss = {impl: r.close() for impl, r in runners.items()}
    print(
        "peak memory (GB, all configurations of a process):",
        {k: round(v, 2) for k, v in rss.items()},
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=describe_machine(device), rows=rows, rss_gb=rss), f, indent=2)


if __name__ == "__main__":
    main()
