"""The LIT paper's efficiency claims, as ratios measured in one run on this machine.

    python benchmarks/bench_lit.py

1. lit_ti vs lit_ti_uniform (plain patch merging): what deformable token merging costs.
2. lit_ti vs pvt_small (its skeleton with attention everywhere): inference speed, and the peak
   memory of a training step (each model alone in a fresh process; peak RSS).
3. DeformableTokenMerging alone vs a 2x2 stride-2 conv of the same shape (stage 1 -> 2 of
   LIT-Ti: 64 -> 128 channels on a 56x56 map), forward and forward + backward.

With ``--authors-repo PATH`` (a checkout of github.com/ziplab/LIT) and ``--timm-src TIMM032``
(the folder holding timm 0.3.2's ``timm`` package, their dependency), instead: lit_ti and
lit_s, ours against the authors' classification code (``code_for_lit_ti/lit.py`` and
``code_for_lit_s_m_b/models/lit.py``, built as their scripts build them, drop path 0.1 / 0.2 like
ours), inference and training step, fp32 and bf16, alternating in one run. Their deformable
convolution is a CUDA-only extension (its CPU functions raise "Not implement on cpu"), so their
``DeformConv2dFunction`` is replaced by an exact one: ``torchvision.ops.deform_conv2d`` on float32
inputs, as their ``custom_fwd(cast_inputs=torch.float32)`` / apex ``float_function`` do
(``--authors-dcn lgvit``: lgvit's pure path instead, to separate the model code from the
kernel). Nothing of theirs is part of lgvit.

Configurations alternate round by round (medians); every model runs in its own spawned process
with the same runtime settings. ``--device cuda`` runs them on the GPU (peak memory: the most
allocated, not RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402
    ProcessRunner,
    add_authors_malloc_flag,
    add_device_flag,
    alternate,
    describe_machine,
    parse_device,
    results_table,
)

from lgvit.tools.measure import time_fn  # noqa: E402


def merging_modules(
    batch: int, bf16: bool, rounds: int, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """DTM vs a plain 2x2 stride-2 conv on the same tokens: forward and forward + backward (ms)."""
    from lgvit.models.layers import DeformableTokenMerging, tokens_to_map

    torch.manual_seed(0)
    dtm = DeformableTokenMerging(64, 128)
    nn.init.normal_(dtm.offset_conv.weight, std=0.05)  # trained offsets are not zero
    conv = nn.Conv2d(64, 128, 2, stride=2)
    device = torch.device(device)
    dtm, conv = dtm.to(device), conv.to(device)
    hw = (56, 56)
    x = torch.randn(batch, 56 * 56, 64, device=device, requires_grad=True)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def run_dtm(backward: bool):
        def f() -> None:
            with amp:
                y = dtm(x, hw)[0]
            if backward:
                y.float().sum().backward()

        return f

    def run_conv(backward: bool):
        def f() -> None:
            with amp:
                y = conv(tokens_to_map(x, hw))
            if backward:
                y.float().sum().backward()

        return f

    with torch.no_grad():  # warm-up
        for make in (run_dtm, run_conv):
            make(False)()
    times: dict[str, list[float]] = {k: [] for k in ("dtm", "conv")}
    for _ in range(rounds):  # alternate the two
        for name, make in (("dtm", run_dtm), ("conv", run_conv)):
            with torch.no_grad():
                times[name].append(time_fn(make(False), warmup=1, repeats=1, device=device))
    out = {f"{k} forward": 1000 * statistics.median(v) for k, v in times.items()}
    times = {k: [] for k in ("dtm", "conv")}
    for _ in range(rounds):
        for name, make in (("dtm", run_dtm), ("conv", run_conv)):
            times[name].append(time_fn(make(True), warmup=1, repeats=1, device=device))
    out.update({f"{k} fwd+bwd": 1000 * statistics.median(v) for k, v in times.items()})
    return out


def train_peak_memory(model: str, batch: int, threads: int, device: str = "cpu") -> float:
    """Peak memory (GB; RSS, or on CUDA the most allocated) of a fresh process that builds
    ``model`` and runs training steps."""
    r = ProcessRunner("harness:build_lgvit", threads=threads, device=device)
    key = ("lgvit", model, "train", "fp32", batch)
    r.prepare(key, model, (3, 224, 224), True, False)
    r.time(key)
    return r.close()


AUTHORS_DIRS = {"lit_ti": "code_for_lit_ti", "lit_s": "code_for_lit_s_m_b"}


class _ExactDeformConv2d:
    """Stands in for the authors' ``DeformConv2dFunction`` (``.apply``, their argument order)."""

    use_torchvision = True

    @classmethod
    def apply(cls, x, offset, weight, bias, stride, padding, dilation, groups, dgroups, step):
        from lgvit.models.layers.deform import deform_conv2d

        assert groups == 1 and dgroups == 1 and dilation in (1, (1, 1))
        with torch.autocast(x.device.type, enabled=False):  # their custom_fwd: float32
            f = (t.float() for t in (x, offset, weight, bias))
            return deform_conv2d(*f, stride, padding, use_torchvision=cls.use_torchvision)


def build_authors(name: str, dcn: str = "torchvision") -> nn.Module:  # the authors' process
    import types

    sys.argv = sys.argv[:1]  # their params.py parses the command line when imported
    sys.modules["DCN"] = types.ModuleType("DCN")  # the CUDA extension, never called
    apex = sys.modules["apex"] = types.ModuleType("apex")  # LIT-S's: amp.float_function only
    apex.amp = types.SimpleNamespace(float_function=lambda f: f)
    import mm_modules.DCN.modules.deform_conv2d as their_dcn

    _ExactDeformConv2d.use_torchvision = dcn == "torchvision"
    their_dcn.DeformConv2dFunction = _ExactDeformConv2d
    if name == "lit_ti":
        import lit  # code_for_lit_ti/lit.py

        return lit.lit_ti(drop_path_rate=0.1)
    from models.lit import LIT  # code_for_lit_s_m_b: models/build.py with configs/lit-small.yaml

    return LIT(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], drop_path_rate=0.2)


def against_authors(args: argparse.Namespace) -> None:
    runners = {
        "lgvit": ProcessRunner("harness:build_lgvit", threads=args.threads, device=args.device)
    }
    for model, folder in AUTHORS_DIRS.items():
        paths = [os.path.join(args.authors_repo, "classification", folder), args.timm_src]
        runners[f"authors/{model}"] = ProcessRunner(
            "bench_lit:build_authors",
            (args.authors_dcn,),
            threads=args.threads,
            paths=paths,
            tuned_malloc=args.authors_tuned_malloc,
            device=args.device,
            fused=False,  # their scripts' plain AdamW; ours: the one lgvit train builds
        )
    keys = []
    for mode in ("infer", "train"):
        for model in AUTHORS_DIRS:
            for impl in ("lgvit", f"authors/{model}"):
                for prec in ("fp32", "bf16"):
                    key = (impl, model, mode, prec, args.batch)
                    runners[impl].prepare(
                        key, model, (3, 224, 224), mode == "train", prec == "bf16"
                    )
                    keys.append(key)
    params = {impl: r.params(impl.split("/")[-1]) for impl, r in runners.items() if impl != "lgvit"}
    print("authors' params:", params, flush=True)
    rows = results_table(alternate(runners, keys, args.rounds))
    ips = {(r["impl"].split("/")[0], r["model"], r["mode"], r["prec"]): r["img_s"] for r in rows}
    print(f"\nlgvit over the authors' code (their deformable conv: {args.authors_dcn}):")
    for mode in ("infer", "train"):
        for model in AUTHORS_DIRS:
            ours = {p: ips["lgvit", model, mode, p] for p in ("fp32", "bf16")}
            theirs = {p: ips["authors", model, mode, p] for p in ("fp32", "bf16")}
            print(
                f"  {model:7s} {mode:5s} batch {args.batch}: fp32/fp32 "
                f"{ours['fp32'] / theirs['fp32']:4.2f}x; bf16/bf16 "
                f"{ours['bf16'] / theirs['bf16']:4.2f}x; our bf16 / their fp32 "
                f"{ours['bf16'] / theirs['fp32']:4.2f}x"
            )
    rss = {impl: round(r.close(), 2) for impl, r in runners.items()}
    print("peak memory (GB, all configurations of a process):", rss)
    if args.json:
        with open(args.json, "w") as f:
            machine = describe_machine(args.device)
            json.dump(dict(machine=machine, rows=rows, rss_gb=rss), f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="batch 2, one round")
    ap.add_argument("--authors-repo", help="a checkout of ziplab/LIT: time against their code")
    ap.add_argument("--timm-src", help="folder with timm 0.3.2's `timm` package")
    add_authors_malloc_flag(ap)
    ap.add_argument("--authors-dcn", choices=("torchvision", "lgvit"), default="torchvision")
    add_device_flag(ap)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = parse_device(args.device)
    if args.quick:
        args.batch, args.rounds = 2, 1
    torch.set_num_threads(args.threads)
    print(describe_machine(device), f"(children: {args.threads} threads), batch {args.batch}",
          flush=True)  # fmt: skip
    if args.authors_repo:
        if not args.timm_src:
            ap.error("--authors-repo needs --timm-src (their code imports timm 0.3.2)")
        return against_authors(args)

    runners = {
        "lgvit": ProcessRunner("harness:build_lgvit", threads=args.threads, device=args.device)
    }
    models = ("lit_ti", "lit_ti_uniform", "pvt_small")
    keys = []
    for model in models:
        for prec in ("fp32", "bf16"):
            key = ("lgvit", model, "infer", prec, args.batch)
            runners["lgvit"].prepare(key, model, (3, 224, 224), False, prec == "bf16")
            keys.append(key)
    medians = alternate(runners, keys, args.rounds)
    runners["lgvit"].close()
    rows = results_table(medians)
    ips = {(r["model"], r["prec"]): r["img_s"] for r in rows}
    print("\ninference, ratios of img/s (paper's claims: DTM costs little; LIT-Ti beats PVT-S):")
    for prec in ("fp32", "bf16"):
        uniform = ips["lit_ti", prec] / ips["lit_ti_uniform", prec]
        pvt = ips["lit_ti", prec] / ips["pvt_small", prec]
        print(
            f"  {prec}: lit_ti / lit_ti_uniform {uniform:.2f}x (target >= 0.85x);  "
            f"lit_ti / pvt_small {pvt:.2f}x (target >= 1.2x)"
        )
    mem = {
        m: train_peak_memory(m, args.batch, args.threads, args.device)
        for m in ("lit_ti", "pvt_small")
    }
    what = "peak RSS" if device.type == "cpu" else "most CUDA memory allocated"
    print(
        f"\n{what} of a training step (fp32, batch {args.batch}, fresh process each): "
        + ", ".join(f"{m} {v:.2f} GB" for m, v in mem.items())
        + f"; lit_ti / pvt_small {mem['lit_ti'] / mem['pvt_small']:.2f}"
    )
    merge = {
        p: merging_modules(args.batch, p == "bf16", max(args.rounds, 3), device)
        for p in ("fp32", "bf16")
    }
    print(f"\nmerging 56x56x64 -> 28x28x128, batch {args.batch} (ms, median):")
    for p, m in merge.items():
        print(
            f"  {p}: forward DTM {m['dtm forward']:.1f} vs conv {m['conv forward']:.1f} "
            f"({m['dtm forward'] / m['conv forward']:.1f}x); forward+backward DTM "
            f"{m['dtm fwd+bwd']:.1f} vs conv {m['conv fwd+bwd']:.1f} "
            f"({m['dtm fwd+bwd'] / m['conv fwd+bwd']:.1f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    machine=describe_machine(device), rows=rows, train_rss_gb=mem, merge_ms=merge
                ),  # fmt: skip
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
