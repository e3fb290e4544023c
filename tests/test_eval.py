"""``lgvit eval`` as the papers evaluate: the model's own preprocessing, test-only image folders
(ImageNet-V2's layout) in natural class order, timm's class maps, ImageNet-ReaL accuracy and
the predictions file -- each checked against an independent computation."""

from __future__ import annotations

import csv
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T2
from PIL import Image

import lgvit
from lgvit.cli import main
from lgvit.core.constants import IMAGENET_MEAN, IMAGENET_STD
from lgvit.core.errors import LgvitError
from lgvit.data.datasets import load_dataset, load_test_split
from lgvit.data.imagefolder import natural_key


def write_images(folder: Path, n: int, seed: int, size=(40, 52), name=None) -> list[Path]:
    """``n`` random RGB images (H, W = ``size``) as PNGs in ``folder``."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for j in range(n):
        p = folder / (name(j) if name else f"img{j}.png")
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(p)
        out.append(p)
    return out


def v2_folder(root: Path, classes: int = 12, per_class: int = 2) -> list[Path]:
    """ImageNet-V2's layout: class folders ``0`` ... ``classes-1``, no train/val; files named
    as ImageNet's validation images (for the ReaL labels)."""
    files = []
    for c in range(classes):
        files += write_images(
            root / str(c), per_class, seed=c, size=(36 + 3 * c, 48),
            name=lambda j, c=c: f"ILSVRC2012_val_{c * per_class + j + 1:08d}.png",
        )  # fmt: skip
    return files


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(capsys, args: list[str], *needles: str) -> None:
    code, _, err = run_cli(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


# ------------------------------------------------------------------------------- data layouts


def test_class_folders_sort_naturally_as_timm():
    names = ["10", "2", "1", "0", "a10", "a2", "B1", "b0"]
    assert sorted(names, key=natural_key) == ["0", "1", "2", "10", "a2", "a10", "b0", "B1"]


def test_v2_layout_is_read_in_natural_order(tmp_path):
    v2_folder(tmp_path / "v2")
    split = load_test_split("imagefolder", str(tmp_path / "v2"), cache_dir=str(tmp_path / "c"))
    assert split.classes == [str(c) for c in range(12)]  # "10" after "9", not after "1"
    # each image's label is its folder's number, as V2's folders are ImageNet's indices
    assert [int(Path(p).parent.name) for p in split.paths] == split.labels.tolist()


def test_training_folders_sort_naturally_too(tmp_path):
    for split in ("train", "val"):
        for c in ("1", "2", "10"):
            write_images(tmp_path / "d" / split / c, 1, seed=int(c), size=(8, 8))
    s = load_dataset("imagefolder", str(tmp_path / "d"), cache_dir=str(tmp_path / "c"))
    assert s.train.classes == s.test.classes == ["1", "2", "10"]


def test_test_only_layouts(tmp_path):
    write_images(tmp_path / "only_val" / "val" / "cat", 1, 0)
    write_images(tmp_path / "only_val" / "val" / "dog", 1, 1)
    v2_folder(tmp_path / "wrap" / "imagenetv2-matched-frequency-format-val", classes=3)
    write_images(tmp_path / "train_only" / "train" / "cat", 1, 2)
    with tarfile.open(tmp_path / "v2.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "wrap", arcname="wrap")
    cache = str(tmp_path / "cache")
    assert load_test_split("imagefolder", str(tmp_path / "only_val"), cache_dir=cache).classes \
        == ["cat", "dog"]  # fmt: skip
    for root in (tmp_path / "wrap", tmp_path / "v2.tar.gz"):  # a lone wrapper folder
        assert load_test_split("imagefolder", str(root), cache_dir=cache).classes == ["0", "1", "2"]
    with pytest.raises(LgvitError, match="has train/ but no val/ or test/"):
        load_test_split("imagefolder", str(tmp_path / "train_only"), cache_dir=cache)


def test_class_map_sets_the_indices(tmp_path):
    for c in ("cat", "dog", "owl"):
        write_images(tmp_path / "d" / c, 1, seed=len(c) + ord(c[0]))
    names = tmp_path / "names.txt"
    names.write_text("owl\ncat\ndog\n")  # one name per line: the line is the index
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("dog 0\nowl 1\ncat 2\nbat 3\n")  # 'name index'; a class with no folder
    cache = str(tmp_path / "c")
    s = load_test_split("imagefolder", str(tmp_path / "d"), cache_dir=cache, class_map=str(names))
    assert s.classes == ["owl", "cat", "dog"]
    assert {Path(p).parent.name: int(y) for p, y in zip(s.paths, s.labels, strict=True)} == {
        "owl": 0, "cat": 1, "dog": 2}  # fmt: skip
    s = load_test_split("imagefolder", str(tmp_path / "d"), cache_dir=cache, class_map=str(pairs))
    assert s.classes == ["dog", "owl", "cat", "bat"]
    assert {Path(p).parent.name: int(y) for p, y in zip(s.paths, s.labels, strict=True)} == {
        "dog": 0, "owl": 1, "cat": 2}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cat\ndog\n", "not in the class map: owl"),  # a folder the map does not name
        ("cat 0\ndog\nowl 2\n", "line 2: mixes"),
        ("cat\ndog\ncat\nowl\n", "line 3: class 'cat' listed twice"),
        ("cat 0\ndog 2\nowl 3\n", "indices must be 0 ... 2"),
        ("\n\n", "no class names"),
    ],
)
def test_bad_class_maps_are_one_line(tmp_path, text, needle):
    for c in ("cat", "dog", "owl"):
        write_images(tmp_path / "d" / c, 1, seed=1)
    (tmp_path / "map.txt").write_text(text)
    with pytest.raises(LgvitError, match=needle):
        load_test_split("imagefolder", str(tmp_path / "d"), cache_dir=str(tmp_path / "c"),
                        class_map=str(tmp_path / "map.txt"))  # fmt: skip


# ------------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory):
    """A 12-class micro LSA at 16 px (random weights, a plain .pth) and a V2-layout folder."""
    root = tmp_path_factory.mktemp("v2eval")
    files = v2_folder(root / "v2")
    torch.manual_seed(0)
    model = lgvit.create_model("lsa_micro_cifar", num_classes=12, img_size=16)
    torch.save(model.state_dict(), root / "m.pth")
    return root, files


def eval_args(root: Path, *more: str) -> list[str]:
    return ["eval", "--model", "lsa_micro_cifar", "--img-size", "16", "--checkpoint",
            str(root / "m.pth"), "--data", "imagefolder", "--data-dir", str(root / "v2"),
            "--cache-dir", str(root / "cache"), "-j", "0", *more]  # fmt: skip


def test_real_and_predictions_against_an_independent_computation(capsys, v2_checkpoint):
    root, files = v2_checkpoint
    rng = np.random.default_rng(3)
    # A ReaL file for 30 validation images (more than the folder holds): several labels per
    # image, some images without any (left out of ReaL), one with its V2 label among others.
    real = [sorted(set(rng.integers(0, 12, rng.integers(0, 4)).tolist())) for _ in range(30)]
    (root / "real.json").write_text(json.dumps(real))
    code, out, err = run_cli(capsys, *eval_args(root, "--real-labels", str(root / "real.json"),
                             "--predictions", str(root / "p.csv"), "--json"))  # fmt: skip
    assert code == 0, err
    res = json.loads(out)
    rows = list(csv.DictReader((root / "p.csv").open()))
    assert len(rows) == res["count"] == len(files) == 24
    assert res["classes"] == [str(c) for c in range(12)]
    top = [[int(r[f"top{i}"]) for i in range(1, 6)] for r in rows]
    label = [int(r["label"]) for r in rows]
    assert label == [int(Path(r["image"]).parent.name) for r in rows]
    pairs = list(zip(top, label, strict=True))
    assert res["acc1"] == pytest.approx(100 * np.mean([t[0] == y for t, y in pairs]))
    assert res["acc5"] == pytest.approx(100 * np.mean([y in t for t, y in pairs]))
    # ReaL by hand: image ILSVRC2012_val_0000000k is entry k-1; empty entries are left out
    sets = [real[int(Path(r["image"]).stem[-8:]) - 1] for r in rows]
    kept = [(t, s) for t, s in zip(top, sets, strict=True) if s]
    assert res["real_count"] == len(kept) < len(rows)
    assert res["real_acc1"] == pytest.approx(100 * np.mean([t[0] in s for t, s in kept]))
    assert res["real_acc5"] == pytest.approx(100 * np.mean([any(p in s for p in t)
                                                            for t, s in kept]))  # fmt: skip
    probs = np.array([[float(r[f"prob{i}"]) for i in range(1, 6)] for r in rows])
    assert (np.diff(probs, axis=1) <= 0).all() and (probs.sum(1) <= 1 + 1e-5).all()
    assert res["preprocessing"]["input_size"] == [3, 16, 16]


def test_bad_real_labels_are_one_line(capsys, v2_checkpoint, tmp_path):
    root, _ = v2_checkpoint
    cases = {
        "notjson.json": ("[[1], [2", "not a readable JSON file"),
        "dict.json": ('{"a": 1}', "expected a JSON list of label lists"),
        "entry.json": ('[[1], "x"]', "entry 1 (ILSVRC2012_val_00000002)"),
        "short.json": ("[[1], [2]]", "no entry for image"),
        "big.json": (json.dumps([[99]] * 24), "beyond the model's 12 classes"),
    }
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_text(text)
        one_line(capsys, eval_args(root, "--real-labels", str(tmp_path / name)), name, needle)
    (tmp_path / "map.txt").write_text("\n".join(str(c) for c in range(11)))
    one_line(capsys, eval_args(root, "--class-map", str(tmp_path / "map.txt")),
             "not in the class map: 11")  # fmt: skip


def timm_style_logits(model, paths, size: int, crop_pct: float) -> torch.Tensor:
    """The eval pipeline written independently with torchvision's transforms, as timm builds it:
    Resize(floor(size / crop_pct)) of the shorter side (bicubic), CenterCrop, Normalize."""
    tf = T2.Compose([
        T2.PILToTensor(),
        T2.Resize(math.floor(size / crop_pct), interpolation=T2.InterpolationMode.BICUBIC,
                  antialias=True),
        T2.CenterCrop(size),
        T2.ToDtype(torch.float32, scale=True),
        T2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])  # fmt: skip
    x = torch.stack([tf(Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        return model.eval()(x)


def test_eval_preprocesses_as_the_model_was_trained(capsys, tmp_path):
    """T2T-ViT-7 is evaluated with crop 0.9 (as its authors): the CLI's probabilities equal
    the model run on the images preprocessed by hand; --crop-pct overrides it."""
    assert lgvit.get_model_config("t2t_vit_7").crop_pct == 0.9
    for c in range(3):
        write_images(tmp_path / "d" / "val" / f"c{c}", 2, seed=10 + c, size=(45 + 7 * c, 60))
    torch.manual_seed(0)
    model = lgvit.create_model("t2t_vit_7", num_classes=3, img_size=32)
    torch.save(model.state_dict(), tmp_path / "t2t.pth")
    base = ["eval", "--model", "t2t_vit_7", "--img-size", "32", "--checkpoint",
            str(tmp_path / "t2t.pth"), "--data", "imagefolder", "--data-dir", str(tmp_path / "d"),
            "-j", "0", "--amp", "none", "--json"]  # fmt: skip
    for crop in (None, 0.875):
        more = ["--crop-pct", str(crop)] if crop else []
        pred = tmp_path / f"p{crop}.csv"
        code, out, err = run_cli(capsys, *base, *more, "--predictions", str(pred))
        assert code == 0, err
        assert json.loads(out)["preprocessing"]["crop_pct"] == (crop or 0.9)
        rows = list(csv.DictReader(pred.open()))
        ref = timm_style_logits(model, [r["image"] for r in rows], 32, crop or 0.9).softmax(-1)
        got = torch.tensor([[float(r[f"prob{i}"]) for i in range(1, 4)] for r in rows])
        assert torch.allclose(ref.sort(-1, descending=True).values, got, atol=2e-5)
    assert (tmp_path / "p0.875.csv").read_text() != (tmp_path / "pNone.csv").read_text()


def test_resume_refuses_data_whose_classes_moved(tmp_path):
    """A run trained when ``10`` sorted before ``2`` must not resume with the labels renumbered."""
    from lgvit.checkpoints.files import check_same_classes
    from lgvit.core.atomic import atomic_save_safetensors

    old = {"classes": json.dumps(["1", "10", "2"])}
    atomic_save_safetensors({"w": torch.zeros(1)}, tmp_path / "last.safetensors", old)
    check_same_classes(tmp_path / "last", old)  # the same classes: fine
    now = {"classes": json.dumps(["1", "2", "10"])}
    with pytest.raises(LgvitError, match="class 1 was '10', is now '2'"):
        check_same_classes(tmp_path / "last", now)
