"""LSA's local attention before and after issue 55, timed alternately in one process.

The local attention (each position's query over its T shifted variants) used to run in SDPA
with the positions as its batch, which CUDA's kernels cap at 65,535 (lsa_tiny_224 failed at
batch 64 on an H200); it now runs as batched matmuls cut to that limit
(``lgvit.models.layers.lsa_folded.attend_variants``). Timed here, old against new, round by
round so machine noise hits both alike (medians):

- the local attention layer alone: the plain path at lsa_tiny_224's shapes (T=10, 192 wide,
  4 heads: its 9x9 patch is wider than the embedding, so nothing folds) and the folded path
  at lsa_tiny_cifar's (T=18, one key/value head for 3 query heads);
- the whole lsa_tiny_224 and lsa_tiny_cifar, forward and forward+backward;

in float32 and under bf16 autocast. "old" is the previous code, as tests/test_cuda_limits.py
keeps it for reference, with the shifted patches gathered in float32 under autocast as before;
the table's first column is old / new (above 1: the new code is faster).

    python benchmarks/bench_lsa_local.py                 # CPU, 2 threads
    python benchmarks/bench_lsa_local.py --device cuda   # old fails past 65,535 positions
    python benchmarks/bench_lsa_local.py --smoke         # a tiny run (the test suite's)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from harness import add_device_flag, alternate_fns, parse_device

import lgvit
import lgvit.models.lsa as lsa
from lgvit.core.runtime import cpu_bf16_support, tune_cpu_allocator
from lgvit.tools.measure import describe_machine

ROOT = Path(__file__).resolve().parents[1]


def _old_forward() -> Callable:
    """The previous ``LocalShiftAttention.forward``, from the tests that pin the new one to it."""
    path = ROOT / "tests" / "test_cuda_limits.py"
    spec = importlib.util.spec_from_file_location("_lsa_local_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._old_forward


@contextlib.contextmanager
def implementation(which: str, old_forward: Callable) -> Iterator[None]:
    """``"new"``: the code as it is; ``"old"``: the previous local attention, and the shifted
    patches gathered in the input's type (float32) under autocast."""
    if which == "new":
        yield
        return
    forward, amp = lsa.LocalShiftAttention.forward, lsa.autocast_dtype
    lsa.LocalShiftAttention.forward, lsa.autocast_dtype = old_forward, lambda device: None
    try:
        yield
    finally:
        lsa.LocalShiftAttention.forward, lsa.autocast_dtype = forward, amp


def _layer_step(
    name: str, batch: int, size: int, train: bool, bf16: bool, device: torch.device, smoke: bool
) -> Callable[[], None]:
    """The local block's attention of ``name`` on one batch of its own shifted variants (made
    once, as the new code gathers them: the layer's own time, old and new)."""
    torch.manual_seed(0)
    dims = (48,) if smoke else (192,)
    model = lgvit.create_model(name, img_size=size, dims=dims, depths=(1,)).to(device)
    block = model.local_block
    x = torch.randn(batch, 3, size, size, device=device)
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
        x0, variants, _ = model.patch_embed(x)
        variants = variants.add(model.pos_embed)
        query = block.norm1(x0 + model.pos_embed[0])
    block.train(train)

    def step() -> None:
        with torch.set_grad_enabled(train), torch.autocast(device.type, torch.bfloat16,
                                                            enabled=bf16):  # fmt: skip
            y = block.attn(query, variants, block.norm1)
        if train:
            y.float().square().mean().backward()
            block.zero_grad(set_to_none=True)

    return step


def _model_step(
    name: str, batch: int, size: int, train: bool, bf16: bool, device: torch.device, smoke: bool
) -> Callable[[], None]:
    torch.manual_seed(0)
    small = dict(dims=(48, 48), depths=(1, 1)) if smoke else {}
    model = lgvit.create_model(name, img_size=size, **small).to(device).train(train)
    x = torch.randn(batch, 3, size, size, device=device)

    def step() -> None:
        with torch.set_grad_enabled(train), torch.autocast(device.type, torch.bfloat16,
                                                            enabled=bf16):  # fmt: skip
            y = model(x)
        if train:
            y.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

    return step


# (what, builder, model, input size at full / smoke scale)
CASES = (
    ("local, plain", _layer_step, "lsa_tiny_224", 224, 64),
    ("local, folded", _layer_step, "lsa_tiny_cifar", 32, 16),
    ("model", _model_step, "lsa_tiny_224", 224, 64),
    ("model", _model_step, "lsa_tiny_cifar", 32, 16),
)


def measure(args: argparse.Namespace, device: torch.device, precisions: list[str]) -> list[dict]:
    old_forward = _old_forward()
    rows = []
    for what, build, name, full, small in CASES:
        size = small if args.smoke else full
        batch = args.layer_batch if what.startswith("local") else args.batch
        for prec in precisions:
            for train in (False, True):
                step = build(name, batch, size, train, prec == "bf16", device, args.smoke)
                fns = {}
                for which in ("old", "new"):

                    def run(which: str = which, step: Callable[[], None] = step) -> None:
                        with implementation(which, old_forward):
                            step()

                    fns[which] = run
                try:
                    ms = alternate_fns(fns, args.rounds, device)
                except RuntimeError as e:  # the old path past CUDA's limit
                    print(f"{what} {name} {prec} batch {batch}: {str(e).splitlines()[0]}")
                    continue
                row = dict(ratio=ms["old"] / ms["new"], what=what, model=name, size=size,
                           mode="fwd+bwd" if train else "forward", precision=prec,
                           batch=batch, old_ms=ms["old"], new_ms=ms["new"])  # fmt: skip
                rows.append(row)
                cells = (f"{row['ratio']:.2f}", what, f"{name} {size}px", row["mode"], prec,
                         str(batch), f"{ms['old']:.1f}", f"{ms['new']:.1f}")  # fmt: skip
                print(f"| {' | '.join(cells)} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="images, whole models (default 8)")
    ap.add_argument(
        "--layer-batch", type=int, default=16, help="images, the layer alone (default 16)"
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--bf16", choices=("auto", "yes", "no"), default="auto",
        help="also time bf16 autocast (auto: where the CPU has native bf16, or on CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--smoke", action="store_true",
        help="a tiny run (batch 1, small inputs, models 48 wide and 2 blocks deep): it runs",
    )  # fmt: skip
    add_device_flag(ap)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch = args.layer_batch = args.rounds = 1
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    native = cpu_bf16_support() if device.type == "cpu" else torch.cuda.is_bf16_supported()
    bf16 = args.bf16 == "yes" or (args.bf16 == "auto" and bool(native)) or args.smoke
    precisions = ["fp32", "bf16"] if bf16 else ["fp32"]
    print(f"{describe_machine(device)}; native bf16: {native or 'none'}; "
          f"{args.rounds} alternating rounds (median ms)")  # fmt: skip
    print("| old / new | what | model | mode | precision | batch | old (ms) | new (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = measure(args, device, precisions)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=describe_machine(device), device=str(device), rows=rows), f,
                      indent=2)  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
