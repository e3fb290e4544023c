"""``--decode-device``: streamed JPEGs decoded and cropped by the main process on a device (here
the CPU: the same code a GPU runs, nvJPEG aside), against the PIL path in the workers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from lgvit.core.errors import LgvitError
from lgvit.data import device_decode
from lgvit.data.device_decode import cpu_decoded_in_pass, decode_device, upright
from lgvit.data.loader import AugmentConfig
from lgvit.data.splits import FileImageSet
from lgvit.data.stream import make_loader
from lgvit.data.transforms import resize_center_crop
from lgvit.data.wds import ShardLoader, wds_splits

SIZE = 32
# PIL's crop reads pixels just outside its box for the filter's taps, torchvision's clamps at
# the box: border rows differ by a few levels (measured here: mean 0.1-0.3, max 6-12).
MEAN_TOL, MAX_TOL = 1.0, 24


def _photo(w: int, h: int, seed: int) -> Image.Image:
    """A smooth image with some texture (what JPEG is made for; noise would be all edges)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
    arr = np.asarray(small.resize((w, h), Image.Resampling.BICUBIC)).astype(np.int16)
    arr += rng.integers(-12, 12, arr.shape, dtype=np.int16)
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def _jpeg(img: Image.Image, orientation: int = 1, **kw) -> bytes:
    buf = io.BytesIO()
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def samples() -> list[tuple[str, bytes]]:
    """(kind, encoded image): JPEGs of several shapes and kinds, stored sideways with each EXIF
    orientation, and two the device path leaves to PIL (a PNG, a CMYK JPEG)."""
    shapes = [(64, 48), (50, 70), (80, 80), (37, 90), (120, 45), (45, 45)]
    out = [("jpeg", _jpeg(_photo(w, h, i))) for i, (w, h) in enumerate(shapes)]
    out.append(("jpeg", _jpeg(_photo(70, 52, 10), subsampling=0)))  # 4:4:4
    out.append(("jpeg", _jpeg(_photo(66, 58, 11), progressive=True)))
    out.append(("jpeg", _jpeg(_photo(60, 40, 12).convert("L"))))  # greyscale: replicated
    out += [("jpeg", _jpeg(_photo(56, 40, 20 + o), orientation=o)) for o in range(2, 9)]
    png = io.BytesIO()
    _photo(48, 60, 30).save(png, "PNG")
    out.append(("cpu", png.getvalue()))
    out.append(("cpu", _jpeg(_photo(52, 44, 31).convert("CMYK"))))
    return out


def _ext(data: bytes) -> str:
    return "png" if data.startswith(b"\x89PNG") else "jpg"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> FileImageSet:
    root = tmp_path_factory.mktemp("jpegs")
    paths = []
    for i, (_, data) in enumerate(samples()):
        paths.append(str(root / f"{i:02d}.{_ext(data)}"))
        with open(paths[-1], "wb") as f:
            f.write(data)
    return FileImageSet(paths, torch.arange(len(paths)) % 3, ["a", "b", "c"])


def crops(loader) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The uint8 crops, indices and readable masks the loader hands its recipe, one pass."""
    got = []

    def keep(x, y, idx, ok, gen):
        got.append((x.clone(), torch.as_tensor(idx).clone(), ok.clone()))

    loader.recipe_batch = keep
    for _ in loader:
        pass
    return got


def compare(base, dev, *, exact_for: set[int] = frozenset()) -> tuple[float, int]:
    """(mean, max) absolute difference over the readable images, asserting that both passes
    read the same samples, in the same batches, and that ``exact_for`` (PIL-decoded in both
    paths) are equal."""
    diffs = []
    assert len(base) == len(dev)
    for (xa, ia, oka), (xb, ib, okb) in zip(base, dev, strict=True):
        assert torch.equal(ia, ib) and torch.equal(oka, okb)
        for j in oka.nonzero().flatten().tolist():
            d = (xa[j].int() - xb[j].int()).abs()
            if int(ia[j]) in exact_for:
                assert int(d.max()) == 0, f"sample {int(ia[j])} (PIL-decoded) differs"
            diffs.append(d.float())
    every = torch.stack(diffs)
    mean = float(every.mean())
    per_image = every.flatten(1).mean(1)  # a crop from another box would be tens of levels off
    assert float(per_image.max()) < 3 * MEAN_TOL, per_image
    return mean, int(every.max())


def cpu_seen(got, rows: set[int]) -> int:
    """How many of the samples ``rows`` a pass's batches held (train drops a partial batch)."""
    return sum(int(i) in rows for _, idx, _ in got for i in idx)


def _loaders(split, train: bool, **kw):
    aug = AugmentConfig(img_size=SIZE, train_crop="random_resized_crop", mixup=0, cutmix=0)
    make = lambda dd: make_loader(split, 5, num_classes=3, train=train, aug=aug, seed=3,  # noqa: E731
                                  decode_device=dd, **kw)  # fmt: skip
    return make(None), make("cpu")


CPU_KINDS = {i for i, (kind, _) in enumerate(samples()) if kind == "cpu"}


@pytest.mark.parametrize("train", [True, False])
def test_imagefolder_stream_gives_the_pil_paths_crops(folder, train):
    base_loader, dev_loader = _loaders(folder, train, workers=0)
    for epoch in (0, 1):  # other draws each epoch, the same in both paths
        base_loader.set_epoch(epoch)
        dev_loader.set_epoch(epoch)
        got = crops(dev_loader)
        mean, worst = compare(crops(base_loader), got, exact_for=CPU_KINDS)
        assert mean < MEAN_TOL and worst <= MAX_TOL, (mean, worst)
        if not train:  # no box: the same decode, the same resize (libjpeg-turbo both)
            assert worst <= 1, worst
        # the PNG and the CMYK JPEG, those of them the pass read
        assert dev_loader.decoder.cpu_decoded == cpu_seen(got, CPU_KINDS) > 0
        assert cpu_decoded_in_pass(dev_loader) == dev_loader.decoder.cpu_decoded
    assert base_loader.decoder is None and cpu_decoded_in_pass(base_loader) is None


def test_the_device_path_through_a_worker_and_the_recipe(folder):
    """The payload crosses a worker's queue; the recipe's output (flip, RandAugment, erasing:
    the same generator) is the PIL path's within the decoding tolerance."""
    aug = AugmentConfig(img_size=SIZE, train_crop="random_resized_crop", mixup=0, cutmix=0,
                        rand_augment=None, reprob=0.0)  # fmt: skip
    out = []
    for dd in (None, "cpu"):
        loader = make_loader(folder, 6, num_classes=3, train=True, aug=aug, seed=1, workers=1,
                             decode_device=dd)  # fmt: skip
        out.append(torch.cat([x for x, _ in loader]))
    levels = (out[0] - out[1]).abs() * torch.tensor(aug.std).view(1, 3, 1, 1) * 255
    assert out[0].shape == (18, 3, SIZE, SIZE)
    assert float(levels.mean()) < MEAN_TOL and float(levels.max()) <= MAX_TOL + 1


def test_every_exif_orientation_is_turned_as_pil_turns_it():
    arr = np.random.default_rng(0).integers(0, 255, (5, 7, 3), dtype=np.uint8)
    for orientation in range(1, 9):
        exif_img = Image.fromarray(arr)
        exif_img.getexif()[0x0112] = orientation
        want = np.asarray(ImageOps.exif_transpose(exif_img))
        got = upright(torch.from_numpy(arr).permute(2, 0, 1), orientation).permute(1, 2, 0)
        assert np.array_equal(got.numpy(), want), orientation


def test_an_exif_rotated_jpeg_is_upright(folder):
    """Stored 56x40 with orientation 6: the device path's eval crop of the upright 40x56
    image, as PIL's -- not the stored one's."""
    turned = next(i for i, p in enumerate(folder.paths)
                  if Image.open(p).getexif().get(0x0112) == 6)  # fmt: skip
    assert Image.open(folder.paths[turned]).size == (56, 40)
    one = FileImageSet([folder.paths[turned]], torch.zeros(1, dtype=torch.long), ["a"])
    aug = AugmentConfig(img_size=SIZE, crop_pct=1.0)
    sideways = make_loader(one, 1, num_classes=1, train=False, aug=aug, workers=0,
                           decode_device="cpu")  # fmt: skip
    [(x, _, _)] = crops(sideways)
    stored = torch.from_numpy(np.array(Image.open(folder.paths[turned]).convert("RGB")))
    as_stored = resize_center_crop(stored.permute(2, 0, 1)[None], SIZE, 1.0)[0]
    pil = np.asarray(ImageOps.exif_transpose(Image.open(folder.paths[turned])).convert("RGB"))
    want = resize_center_crop(torch.from_numpy(pil.copy()).permute(2, 0, 1)[None], SIZE, 1.0)[0]
    assert (x[0].int() - want.int()).abs().max() <= 1
    assert (x[0].float() - as_stored.float()).abs().mean() > 10  # the orientation mattered


def test_a_jpeg_the_device_refuses_is_decoded_by_pil_and_counted(folder, monkeypatch):
    real = device_decode.decode_jpeg

    def refuse_progressive(data, **kw):  # nvJPEG refuses some JPEGs libjpeg reads
        if isinstance(data, list):
            if any(_progressive(d) for d in data):
                raise RuntimeError("unsupported")
            return real(data, **kw)
        if _progressive(data):
            raise RuntimeError("unsupported")
        return real(data, **kw)

    monkeypatch.setattr(device_decode, "decode_jpeg", refuse_progressive)
    base, dev = _loaders(folder, True, workers=0)
    progressive = {7}
    assert _progressive(torch.frombuffer(bytearray(samples()[7][1]), dtype=torch.uint8))
    got = crops(dev)
    mean, worst = compare(crops(base), got, exact_for=CPU_KINDS)  # cropped on the device
    assert mean < MEAN_TOL and worst <= MAX_TOL
    assert dev.decoder.cpu_decoded == cpu_seen(got, CPU_KINDS | progressive)
    assert cpu_seen(got, progressive) == 1


def _progressive(data: torch.Tensor) -> bool:
    return b"\xff\xc2" in data.numpy().tobytes()  # SOF2: a progressive JPEG's frame


def test_a_truncated_jpeg_is_a_bad_sample_on_the_device_path_too(folder, tmp_path):
    data = open(folder.paths[0], "rb").read()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])  # its header whole
    paths = [str(tmp_path / "cut.jpg"), *folder.paths[1:4]]
    split = FileImageSet(paths, torch.zeros(4, dtype=torch.long), ["a"])
    got = []
    for dd in (None, "cpu"):
        loader = make_loader(split, 4, num_classes=1, train=False, workers=0, decode_device=dd,
                             aug=AugmentConfig(img_size=SIZE), max_bad_fraction=1.0)  # fmt: skip
        got.append(crops(loader))
        assert (loader.bad, loader.first_bad) == (1, paths[0])
    assert torch.equal(got[0][0][2], got[1][0][2])


@pytest.mark.parametrize("train", [True, False])
def test_wds_shards_give_the_pil_paths_crops(tmp_path, train):
    from test_wds import write_shard

    members = [(f"s{i:03d}", {_ext(data): data,
                "cls": str(i % 3).encode()}) for i, (_, data) in enumerate(samples())]  # fmt: skip
    for split_name in ("train", "validation"):
        for s in range(2):
            write_shard(tmp_path / f"toy-{split_name}-{s:02d}.tar", members[s::2])
    keys = dict(train_split=None, val_split=None, input_key=None, target_key=None)
    splits = wds_splits(str(tmp_path), cache=tmp_path / "cache", max_bad_fraction=0.05, **keys)
    split = splits.train if train else splits.test
    aug = AugmentConfig(img_size=SIZE, mixup=0, cutmix=0)
    make = lambda dd: ShardLoader(split, 4, num_classes=3, train=train, aug=aug, seed=2,  # noqa: E731
                                  workers=1, shuffle=8, decode_device=dd)  # fmt: skip
    base, dev = make(None), make("cpu")
    cpu_rows = {i for i in range(len(split)) if int(split.name(i)[-3:]) in CPU_KINDS}
    got = crops(dev)
    mean, worst = compare(crops(base), got, exact_for=cpu_rows)
    assert mean < MEAN_TOL and worst <= MAX_TOL, (mean, worst)
    assert dev.decoder.cpu_decoded == cpu_seen(got, cpu_rows) > 0


def test_hfds_rows_give_the_pil_paths_crops(tmp_path):
    datasets = pytest.importorskip("datasets")
    from lgvit.data.hfds import hfds_splits

    made = samples()
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["a", "b", "c"])})  # fmt: skip
    rows = {"image": [{"bytes": d, "path": None} for _, d in made],
            "label": [i % 3 for i in range(len(made))]}  # fmt: skip
    ds = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict(train=ds, validation=ds).save_to_disk(str(tmp_path / "saved"))
    splits = hfds_splits(str(tmp_path / "saved"), train_split=None, val_split=None,
                         input_key=None, target_key=None, max_bad_fraction=0.05)  # fmt: skip
    for train in (True, False):
        base, dev = _loaders(splits.train if train else splits.test, train, workers=0)
        got = crops(dev)
        mean, worst = compare(crops(base), got, exact_for=CPU_KINDS)
        assert mean < MEAN_TOL and worst <= MAX_TOL, (mean, worst)
        assert dev.decoder.cpu_decoded == cpu_seen(got, CPU_KINDS) > 0


def test_decode_device_cuda_without_cuda_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LgvitError, match="--decode-device cuda: no CUDA device"):
        decode_device("cuda", torch.device("cpu"))
    with pytest.raises(LgvitError, match="--decode-device must be one of none, cpu, cuda"):
        decode_device("gpu", torch.device("cpu"))
    assert decode_device("none", torch.device("cpu")) is None
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", "--model", "lsa_micro_cifar", "--data",
         "synthetic", "--epochs", "1", "--decode-device", "cuda", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr[-2000:]
    assert "--decode-device cuda: no CUDA device" in err[0]


def test_train_cli_decodes_on_the_device_and_counts_pils_share(tmp_path):
    """``--decode-device cpu`` through ``lgvit train`` on a streamed folder: the PNGs PIL
    decoded are the epoch's count, in metrics.jsonl and in its line."""
    for split in ("train", "val"):
        for c, cls in enumerate(("ant", "bee")):
            (tmp_path / "d" / split / cls).mkdir(parents=True)
            for i in range(6):
                img = _photo(40 + 4 * i, 36, 10 * c + i)
                img.save(tmp_path / "d" / split / cls / f"{i}.{'png' if i == 0 else 'jpg'}")
    run = tmp_path / "r"
    p = subprocess.run(
        [sys.executable, "-m", "lgvit", "train", "--model", "lsa_micro_cifar", "--img-size", "16",
         "--data", "imagefolder", "--data-dir", str(tmp_path / "d"), "--epochs", "1",
         "--batch-size", "4", "--out", str(run), "--set", "stream=true", "--set", "workers=1",
         "--decode-device", "cpu", "--set", f"cache_dir={tmp_path / 'c'}", "--aa", "none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["train_cpu_decoded"] == 2  # the two PNGs: all 12 images make 3 batches of 4
    log = (run / "train.log").read_text()
    assert f"{row['train_cpu_decoded']} decoded by PIL (not JPEG)" in log
