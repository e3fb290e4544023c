"""Tests for lgvit.data.datasets: tiny fixtures built on the fly, never real data in the repo."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import re
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lgvit.core.errors import LgvitError
from lgvit.data import archives, cifar, decode
from lgvit.data import datasets as ds
from lgvit.data.datasets import dataset_names, load_dataset, safe_extract

REAL_CIFAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg.tar.gz"

# --------------------------------------------------------------------------------------------
# fixture helpers
# --------------------------------------------------------------------------------------------


def _batch(n: int, seed: int, label_key: bytes, num_classes: int) -> dict:
    """One official-format batch dict: numpy uint8 (n, 3072) data, like the real pickles."""
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": f"batch {seed}".encode(),
        label_key: rng.integers(0, num_classes, n).tolist(),
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }


def _dump(obj: object, path: Path) -> None:
    # Protocol 3: text GLOBAL opcodes and no framing, like the official (protocol 2) files, but
    # with real bytes objects instead of protocol 2's _codecs.encode calls for Python 3 bytes.
    path.write_bytes(pickle.dumps(obj, protocol=3))


def _tar_dir(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(folder, arcname=folder.name)
    return archive


def _write_cifar10(root: Path, per_batch: int = 3) -> dict:
    """cifar-10-batches-py/ and cifar-10-python.tar.gz under ``root``; returns the contents."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {f"data_batch_{i}": _batch(per_batch, i, b"labels", 10) for i in range(1, 6)}
    batches["test_batch"] = _batch(per_batch + 1, 99, b"labels", 10)
    for name, batch in batches.items():
        _dump(batch, folder / name)
    names = [n.encode() for n in ds.CIFAR10_CLASSES]
    _dump({b"label_names": names, b"num_cases_per_batch": per_batch}, folder / "batches.meta")
    archive = _tar_dir(folder, root / "cifar-10-python.tar.gz")
    train = [batches[f"data_batch_{i}"] for i in range(1, 6)]
    return {
        "folder": folder,
        "archive": archive,
        "train_data": np.concatenate([b[b"data"] for b in train]),
        "train_labels": np.concatenate([b[b"labels"] for b in train]),
        "test_data": batches["test_batch"][b"data"],
        "test_labels": np.array(batches["test_batch"][b"labels"]),
    }


def _rgb_png(path: Path, color: tuple[int, int, int], size: tuple[int, int] = (8, 8)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def _make_tree(
    root: Path,
    splits: tuple[str, ...] = ("train", "val"),
    classes: tuple[str, ...] = ("a", "b", "c"),
    n: int = 4,
    size: tuple[int, int] = (8, 8),
) -> Path:
    for s, split in enumerate(splits):
        for c, cls in enumerate(classes):
            for i in range(n):
                color = (10 * c + i, 40 * s + 1, 200 - i)
                _rgb_png(root / split / cls / f"{i:03d}.png", color, size)
    return root


def _load_tree(root: Path, tmp_path: Path, **kw) -> ds.DatasetSplits:
    return load_dataset("imagefolder", str(root), cache_dir=str(tmp_path / "cache"), **kw)


def _tar_with(tmp_path: Path, members: list[tarfile.TarInfo], data: bytes = b"x") -> Path:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tf:
        for m in members:
            if m.isfile():
                m.size = len(data)
                tf.addfile(m, io.BytesIO(data))
            else:
                tf.addfile(m)
    return archive


def _member(name: str, type_: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    info.mode = 0o755 if type_ == tarfile.DIRTYPE else 0o644
    return info


# --------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------


def test_dataset_names_and_unknown_name():
    assert dataset_names() == [
        "cifar10",
        "cifar100",
        "imagefolder",
        "wds",
        "hfds",
        "digits",
        "synthetic",
    ]
    with pytest.raises(LgvitError, match="unknown dataset 'mnist'.*cifar10.*synthetic"):
        load_dataset("mnist")


# --------------------------------------------------------------------------------------------
# CIFAR
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["archive", "archive_dir", "folder", "folder_parent"])
def test_cifar10_loads_from_archive_dir_or_folder(tmp_path, where):
    fx = _write_cifar10(tmp_path / "data")
    if where == "folder_parent":
        fx["archive"].unlink()  # only the extracted folder is left in the parent
    data_dir = {
        "archive": fx["archive"],
        "archive_dir": fx["archive"].parent,
        "folder": fx["folder"],
        "folder_parent": fx["folder"].parent,
    }[where]
    if where == "archive_dir":
        import shutil

        shutil.rmtree(fx["folder"])  # force the archive to be used

    d = load_dataset("cifar10", str(data_dir), cache_dir=str(tmp_path / "cache"), download=False)

    assert d.name == "cifar10" and d.skipped == []
    assert d.mean == ds.CIFAR10_MEAN and d.std == ds.CIFAR10_STD
    assert d.train.classes == list(ds.CIFAR10_CLASSES) == d.test.classes
    assert d.train.images.shape == (15, 3, 32, 32) and d.test.images.shape == (4, 3, 32, 32)
    assert d.train.images.dtype == torch.uint8 and d.train.labels.dtype == torch.int64
    assert d.train.images.is_contiguous() and len(d.train) == 15 and len(d.test) == 4
    assert d.train.labels.tolist() == fx["train_labels"].tolist()
    assert d.test.labels.tolist() == fx["test_labels"].tolist()
    data = fx["train_data"]
    for n, c, y, x in [(0, 0, 0, 0), (4, 1, 5, 7), (14, 2, 31, 31), (9, 2, 0, 31)]:
        assert d.train.images[n, c, y, x].item() == data[n, c * 1024 + y * 32 + x]
    assert np.array_equal(d.test.images.reshape(4, -1).numpy(), fx["test_data"])


def test_cifar_accepts_legacy_numpy_core_pickles(tmp_path):
    # The official files were written by numpy 1.x, naming numpy.core.multiarray._reconstruct.
    fx = _write_cifar10(tmp_path)
    for f in fx["folder"].iterdir():
        raw = f.read_bytes()
        new = raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
        assert new != raw or f.name == "batches.meta"
        f.write_bytes(new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy deprecation noise either
        d = load_dataset("cifar10", str(fx["folder"]), cache_dir=str(tmp_path / "c"))
    assert d.train.images.reshape(15, -1).numpy().tolist() == fx["train_data"].tolist()


def test_cifar100_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train, test = _batch(7, 1, b"fine_labels", 100), _batch(5, 2, b"fine_labels", 100)
    train[b"coarse_labels"] = [0] * 7
    test[b"coarse_labels"] = [0] * 5
    _dump(train, folder / "train")
    _dump(test, folder / "test")
    names = [f"class{i:02d}".encode() for i in range(100)]
    _dump({b"fine_label_names": names, b"coarse_label_names": [b"x"] * 20}, folder / "meta")
    archive = _tar_dir(folder, tmp_path / "cifar-100-python.tar.gz")

    d = load_dataset("cifar100", str(archive), cache_dir=str(tmp_path / "c"))
    assert d.train.images.shape == (7, 3, 32, 32) and d.test.images.shape == (5, 3, 32, 32)
    assert d.train.labels.tolist() == train[b"fine_labels"]
    assert d.test.labels.tolist() == test[b"fine_labels"]
    assert len(d.train.classes) == 100 and d.train.classes[3] == "class03"
    assert d.mean == ds.CIFAR100_MEAN and d.std == ds.CIFAR100_STD
    assert d.train.images[6, 1, 2, 3].item() == train[b"data"][6, 1024 + 2 * 32 + 3]


def _fake_remote(archive: Path, monkeypatch, md5: str | None = None) -> None:
    """Serve ``archive`` as the CIFAR-10 download via a file:// URL (no network needed)."""
    spec = cifar.CIFAR_SPECS["cifar10"]
    new = dataclasses.replace(spec, url=archive.as_uri(), md5=md5 or spec.md5)
    monkeypatch.setitem(cifar.CIFAR_SPECS, "cifar10", new)


def test_cifar_download_md5_mismatch_deletes_file(tmp_path, monkeypatch):
    fake = _write_cifar10(tmp_path / "remote")["archive"]
    _fake_remote(fake, monkeypatch)  # the real md5, so this fake must be rejected
    cache = tmp_path / "cache"
    with pytest.raises(LgvitError) as err:
        load_dataset("cifar10", cache_dir=str(cache))
    msg = str(err.value)
    assert "md5 mismatch" in msg and "cifar-10-python.tar.gz" in msg
    assert "c58f30108f718f92721af3b95e74349a" in msg
    assert hashlib.md5(fake.read_bytes()).hexdigest() in msg
    assert "\n" not in msg
    assert list(cache.iterdir()) == []  # neither the archive nor a partial download is left


def test_cifar_download_with_matching_md5_then_reuses_cache(tmp_path, monkeypatch):
    remote = _write_cifar10(tmp_path / "remote")["archive"]
    md5 = hashlib.md5(remote.read_bytes()).hexdigest()
    _fake_remote(remote, monkeypatch, md5=md5)
    cache = tmp_path / "cache"
    d = load_dataset("cifar10", cache_dir=str(cache))
    assert (cache / "cifar-10-python.tar.gz").read_bytes() == remote.read_bytes()
    remote.unlink()  # the second call must not touch the "network"
    d2 = load_dataset("cifar10", cache_dir=str(cache), download=False)
    assert torch.equal(d.train.images, d2.train.images)


def test_cifar_corrupt_archive_in_cache_is_refused(tmp_path):
    cache = tmp_path / "cache"
    _write_cifar10(cache)  # same file name as the real archive, different md5
    import shutil

    shutil.rmtree(cache / "cifar-10-batches-py")
    with pytest.raises(LgvitError, match="md5 mismatch for .*cifar-10-python.tar.gz.*expected"):
        load_dataset("cifar10", cache_dir=str(cache))
    assert not (cache / "cifar-10-python.tar.gz").exists()


def test_cifar_network_failure_says_data_dir(tmp_path, monkeypatch):
    spec = cifar.CIFAR_SPECS["cifar10"]
    url = (tmp_path / "nowhere.tar.gz").as_uri()
    monkeypatch.setitem(cifar.CIFAR_SPECS, "cifar10", dataclasses.replace(spec, url=url))
    with pytest.raises(LgvitError, match="could not download .*--data-dir"):
        load_dataset("cifar10", cache_dir=str(tmp_path / "cache"))
    assert not any((tmp_path / "cache").glob("*"))


def test_cifar_not_found_errors(tmp_path):
    with pytest.raises(LgvitError, match="download is off"):
        load_dataset("cifar10", cache_dir=str(tmp_path / "c"), download=False)
    with pytest.raises(LgvitError, match="data dir not found"):
        load_dataset("cifar10", str(tmp_path / "missing"), cache_dir=str(tmp_path / "c"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LgvitError, match="no cifar10 data in .*empty"):
        load_dataset("cifar10", str(tmp_path / "empty"), cache_dir=str(tmp_path / "c"))
    fx = _write_cifar10(tmp_path / "partial")
    (fx["folder"] / "test_batch").unlink()
    with pytest.raises(LgvitError, match="incomplete CIFAR folder .*missing test_batch"):
        load_dataset("cifar10", str(fx["folder"]), cache_dir=str(tmp_path / "c"))


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo hi > {self.marker}",))


def test_restricted_unpickler_refuses_os_system(tmp_path, capfd):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _Evil(marker)})
    with pytest.raises(LgvitError, match=r"evil.pkl: refusing to unpickle (posix|nt|os)\.system"):
        ds.safe_unpickle(payload, "evil.pkl")
    assert not marker.exists()
    assert "hi" not in capfd.readouterr().out
    # and through the loader, naming the offending file
    fx = _write_cifar10(tmp_path / "d")
    (fx["folder"] / "data_batch_3").write_bytes(payload)
    with pytest.raises(LgvitError, match="data_batch_3: refusing to unpickle"):
        load_dataset("cifar10", str(fx["folder"]), cache_dir=str(tmp_path / "c"))
    assert not marker.exists()


def test_restricted_unpickler_allows_plain_data_and_arrays():
    obj = {b"a": [1, 2.5, b"x", "y", None, (True,)], b"arr": np.arange(6, dtype=np.uint8)}
    out = ds.safe_unpickle(pickle.dumps(obj), "ok.pkl")
    assert out[b"a"] == obj[b"a"] and np.array_equal(out[b"arr"], obj[b"arr"])
    with pytest.raises(LgvitError, match="refusing to unpickle collections.OrderedDict"):
        ds.safe_unpickle(pickle.dumps(__import__("collections").OrderedDict(a=1)), "od.pkl")
    with pytest.raises(LgvitError, match="trunc.pkl: not a readable pickle"):
        ds.safe_unpickle(pickle.dumps(obj)[:20], "trunc.pkl")


# --------------------------------------------------------------------------------------------
# safe extraction
# --------------------------------------------------------------------------------------------


def test_safe_extract_normal_archive(tmp_path):
    src = tmp_path / "top"
    _rgb_png(src / "sub" / "a.png", (1, 2, 3))
    (src / "link").symlink_to("sub/a.png")  # a symlink that stays inside is fine
    archive = _tar_dir(src, tmp_path / "ok.tar.gz")
    out = safe_extract(archive, tmp_path / "out")
    assert (out / "top" / "sub" / "a.png").read_bytes() == (src / "sub" / "a.png").read_bytes()
    assert (out / "top" / "link").is_symlink()


@pytest.mark.parametrize(
    "members, reason",
    [
        ([_member("../evil")], "outside the destination"),
        ([_member("ok/../../evil")], "outside the destination"),
        ([_member("/tmp/abs_evil")], "absolute path"),
        ([_member("link", tarfile.SYMTYPE, "../outside")], "symlink to '../outside'"),
        ([_member("link", tarfile.SYMTYPE, "/etc/passwd")], "symlink to '/etc/passwd'"),
        ([_member("hard", tarfile.LNKTYPE, "../../etc/passwd")], "hard link"),
        ([_member("dev", tarfile.CHRTYPE)], "device file"),
        ([_member("fifo", tarfile.FIFOTYPE)], "device file or FIFO"),
        # each link alone looks harmless lexically; only resolving the first catches the second
        (
            [
                _member("d", tarfile.DIRTYPE),
                _member("d/up", tarfile.SYMTYPE, ".."),
                _member("d/up/esc", tarfile.SYMTYPE, ".."),
            ],
            "symlink to '..'",
        ),
        (
            [
                _member("d", tarfile.DIRTYPE),
                _member("d/up", tarfile.SYMTYPE, ".."),
                _member("d/up/../evil"),
            ],
            "outside the destination",
        ),
    ],
)
@pytest.mark.parametrize("data_filter", [True, False], ids=["with_filter", "own_checks_only"])
def test_safe_extract_refuses_escapes(tmp_path, monkeypatch, members, reason, data_filter):
    if not data_filter:  # as on Pythons without tarfile's filters: our checks must suffice
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    archive = _tar_with(tmp_path, members)
    dest = tmp_path / "a" / "b" / "dest"
    with pytest.raises(LgvitError) as err:
        safe_extract(archive, dest)
    msg = str(err.value)
    assert reason in msg and repr(members[-1].name) in msg and "\n" not in msg
    assert not (tmp_path / "a" / "b" / "evil").exists()
    assert not (tmp_path / "a" / "evil").exists()


# --------------------------------------------------------------------------------------------
# imagefolder
# --------------------------------------------------------------------------------------------


def test_imagefolder_basic_and_test_dir_instead_of_val(tmp_path):
    root = _make_tree(tmp_path / "tree", splits=("train", "test"), n=3)
    (root / "train" / "a" / "notes.txt").write_text("not an image")
    (root / "train" / "a" / ".hidden.png").write_bytes(b"")
    (root / "train" / ".ipynb_checkpoints").mkdir()
    d = _load_tree(root, tmp_path)
    assert d.train.classes == ["a", "b", "c"] == d.test.classes
    assert d.train.images.shape == (9, 3, 8, 8) and d.test.images.shape == (9, 3, 8, 8)
    assert d.train.images.dtype == torch.uint8 and d.train.images.is_contiguous()
    assert d.train.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert d.train.images[4, :, 3, 3].tolist() == [11, 1, 199]  # class b, image 1
    assert d.test.images[8, :, 0, 0].tolist() == [22, 41, 198]
    assert d.mean == ds.IMAGENET_MEAN and d.std == ds.IMAGENET_STD and d.skipped == []


def test_imagefolder_odd_modes_convert_to_rgb(tmp_path):
    root = _make_tree(tmp_path / "tree", n=1)
    a, b = root / "train" / "a", root / "train" / "b"
    expected = {}

    Image.new("L", (8, 8), 100).save(a / "gray.png")
    expected[a / "gray.png"] = (100, 100, 100)
    Image.new("LA", (8, 8), (70, 0)).save(a / "la.png")
    expected[a / "la.png"] = (70, 70, 70)
    Image.new("1", (8, 8), 1).save(a / "onebit.png")
    expected[a / "onebit.png"] = (255, 255, 255)
    Image.new("RGBA", (8, 8), (10, 20, 30, 0)).save(a / "rgba.png")
    expected[a / "rgba.png"] = (10, 20, 30)  # alpha dropped, colour kept
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(b / "cmyk.jpg", quality=95)
    expected[b / "cmyk.jpg"] = (255, 0, 0)
    sixteen = np.full((8, 8), 65535, dtype=np.uint16)
    sixteen[0, 0] = 25700  # 25700 / 257 = 100
    img16 = Image.fromarray(sixteen)
    assert img16.mode == "I;16"
    img16.save(b / "sixteen.png")
    expected[b / "sixteen.png"] = (255, 255, 255)
    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 200, 50, 25] + [0] * 762)
    pal.save(b / "palette.png", transparency=1)
    expected[b / "palette.png"] = (200, 50, 25)

    d = _load_tree(root, tmp_path)
    order = [p for cls in ("a", "b", "c") for p in sorted((root / "train" / cls).iterdir())]
    assert len(d.train) == len(order) == 10
    for i, path in enumerate(order):
        if path in expected:
            got = d.train.images[i, :, 4, 4].tolist()
            tol = 4 if path.suffix == ".jpg" else 0
            assert np.abs(np.array(got) - expected[path]).max() <= tol, (path.name, got)
    i16 = order.index(b / "sixteen.png")
    assert d.train.images[i16, :, 0, 0].tolist() == [100, 100, 100]


def _add_bad_files(folder: Path) -> list[Path]:
    good = folder / "000.png"
    bad = [folder / "empty.jpg", folder / "trunc.png", folder / "text.jpg"]
    bad[0].write_bytes(b"")
    bad[1].write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    bad[2].write_text("this is not a JPEG at all\n")
    return bad


def test_imagefolder_skips_unreadable_images(tmp_path):
    root = _make_tree(tmp_path / "tree")
    bad = _add_bad_files(root / "train" / "b")
    with pytest.warns(UserWarning, match=r"skipped 3 unreadable image\(s\) of 15"):
        d = _load_tree(root, tmp_path, max_bad_fraction=0.5)
    assert len(d.train) == 12 and len(d.test) == 12
    assert sorted(d.skipped) == sorted(str(p) for p in bad)
    assert d.train.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_imagefolder_too_many_unreadable_raises(tmp_path):
    root = _make_tree(tmp_path / "tree")
    bad = _add_bad_files(root / "val" / "c")
    with pytest.raises(LgvitError) as err:
        _load_tree(root, tmp_path)  # default max_bad_fraction 5%
    msg = str(err.value)
    assert "3 of 15 images" in msg and "20.0%" in msg and str(bad[0]) in msg and "\n" not in msg


def test_imagefolder_layout_errors(tmp_path):
    with pytest.raises(LgvitError, match="imagefolder data dir not found: .*nope"):
        _load_tree(tmp_path / "nope", tmp_path)
    with pytest.raises(LgvitError, match="needs data_dir"):
        load_dataset("imagefolder")

    (tmp_path / "empty").mkdir()
    with pytest.raises(LgvitError, match="no train/ directory in .*empty"):
        _load_tree(tmp_path / "empty", tmp_path)

    only_train = _make_tree(tmp_path / "only_train", splits=("train",))
    with pytest.raises(LgvitError, match="no val/ or test/ directory"):
        _load_tree(only_train, tmp_path)

    no_classes = _make_tree(tmp_path / "no_classes")
    for f in (no_classes / "val").rglob("*.png"):
        f.unlink()
    for c in ("a", "b", "c"):
        (no_classes / "val" / c).rmdir()
    with pytest.raises(LgvitError, match="no class folders in .*val"):
        _load_tree(no_classes, tmp_path)

    no_images = _make_tree(tmp_path / "no_images")
    for f in (no_images / "val").rglob("*.png"):
        f.rename(f.with_suffix(".txt"))
    with pytest.raises(LgvitError, match="no images in .*val"):
        _load_tree(no_images, tmp_path)

    empty_class = _make_tree(tmp_path / "empty_class")
    for f in (empty_class / "train" / "b").iterdir():
        f.unlink()
    with pytest.raises(LgvitError, match="1 class folder.* have no images: b"):
        _load_tree(empty_class, tmp_path)

    mismatch = _make_tree(tmp_path / "mismatch")
    (mismatch / "val" / "c").rename(mismatch / "val" / "zebra")
    with pytest.raises(LgvitError) as err:
        _load_tree(mismatch, tmp_path)
    assert "only in train: c; only in val: zebra" in str(err.value)

    (tmp_path / "file.zip").write_bytes(b"PK")
    with pytest.raises(LgvitError, match="not a .tar.gz/.tgz/.tar archive"):
        _load_tree(tmp_path / "file.zip", tmp_path)


def test_imagefolder_second_load_uses_cache(tmp_path, monkeypatch):
    root = _make_tree(tmp_path / "tree")
    d1 = _load_tree(root, tmp_path)
    before = d1.train.images.clone()
    assert len(list((tmp_path / "cache" / "imagefolder").glob("*.npy"))) == 1

    def boom(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(decode, "_decode_image", boom)
    monkeypatch.setattr(decode, "_decode_chunk", boom)
    d2 = _load_tree(root, tmp_path)
    assert torch.equal(d1.train.images, d2.train.images)
    assert torch.equal(d1.test.labels, d2.test.labels) and d1.train.classes == d2.train.classes
    d2.train.images[0].zero_()  # copy-on-write: the cache file must not change
    d3 = _load_tree(root, tmp_path)
    assert torch.equal(before, d3.train.images) and torch.equal(before, d1.train.images)

    # a changed file list is a different cache entry, so this one must decode (and fail here)
    _rgb_png(root / "train" / "a" / "new.png", (1, 1, 1))
    with pytest.raises(AssertionError, match="decoded again"):
        _load_tree(root, tmp_path)


def test_imagefolder_pool_matches_in_process(tmp_path, monkeypatch):
    root = _make_tree(tmp_path / "tree", n=5)
    _add_bad_files(root / "train" / "a")
    with pytest.warns(UserWarning, match="skipped 3"):
        serial = _load_tree(root, tmp_path / "s", max_bad_fraction=0.5)
    monkeypatch.setattr(decode, "_POOL_MIN_IMAGES", 0)
    monkeypatch.setattr(decode, "_num_workers", lambda: 2)
    with pytest.warns(UserWarning, match="skipped 3"):
        pooled = _load_tree(root, tmp_path / "p", max_bad_fraction=0.5)
    assert torch.equal(serial.train.images, pooled.train.images)
    assert torch.equal(serial.test.images, pooled.test.images)
    assert serial.skipped == pooled.skipped and len(pooled.skipped) == 3


def test_imagefolder_store_size_policy(tmp_path):
    same = _make_tree(tmp_path / "same", n=2, size=(12, 8))  # all 12x8: kept native, W != H
    d = _load_tree(same, tmp_path, img_size=8)
    assert d.train.images.shape == (6, 3, 8, 12)
    d = _load_tree(same, tmp_path, img_size=4)  # 12 > 2 * 4: resized to round(4 / 0.875) = 5
    assert d.train.images.shape == (6, 3, 5, 5)

    mixed = _make_tree(tmp_path / "mixed", n=2)
    _rgb_png(mixed / "val" / "a" / "big.png", (9, 9, 9), (40, 20))
    d = _load_tree(mixed, tmp_path, img_size=14)  # mixed sizes: round(14 / 0.875) = 16
    assert d.train.images.shape == (6, 3, 16, 16) and d.test.images.shape == (7, 3, 16, 16)
    assert d.test.images[2].float().mean().item() == pytest.approx(9, abs=1)  # a/big.png
    assert d.train.images[2, :, 8, 8].tolist() == [10, 1, 200]  # solid colours survive resizing


def test_imagefolder_archive_is_extracted_once(tmp_path, monkeypatch):
    names = list(ds.CIFAR10_CLASSES)
    top = _make_tree(tmp_path / "src" / "cifar10", splits=("train", "test"), classes=names, n=1)
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(top, arcname="cifar10")
    d1 = _load_tree(archive, tmp_path)
    assert d1.train.classes == names and d1.mean == ds.CIFAR10_MEAN and d1.std == ds.CIFAR10_STD
    assert len(d1.train) == 10 and len(d1.test) == 10
    assert len(list((tmp_path / "cache" / "extracted").iterdir())) == 1

    def no_extract(*a, **k):
        raise AssertionError("extracted again")

    monkeypatch.setattr(archives, "safe_extract", no_extract)
    d2 = _load_tree(archive, tmp_path)
    assert torch.equal(d1.test.images, d2.test.images)


def test_imagefolder_evil_archive_is_refused(tmp_path):
    archive = _tar_with(tmp_path, [_member("../escape.png")])
    archive = archive.rename(tmp_path / "evil.tgz")
    with pytest.raises(LgvitError, match="member '../escape.png'"):
        _load_tree(archive, tmp_path)
    assert not (tmp_path / "cache" / "escape.png").exists()
    assert list((tmp_path / "cache" / "extracted").iterdir()) == []  # no half-extracted tree


# --------------------------------------------------------------------------------------------
# digits and synthetic
# --------------------------------------------------------------------------------------------


def test_digits_split_shapes_and_determinism():
    pytest.importorskip("sklearn")
    d = load_dataset("digits")
    assert d.train.images.shape == (1497, 3, 32, 32) and d.test.images.shape == (300, 3, 32, 32)
    assert d.train.classes == [str(i) for i in range(10)]
    assert d.train.images.dtype == torch.uint8 and d.train.images.is_contiguous()
    assert d.train.images.min().item() == 0 and d.train.images.max().item() == 255
    assert torch.equal(d.train.images[:, 0], d.train.images[:, 2])  # grey replicated to RGB
    counts = torch.bincount(d.test.labels, minlength=10)
    assert counts.sum() == 300 and counts.min() >= 28 and counts.max() <= 32  # stratified

    again = load_dataset("digits", seed=123)  # the split ignores `seed` on purpose
    assert torch.equal(d.train.images, again.train.images)
    assert torch.equal(d.test.labels, again.test.labels) and d.mean == again.mean

    x = d.train.images.double() / 255
    assert d.mean[0] == pytest.approx(x.mean().item()) and d.std[0] == pytest.approx(
        x.std().item(), rel=1e-3
    )
    assert load_dataset("digits", img_size=16).train.images.shape == (1497, 3, 16, 16)


def test_digits_without_sklearn(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError("no sklearn")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(LgvitError, match=r'pip install "lgvit\[demo\]"'):
        load_dataset("digits")


def test_synthetic_is_seeded():
    d = load_dataset("synthetic", img_size=16, synthetic_size=(20, 6), num_classes=4, seed=3)
    assert d.train.images.shape == (20, 3, 16, 16) and d.test.images.shape == (6, 3, 16, 16)
    assert d.train.classes == ["0", "1", "2", "3"] and int(d.train.labels.max()) < 4
    assert d.mean == (0.5, 0.5, 0.5) and d.std == (0.5, 0.5, 0.5)
    same = load_dataset("synthetic", img_size=16, synthetic_size=(20, 6), num_classes=4, seed=3)
    other = load_dataset("synthetic", img_size=16, synthetic_size=(20, 6), num_classes=4, seed=4)
    assert torch.equal(d.train.images, same.train.images)
    assert not torch.equal(d.train.images, other.train.images)
    assert load_dataset("synthetic").train.images.shape == (512, 3, 32, 32)
    with pytest.raises(LgvitError, match="synthetic_size"):
        load_dataset("synthetic", synthetic_size=(0, 5))


# --------------------------------------------------------------------------------------------
# real CIFAR-10 (JPEG ImageFolder archive in ../shared/data), checked cheaply
# --------------------------------------------------------------------------------------------


def test_real_cifar10_jpeg_archive_subset(tmp_path):
    if not REAL_CIFAR.is_file():
        pytest.skip(f"real CIFAR-10 not found at {REAL_CIFAR}")
    counts: dict[tuple[str, str], int] = {}
    pattern = re.compile(r"^cifar10/(train|test)/([a-z]+)/\d{4}\.jpg$")
    # One streaming pass over the listing; copy out 2 images per (split, class) to decode.
    with tarfile.open(REAL_CIFAR, "r:gz") as tf:
        for m in tf:
            if not m.isfile():
                continue
            match = pattern.match(m.name)
            assert match, m.name
            key = (match.group(1), match.group(2))
            counts[key] = counts.get(key, 0) + 1
            if counts[key] <= 2:
                out = tmp_path / "subset" / m.name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tf.extractfile(m).read())
    assert {c for _, c in counts} == set(ds.CIFAR10_CLASSES)
    assert all(counts[("train", c)] == 5000 for c in ds.CIFAR10_CLASSES)
    assert all(counts[("test", c)] == 1000 for c in ds.CIFAR10_CLASSES)

    d = _load_tree(tmp_path / "subset" / "cifar10", tmp_path)
    assert d.train.images.shape == (20, 3, 32, 32) and d.test.images.shape == (20, 3, 32, 32)
    assert d.train.classes == list(ds.CIFAR10_CLASSES) and d.mean == ds.CIFAR10_MEAN
    assert d.skipped == [] and 40 < d.train.images.float().mean().item() < 220
