"""JPEG decoding on the device (``--decode-device``): streamed samples decoded where the recipe
runs instead of by PIL in the DataLoader workers.

The workers then read each sample's encoded bytes and its JPEG header only (size, EXIF
orientation; no pixel decoded) and draw its crop box from the same seeded generator, in the same
order, as the PIL path (:mod:`lgvit.data.stream`), so the crops are the same. The main process
decodes a batch's JPEGs with torchvision's ``decode_jpeg`` (on CUDA one batched nvJPEG call; on
the CPU libjpeg-turbo, image by image), turns them upright as PIL's ``exif_transpose`` does,
and crops them there: train, the drawn box resized to ``S x S`` (bicubic, antialiased:
torchvision's ``resized_crop``); eval, :func:`resize_center_crop`, as the PIL path does after
decoding. PIL's crop reads the pixels just outside its box for the resampling filter's taps
where ``resized_crop`` clamps at the box's edge, so the border rows differ by a few levels
(mean under a level); libjpeg-turbo on the CPU gives PIL's pixels exactly, nvJPEG within a few
levels. Anything else (PNG, WebP, CMYK JPEGs) the workers decode with PIL as before, and a JPEG
the device decoder refuses is decoded by PIL on the main process: both are counted per pass
(``cpu_decoded``, a count in the epoch's line).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from torchvision.io import ImageReadMode, decode_jpeg

from lgvit.core.errors import LgvitError
from lgvit.core.runtime import Dist, all_reduce_sum
from lgvit.data.decode import jpeg_header, load_rgb
from lgvit.data.loader import AugmentConfig
from lgvit.data.transforms import resize_center_crop

__all__ = ["DECODE_DEVICES", "DeviceDecoder", "EncodedBatch", "cpu_decoded_in_pass",
           "decode_device", "device_decoder", "upright"]  # fmt: skip

DECODE_DEVICES = ("none", "cpu", "cuda")  # none: PIL in the workers (the default)
Box = tuple[int, int, int, int]  # left, top, right, bottom, in the upright image


def _no_cuda() -> LgvitError:
    return LgvitError("--decode-device cuda: no CUDA device is available here (use "
                      "--decode-device none: PIL decodes in the workers)")  # fmt: skip


def decode_device(name: str, train_device: torch.device) -> torch.device | None:
    """The device ``--decode-device name`` decodes on: None for ``none``; ``cuda``, the run's
    own GPU (its rank's); one line where there is no CUDA."""
    if name not in DECODE_DEVICES:
        allowed = ", ".join(DECODE_DEVICES)
        raise LgvitError(f"--decode-device must be one of {allowed}, not {name!r}")
    if name == "none":
        return None
    if name == "cuda" and not torch.cuda.is_available():
        raise _no_cuda()
    if name == "cuda" and train_device.type == "cuda":
        return train_device
    return torch.device(name)


def upright(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """A ``(C, H, W)`` image as stored, turned by its EXIF ``orientation`` (1-8) as PIL's
    ``ImageOps.exif_transpose`` turns it."""
    if orientation in (5, 6, 7, 8):  # stored turned by 90 degrees: first swap the axes
        x = x.transpose(-1, -2)  # PIL's TRANSPOSE (5)
        flips = {5: (), 6: (-1,), 7: (-1, -2), 8: (-2,)}[orientation]
    else:
        flips = {1: (), 2: (-1,), 3: (-1, -2), 4: (-2,)}.get(orientation, ())
    return x.flip(flips) if flips else x


class EncodedBatch:
    """What a worker hands over for one batch's samples the device decodes: their encoded
    bytes (one uint8 blob, cut at ``offsets``), EXIF orientations and crop boxes."""

    def __init__(self, b: int) -> None:
        self.parts: list[bytes] = [b""] * b
        self.orientation = torch.ones(b, dtype=torch.int8)
        self.boxes = torch.zeros((b, 4), dtype=torch.int64)
        self.on_device = torch.zeros(b, dtype=torch.bool)
        self.cpu = torch.zeros(b, dtype=torch.bool)  # decoded by PIL in the worker

    def add(self, j: int, data: bytes, box: Callable[[int, int], Box]) -> bool:
        """Sample ``j`` for the device when ``data`` is a JPEG it decodes (True; its crop box
        drawn now, where the PIL path draws it: after the image is found usable); False for
        the caller to decode with PIL (counted). Raises on a header PIL refuses."""
        head = jpeg_header(data)
        if head is None:
            self.cpu[j] = True
            return False
        w, h, self.orientation[j] = head
        self.boxes[j] = torch.tensor(box(w, h))
        self.parts[j], self.on_device[j] = data, True
        return True

    def payload(self) -> tuple[torch.Tensor, ...]:
        """Tensors only (a list of bytes would be pickled through the workers' queue)."""
        sizes = [len(p) for p in self.parts]
        offsets = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64)
        blob = torch.frombuffer(bytearray(b"".join(self.parts) or b"\0"), dtype=torch.uint8)
        return blob, offsets, self.orientation, self.boxes, self.on_device, self.cpu


def device_decoder(
    device: torch.device | str | None, crop: AugmentConfig, train: bool
) -> DeviceDecoder | None:
    """A streaming loader's decoder on ``device`` with its ``crop`` settings (None: none)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _no_cuda()
    return DeviceDecoder(device, crop.img_size, train, crop.crop_pct, crop.interpolation)


class DeviceDecoder:
    """The main process's half: a workers' batch made whole on ``device`` (uint8
    ``(B, 3, S, S)``), its JPEGs decoded and cropped there. ``train``: the boxes resized to
    ``size``; eval: :func:`resize_center_crop` with ``crop_pct`` and ``interpolation``.
    ``cpu_decoded``: samples PIL decoded this pass (reset by the loader)."""

    def __init__(
        self, device: torch.device, size: int, train: bool, crop_pct: float, interpolation: str
    ) -> None:
        self.device, self.size, self.train = torch.device(device), size, train
        self.crop_pct, self.interpolation = crop_pct, interpolation
        self.cpu_decoded = 0

    def finish(
        self, x: torch.Tensor, ok: torch.Tensor, payload: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (the workers' PIL crops, zeros where the device decodes) on the device with
        the device's crops written in; ``ok`` cleared where no decoder could read a JPEG."""
        blob, offsets, orientation, boxes, on_device, cpu = payload
        self.cpu_decoded += int(cpu.sum())
        x = x.to(self.device, non_blocking=True)
        which = on_device.nonzero().flatten().tolist()
        if not which:
            return x, ok
        data = [blob[int(offsets[k]) : int(offsets[k + 1])] for k in which]
        for k, img in zip(which, self._decode(data), strict=True):
            if img is None:  # refused by decode_jpeg: PIL's decode, or a bad sample
                img = self._pil(blob[int(offsets[k]) : int(offsets[k + 1])])
                if img is None:
                    ok[k] = False
                    continue
                self.cpu_decoded += 1
            else:
                img = upright(img, int(orientation[k]))
            x[k] = self._crop(img, boxes[k].tolist())
        return x, ok

    def _decode(self, data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The JPEGs decoded to RGB (greyscale replicated, as PIL's convert does) on the
        device; one batched call, image by image when it fails (None where an image fails)."""
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders per call
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device))
            except RuntimeError:  # one damaged or unsupported JPEG fails the whole batch
                pass
            out: list[torch.Tensor | None] = []
            for d in data:
                try:
                    out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    out.append(None)
            return out

    def _pil(self, data: torch.Tensor) -> torch.Tensor | None:
        """PIL's decode (upright) of a JPEG the device refused, on the device; None when PIL
        cannot read it either (a bad sample, as in the PIL path)."""
        try:
            rgb = load_rgb(data.numpy().tobytes())
        except Exception:  # PIL raises many types for damaged data
            return None
        return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1).to(self.device)

    def _crop(self, img: torch.Tensor, box: list[int]) -> torch.Tensor:
        """The PIL path's crop of an upright ``(3, H, W)`` image, on the device."""
        s = self.size
        if not self.train:
            return resize_center_crop(img[None], s, self.crop_pct, self.interpolation)[0]
        left, top, right, bottom = box
        return TF.resized_crop(img, top, left, bottom - top, right - left, [s, s],
                               interpolation=TF.InterpolationMode.BICUBIC,
                               antialias=True)  # fmt: skip


def cpu_decoded_in_pass(loader: object, d: Dist | None = None) -> int | None:
    """Samples PIL decoded in ``loader``'s last pass with ``--decode-device`` set (summed over
    the ranks of ``d``: a collective, every rank calls it); None without a device decoder."""
    decoder = getattr(loader, "decoder", None)
    if not isinstance(decoder, DeviceDecoder):
        return None
    n = decoder.cpu_decoded
    if d is not None and d.world_size > 1:
        n = int(all_reduce_sum(torch.tensor([float(n)], device=d.device), d).item())
    return n
