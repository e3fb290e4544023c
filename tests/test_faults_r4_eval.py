"""Faults and bad input, round four: evaluation and prediction. ``lgvit eval`` runs in full
precision unless asked (and says which precision ran), out-of-range thresholds are refused at
parsing, a class map with a BOM is read, every task takes ``--tta none``, and ``lgvit predict``
skips an unreadable image (saying "permission denied" where it is that) and exits 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from det_fixtures import write_coco_set
from seg_fixtures import write_seg_set
from test_dense_cli_strict import dense_checkpoint

import lgvit
from lgvit.cli import main


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random-weights checkpoint of each task (no run)."""
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    lgvit_model = lgvit.create_model("lsa_micro_cifar", num_classes=10, img_size=16)
    torch.save(lgvit_model.state_dict(), root / "cls.pth")
    return {
        "classification": root / "cls.pth",
        "segmentation": dense_checkpoint(root / "seg.safetensors", "segmentation"),
        "detection": dense_checkpoint(root / "det.safetensors", "detection"),
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "segmentation": write_seg_set(root / "seg", n_train=1, n_val=2),
        "detection": write_coco_set(root / "coco", n_train=1, n_val=2, size=(32, 48)),
    }


def _eval_args(task: str, ckpts: dict[str, Path], data: dict[str, Path]) -> list[str]:
    if task == "classification":
        return ["eval", "--checkpoint", str(ckpts[task]), "--model", "lsa_micro_cifar",
                "--img-size", "16", "--data", "synthetic", "--batch-size", "64"]  # fmt: skip
    name = "segfolder" if task == "segmentation" else "coco"
    return ["eval", "--checkpoint", str(ckpts[task]), "--data", name, "--data-dir",
            str(data[task]), "-j", "0"]  # fmt: skip


@pytest.fixture
def autocast_seen(monkeypatch: pytest.MonkeyPatch):
    """The autocast state of the CPU at every module's forward (None: none), on a CPU said to
    run bf16 natively, where ``--amp auto`` means bf16 autocast."""
    import lgvit.core.runtime

    monkeypatch.setattr(lgvit.core.runtime, "cpu_supports_bf16", lambda: True)
    seen: set = set()

    def hook(module, args, out) -> None:  # noqa: ANN001
        seen.add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    yield seen
    handle.remove()


# ------------------------------------------------------ item 4: eval in full precision


@pytest.mark.parametrize("task", ["classification", "segmentation", "detection"])
def test_eval_runs_in_fp32_unless_asked_and_says_so(task, ckpts, data, autocast_seen, capsys):
    """``lgvit eval``'s default was ``--amp auto``: bf16 autocast on a CPU with native bf16, and
    a detector's AP50 fell from 21.48 (the run's fp32 figure) to 18.39. Now the default runs
    without autocast and the result says "fp32"; ``--amp auto`` still gives bf16 on request."""
    args = _eval_args(task, ckpts, data)
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert autocast_seen == {None}, autocast_seen
    start = {"classification": "top-1", "segmentation": "mIoU"}.get(task, f"{ckpts[task]} on")
    result_line = next(ln for ln in out.splitlines() if ln.startswith(start))
    assert "fp32" in result_line, out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp32"

    autocast_seen.clear()
    assert main([*args, "--amp", "auto", "--json"]) == 0
    assert autocast_seen == {torch.bfloat16}, autocast_seen
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16 autocast"


def test_predict_says_its_precision(ckpts, tmp_path, capsys):
    from PIL import Image

    img = tmp_path / "a.png"
    Image.new("RGB", (20, 20), (200, 30, 30)).save(img)
    base = ["predict", "--checkpoint", str(ckpts["classification"]), "--model",
            "lsa_micro_cifar", "--img-size", "16", str(img)]  # fmt: skip
    capsys.readouterr()
    assert main(base) == 0
    assert capsys.readouterr().out.splitlines()[0] == "precision: fp32"
    assert main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["precision"] == "fp32"


# ------------------------------------------- item 9: float flags refused out of their range

FLOAT_CASES = [
    ("predict", "--score-thr", ["nan"], "nan: must be a number in [0, 1]"),
    ("predict", "--score-thr", ["-1"], "-1: must be a number in [0, 1]"),
    ("predict", "--score-thr", ["2"], "2: must be a number in [0, 1]"),
    ("predict", "--score-thr", ["inf"], "inf: must be a number in [0, 1]"),
    ("predict", "--score-thr", ["x"], "'x' is not a number: must be a number in [0, 1]"),
    ("eval", "--crop-pct", ["0"], "0: must be a number in (0, 1]"),
    ("eval", "--crop-pct", ["nan"], "nan: must be a number in (0, 1]"),
    ("eval", "--crop-pct", ["1.5"], "1.5: must be a number in (0, 1]"),
    ("eval", "--std", ["0.2", "nan", "0.2"], "nan: must be a finite number > 0"),
    ("eval", "--std", ["0.2", "0", "0.2"], "0: must be a finite number > 0"),
    ("eval", "--mean", ["0.5", "inf", "0.5"], "inf: must be a finite number"),
]


@pytest.mark.parametrize(("command", "flag", "values", "needle"), FLOAT_CASES)
def test_float_flags_out_of_range_are_refused_at_parsing(command, flag, values, needle, tmp_path,
                                                         capsys):  # fmt: skip
    """``predict --score-thr`` took nan, -1 and 2 ("0 above nan"); eval's --std took nan and inf.
    Now parsing refuses them, before any checkpoint is read (this one does not exist)."""
    ckpt = str(tmp_path / "absent.safetensors")
    args = [command, "--checkpoint", ckpt, flag, *values]
    args += ["--data", "digits"] if command == "eval" else ["a.png"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"lgvit {command}: error: argument {flag}: {needle}"
    )


def test_float_flags_take_their_bounds():
    from lgvit.cli import build_parser

    p = build_parser()
    assert p.parse_args(["predict", "--checkpoint", "c", "--score-thr", "0", "a"]).score_thr == 0
    assert p.parse_args(["predict", "--checkpoint", "c", "--score-thr", "1", "a"]).score_thr == 1
    ev = p.parse_args(["eval", "--checkpoint", "c", "--data", "digits", "--crop-pct", "1",
                       "--std", "1e-3", "1", "2", "--mean", "-0.5", "0", "1.5"])  # fmt: skip
    assert (ev.crop_pct, ev.std, ev.mean) == (1.0, [1e-3, 1.0, 2.0], [-0.5, 0.0, 1.5])


# ------------------------------------------------ item 11: a class map with a byte-order mark

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("text", ["owl\ncat\ndog\n", "owl 0\ncat 1\ndog 2\n"])
def test_a_class_map_with_a_bom_is_read(text, tmp_path, capsys):
    """A --class-map saved by an editor with a BOM failed ("not in the class map: owl": the
    first name read as "\\ufeffowl"); classes.txt had been given BOM handling, the class map
    not. Both now go through one reader. Through ``lgvit eval``: the map's order is the JSON's
    classes, the same as without the BOM."""
    from test_eval import write_images

    for i, c in enumerate(("cat", "dog", "owl")):
        write_images(tmp_path / "d" / c, 2, seed=i, size=(20, 20))
    torch.manual_seed(0)
    torch.save(lgvit.create_model("lsa_micro_cifar", num_classes=3, img_size=16).state_dict(),
               tmp_path / "m.pth")  # fmt: skip
    results = []
    for bom in (b"", BOM):
        (tmp_path / "map.txt").write_bytes(bom + text.encode())
        capsys.readouterr()
        code = main(["eval", "--checkpoint", str(tmp_path / "m.pth"), "--model", "lsa_micro_cifar",
                     "--img-size", "16", "--data", "imagefolder", "--data-dir", str(tmp_path / "d"),
                     "--cache-dir", str(tmp_path / "c"), "-j", "0", "--class-map",
                     str(tmp_path / "map.txt"), "--json"])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        results.append(json.loads(out))
    assert results[1]["classes"] == results[0]["classes"] == ["owl", "cat", "dog"]
    assert results[1]["per_class_acc"] == results[0]["per_class_acc"]


def test_a_class_map_not_utf8_is_one_line_naming_the_line(tmp_path):
    from lgvit.core.errors import LgvitError
    from lgvit.data.imagefolder import load_class_map

    path = tmp_path / "map.txt"
    path.write_bytes(BOM + b"owl\ncaf\xe9\n")
    with pytest.raises(LgvitError) as e:
        load_class_map(path)
    assert str(e.value) == f"class map {path}: not UTF-8 text (byte 0xe9 at offset 10, line 2)"


# ------------------------------------------------------- item 15 (parts): eval and predict


def test_every_task_takes_tta_none_and_declares_its_own_modes():
    """``det eval --tta none`` was refused (detection declared no --tta): "none", the no-TTA
    default, is every task's; each task's --tta choices are its TaskSpec's ``eval_tta``."""
    from lgvit.task_table import TASKS
    from lgvit.tasks.dispatch import task_flags

    for t in TASKS.values():
        (tta,) = [f for f in task_flags(t, "eval") if f.dest == "tta"]
        assert tta.choices == t.eval_tta and "none" in t.eval_tta and tta.default == "none"


def test_detection_eval_takes_tta_none(ckpts, data, capsys):
    args = _eval_args("detection", ckpts, data)
    capsys.readouterr()
    assert main([*args, "--tta", "none", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["tta"] == "none"
    assert main([*args, "--tta", "flip"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lgvit eval: error: --tta flip: detection eval takes --tta none"], err


def test_a_flag_of_other_tasks_names_them_in_good_grammar(ckpts, tmp_path, capsys):
    """The refusal read "(classification and detection eval does)"; each reader is named with
    the command and the verb agrees with their number."""
    ckpt = str(ckpts["classification"])
    base = ["predict", "--checkpoint", ckpt, "--model", "lsa_micro_cifar", "a.png"]
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("does not take --out (segmentation predict and detection predict do)")
    assert main([*base, "--score-thr", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("does not take --score-thr (detection predict does)"), err


def _predict_args(task: str, ckpts: dict[str, Path], tmp_path: Path) -> list[str]:
    args = ["predict", "--checkpoint", str(ckpts[task]), "--json"]
    if task == "classification":
        return [*args, "--model", "lsa_micro_cifar", "--img-size", "16"]
    return [*args, "--out", str(tmp_path / "out")]


@pytest.mark.parametrize("task", ["classification", "segmentation", "detection"])
def test_predict_skips_a_lone_unreadable_image_and_exits_1(task, ckpts, tmp_path, capsys):
    """One unreadable image (and nothing else) ended as exit 2 "error", where the docs say an
    unreadable file is skipped with a line and the exit status is 1: now it is, for every task.
    """
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    capsys.readouterr()
    assert main([*_predict_args(task, ckpts, tmp_path), str(broken)]) == 1
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        f"lgvit predict: skipped: {broken}: not a readable image (empty, truncated or not an image)"
    ]
    assert json.loads(out) == []


@pytest.mark.parametrize("how", ["chmod", "mock"])
def test_an_image_without_read_permission_is_skipped_as_permission_denied(
    how, ckpts, tmp_path, capsys, monkeypatch
):
    """A file without read permission was "not a readable image (empty, truncated or not an
    image)". ``chmod`` needs a user who is not root (root reads anything); ``mock`` makes
    opening it raise PermissionError, so the test runs as root too."""
    import errno
    import os

    from PIL import Image

    good, locked = tmp_path / "good.png", tmp_path / "locked.png"
    for p in (good, locked):
        Image.new("RGB", (20, 20), (10, 200, 30)).save(p)
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root reads a file without read permission")
        locked.chmod(0)
    else:
        real_open = Image.open

        def refusing_open(fp, *a, **k):  # noqa: ANN001, ANN002, ANN003
            if str(fp) == str(locked):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(fp))
            return real_open(fp, *a, **k)

        monkeypatch.setattr(Image, "open", refusing_open)
    capsys.readouterr()
    try:
        code = main([*_predict_args("classification", ckpts, tmp_path), str(good), str(locked)])
    finally:
        locked.chmod(0o644)
    out, err = capsys.readouterr()
    assert code == 1
    assert err.strip().splitlines() == [
        f"lgvit predict: skipped: {locked}: cannot read it (permission denied)"
    ]
    assert [r["image"] for r in json.loads(out)] == [str(good)]
