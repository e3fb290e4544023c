"""RetinaNet and Mask R-CNN with each LIT Tables 5-6 backbone at 800x1333: params, MACs,
inference and training img/s, peak memory, beside the paper's params and AP.

    python benchmarks/bench_detection.py [--backbones lit_ti lit_s pvt_small swin_tiny]
                                         [--detectors retinanet maskrcnn] [--size 800 1333]
                                         [--batch 1] [--steps 3] [--amp none|bf16]
                                         [--threads N] [--json rows.json]
    python benchmarks/bench_detection.py --size 128 160 --steps 1 --threads 1 --backbones lit_ti

Every (backbone, detector) pair runs alone in a fresh spawned process (peak RSS is that
process's, counted from just before its first training step; on CUDA: allocated memory); times
are medians of ``--steps`` rounds after warm-up, as ``lgvit.tools.measure.time_fn`` times on the
device (``--device cuda``: the GPU).
The detector is ``lgvit.dense.detection.create_detector(kind, backbone, num_classes=80)``
(torchvision's, 80 COCO classes) with its resize set to the input's own size
(``min_size``/``max_size`` = the short/long side of ``--size``: 800/1333 at the default, LIT's
setting; a smaller ``--size`` is then really measured at that size, not upscaled to 800).
Inputs are random images in [0, 1], as torchvision's detectors take them (their transform
normalises and pads to a multiple of 32).

* Inference: eval mode, ``torch.no_grad``, a list of ``--batch`` images, postprocessing
  (decoding, NMS, mask pasting) included.
* Training: ``model(images, targets)`` with 3-8 random boxes per image (labels 0..79 for
  RetinaNet, 1..80 for Mask R-CNN, whose class 0 is background; Mask R-CNN also gets each box
  filled as its uint8 mask), loss = the sum of the loss dict, backward, the optimizer
  ``lgvit train`` builds.
* MACs (one image, FlopCounterMode / 2 as ``lgvit.tools.measure``): torchvision's postprocessing has
  data-dependent shapes (``nonzero``, NMS) the meta device cannot run, and with random weights
  the number of RoIs reaching Mask R-CNN's heads is arbitrary anyway. So what is counted is the
  network on the transformed (padded) batch, on the meta device: backbone + FPN + heads, i.e.
  RetinaNet's backbone, FPN and class/box head on every level (its postprocessing has no
  matmuls: this is the whole forward, checked equal to a count of the real one); Mask R-CNN's
  backbone, FPN, RPN head, the box head on ``rpn_post_nms_top_n_test`` (1000) RoIs and the
  mask head on ``detections_per_img`` (100) RoIs, mmdetection's ``get_flops`` convention.
  RoIAlign, anchors and NMS are not counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from harness import add_device_flag, parse_device, time_infer_train

from lgvit.tools.measure import (
    count_macs_of,
    describe_machine,
    run_in_fresh_process,
)

# LIT's Tables 5-6 (COCO val2017, 1x schedule): RetinaNet params (M) and box AP; Mask R-CNN
# params (M), box AP and mask AP. The paper prints params in whole millions (PVT's and Swin's
# own papers: PVT-S 34.2 / 44.1, Swin-Ti 38.5 / 47.8).
PAPER: dict[str, dict[str, tuple[float, ...]]] = {
    "retinanet": {"pvt_small": (34, 40.4), "lit_ti": (30, 41.6), "swin_tiny": (39, 41.5),
                  "lit_s": (39, 41.6)},
    "maskrcnn": {"pvt_small": (44, 40.4, 37.8), "lit_ti": (40, 42.0, 39.1),
                 "swin_tiny": (48, 42.2, 39.1), "lit_s": (48, 42.9, 39.6)},
}  # fmt: skip
NUM_CLASSES = 80  # COCO's


def network_forward(model: nn.Module, x: torch.Tensor) -> None:
    """Backbone + FPN + heads on the transformed batch ``x``: what the MACs count (docstring)."""
    feats = list(model.backbone(x).values())
    if model.detector == "retinanet":
        model.head(feats)
        return
    model.rpn.head(feats)
    rh = model.roi_heads
    c = model.backbone.out_channels
    rois = model.rpn._post_nms_top_n["testing"]  # proposals reaching the box head at test
    rh.box_predictor(rh.box_head(x.new_zeros(rois, c, 7, 7)))
    rh.mask_predictor(rh.mask_head(x.new_zeros(rh.detections_per_img, c, 14, 14)))


def random_targets(
    kind: str, batch: int, h: int, w: int, gen: torch.Generator
) -> list[dict[str, torch.Tensor]]:
    """3-8 random boxes per image, inside it, at least 1/16 of a side (Mask R-CNN: box masks)."""
    targets = []
    for _ in range(batch):
        n = int(torch.randint(3, 9, (), generator=gen))
        bw = torch.randint(max(w // 16, 2), w // 2 + 1, (n,), generator=gen)
        bh = torch.randint(max(h // 16, 2), h // 2 + 1, (n,), generator=gen)
        x0 = (torch.rand(n, generator=gen) * (w - bw)).long()
        y0 = (torch.rand(n, generator=gen) * (h - bh)).long()
        boxes = torch.stack([x0, y0, x0 + bw, y0 + bh], 1).float()
        first = 0 if kind == "retinanet" else 1  # Mask R-CNN's class 0 is background
        t = {"boxes": boxes, "labels": torch.randint(first, first + NUM_CLASSES, (n,),
                                                     generator=gen)}  # fmt: skip
        if kind == "maskrcnn":
            masks = torch.zeros(n, h, w, dtype=torch.uint8)
            for m, (a, b, c, d) in zip(masks, boxes.long().tolist(), strict=True):
                m[b:d, a:c] = 1
            t["masks"] = masks
        targets.append(t)
    return targets


def measure(
    name: str, kind: str, size: tuple[int, int], batch: int, steps: int, amp: str, threads: int,
    grad_checkpointing: bool = False, device: str = "cpu",
) -> dict[str, Any]:  # fmt: skip
    from lgvit.dense.detection import create_detector

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    h, w = size
    # The resize keeps --size as it is (800x1333 is LIT's own setting).
    kwargs = dict(num_classes=NUM_CLASSES, min_size=min(h, w), max_size=max(h, w))
    with torch.device("meta"):
        meta = create_detector(kind, name, **kwargs)
    params = sum(p.numel() for p in meta.parameters())
    meta.eval()
    batched, _ = meta.transform([torch.zeros(3, h, w)])  # the resized, padded shape
    shape = batched.tensors.shape
    macs = count_macs_of(lambda: network_forward(meta, torch.zeros(shape, device="meta")))
    model = create_detector(kind, name, grad_checkpointing=grad_checkpointing, **kwargs)
    model = model.to(device)
    bf16 = amp == "bf16"
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), generator=gen).float() / 255 for _ in range(batch)]
    targets = random_targets(kind, batch, h, w, gen)
    images = [im.to(device) for im in images]
    targets = [{k: v.to(device) for k, v in t.items()} for t in targets]

    t_inf, t_train, peak_gb = time_infer_train(
        model, lambda: model(images), lambda: sum(model(images, targets).values()), steps, bf16,
        device,
    )  # fmt: skip
    return {
        "backbone": name, "detector": kind, "params_m": params / 1e6, "gmacs": macs / 1e9,
        "input": list(shape[-2:]), "infer_img_s": batch / t_inf, "train_img_s": batch / t_train,
        "peak_train_gb": peak_gb,
    }  # fmt: skip


def paper_cells(name: str, kind: str) -> tuple[str, str]:
    """(paper params, paper AP as 'box' or 'box / mask'), '-' where the paper has none."""
    row = PAPER[kind].get(name)
    if row is None:
        return "-", "-"
    return f"{row[0]:g}", " / ".join(f"{v:.1f}" for v in row[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbones", nargs="+", default=["lit_ti", "lit_s", "pvt_small", "swin_tiny"])
    p.add_argument("--detectors", nargs="+", default=["retinanet", "maskrcnn"],
                   choices=["retinanet", "maskrcnn"])  # fmt: skip
    p.add_argument("--size", type=int, nargs=2, default=(800, 1333), metavar=("H", "W"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute backbone blocks in backward (LIT-S's configs)")  # fmt: skip
    add_device_flag(p)
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the rows here")
    args = p.parse_args()
    device = parse_device(args.device)
    torch.set_num_threads(args.threads)  # so describe_machine names the threads used
    print(describe_machine(device))
    rows = []
    for name in args.backbones:
        for kind in args.detectors:
            run = (name, kind, tuple(args.size), args.batch, args.steps, args.amp, args.threads,
                   args.grad_checkpointing, args.device)  # fmt: skip
            try:
                rows.append(run_in_fresh_process(measure, run))
            except RuntimeError as e:  # one failing pair (e.g. out of memory) keeps the others
                rows.append({"backbone": name, "detector": kind, "error": str(e)})
    h, w = args.size
    ckpt = ", activation checkpointing" if args.grad_checkpointing else ""
    print(f"COCO detectors, 80 classes, {h}x{w} input, batch {args.batch}, amp {args.amp}, "
          f"{args.threads} threads{ckpt}; MACs: backbone + FPN + heads, one image")  # fmt: skip
    print("| backbone | detector | params (M) | paper params (M) | GMACs | infer img/s | "
          "train img/s | peak train mem (GB) | paper AP (box / mask) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        pp, ap = paper_cells(r["backbone"], r["detector"])
        if "error" in r:
            print(f"| {r['backbone']} | {r['detector']} | failed: {r['error']} | {pp} | - | - | "
                  f"- | - | {ap} |")  # fmt: skip
            continue
        print(f"| {r['backbone']} | {r['detector']} | {r['params_m']:.2f} | {pp} | "
              f"{r['gmacs']:.1f} | {r['infer_img_s']:.3f} | {r['train_img_s']:.3f} | "
              f"{r['peak_train_gb']:.2f} | {ap} |")  # fmt: skip
    if args.json:
        meta = {"machine": describe_machine(device), "size": [h, w], "batch": args.batch,
                "steps": args.steps, "amp": args.amp, "threads": args.threads,
                "grad_checkpointing": args.grad_checkpointing}  # fmt: skip
        for r in rows:
            r["paper"] = list(PAPER[r["detector"]].get(r["backbone"], ()))
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
