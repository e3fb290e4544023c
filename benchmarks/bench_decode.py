"""Eval/predict image path: torchvision's decoder and resize against what lgvit used before.

    python benchmarks/bench_decode.py [--rounds 30]

On a real photograph (scikit-learn's bundled ``china.jpg``, 427x640, saved as JPEG q90 and as
PNG): decoding one file with torchvision (``decode_image``) against PIL + ``convert('RGB')``,
and the eval resize (shorter side to 256, bicubic, antialiased, uint8) with torchvision's
``resize`` against float ``interpolate`` + rounding. Alternating, medians in ms; the largest
pixel difference of each from PIL's own resize (what timm's eval transform runs) is printed too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from PIL import Image
from sklearn.datasets import load_sample_image
from torchvision.io import ImageReadMode, decode_image, read_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import alternate_fns  # noqa: E402

from lgvit.tools.measure import describe_machine  # noqa: E402


def _pil_decode(path: str) -> torch.Tensor:
    with Image.open(path) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


def _tv_decode(path: str) -> torch.Tensor:
    return decode_image(read_file(path), mode=ImageReadMode.RGB)


def _float_resize(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:  # lgvit before
    out = F.interpolate(x.float(), size=hw, mode="bicubic", align_corners=False, antialias=True)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _tv_resize(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    return TF.resize(x, list(hw), interpolation=TF.InterpolationMode.BICUBIC, antialias=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{describe_machine()}; {args.rounds} alternating rounds (median ms)")
    photo = Image.fromarray(load_sample_image("china.jpg"))
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"jpeg": os.path.join(tmp, "p.jpg"), "png": os.path.join(tmp, "p.png")}
        photo.save(paths["jpeg"], quality=90)
        photo.save(paths["png"])
        print(
            "| step | PIL / before (ms) | torchvision (ms) | before / torchvision | same pixels |"
        )
        print("| --- | --- | --- | --- | --- |")
        for kind, path in paths.items():
            same = torch.equal(_pil_decode(path), _tv_decode(path))
            fns = {"pil": lambda p=path: _pil_decode(p), "tv": lambda p=path: _tv_decode(p)}
            ms = alternate_fns(fns, args.rounds)
            print(f"| decode {kind} 427x640 | {ms['pil']:.2f} | {ms['tv']:.2f} | "
                  f"{ms['pil'] / ms['tv']:.2f}x | {same} |")  # fmt: skip
        x = _tv_decode(paths["jpeg"])[None]
        hw = (256, 256 * 640 // 427)
        decoded = Image.fromarray(x[0].permute(1, 2, 0).numpy())  # the JPEG's own pixels
        pil = np.array(decoded.resize(hw[::-1], Image.Resampling.BICUBIC))
        pil = torch.from_numpy(pil).permute(2, 0, 1)[None]
        off = {
            k: int((f(x, hw).int() - pil.int()).abs().max())
            for k, f in (("before", _float_resize), ("tv", _tv_resize))
        }
        fns = {"before": lambda: _float_resize(x, hw), "tv": lambda: _tv_resize(x, hw)}
        ms = alternate_fns(fns, args.rounds)
        print(f"| resize 427x640 -> {hw[0]}x{hw[1]} | {ms['before']:.2f} | {ms['tv']:.2f} | "
              f"{ms['before'] / ms['tv']:.2f}x | max diff from PIL: before {off['before']}, "
              f"torchvision {off['tv']} levels |")  # fmt: skip


if __name__ == "__main__":
    main()
