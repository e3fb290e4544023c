"""Dense tasks you can trust (issue 36): the printed resume command resumes any task's run,
nothing a command writes overwrites another of its outputs, an evaluation that fails keeps the
epoch it evaluates, and flags, checkpoints or values a command cannot honour are one line."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from det_fixtures import write_coco_set
from seg_fixtures import write_seg_set
from test_detection import DET_TRAIN
from test_segmentation import SEG_TRAIN

from lgvit.cli import main


@pytest.fixture(scope="module")
def seg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_seg_set(tmp_path_factory.mktemp("seg") / "data", n_train=16, n_val=4)


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 10 training images, the last 2 empty (left out): 8 at batch 4 = 2 steps an epoch.
    return write_coco_set(tmp_path_factory.mktemp("coco"), n_train=10, n_val=4, size=(32, 48))


def one_line(capsys: pytest.CaptureFixture, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------- item 8: resume any task


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_sigterm_then_resume_auto_with_only_out_matches_an_uninterrupted_run(
    task, seg_root, coco_root, tmp_path, capsys, monkeypatch
):
    """The command printed after SIGTERM (``lgvit train --out RUN --resume auto``, nothing
    else) resumes a dense run -- it once failed with ``unknown dataset``, the task being
    classification's by default -- and ends with the uninterrupted run's metrics."""
    from lgvit.checkpoints.files import load_weights

    if task == "segmentation":  # 16 images at batch 8: 2 steps an epoch
        base = [*SEG_TRAIN, "--data-dir", str(seg_root), "--epochs", "2", "--set", "eval_every=2"]
        keys, steps = ("train_loss", "test_mIoU", "test_mAcc", "test_aAcc"), 2
    else:  # 8 kept images (6 wide, 2 tall) in batches of 3 of one orientation: 2 steps an epoch
        base = [*DET_TRAIN, "--data-dir", str(coco_root), "--epochs", "2", "--batch-size", "3",
                "--set", "warmup_iters=2", "--set", "eval_every=2"]  # fmt: skip
        keys, steps = ("train_loss", "test_bbox_AP", "test_bbox_AP50"), 2
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main([*base, "--out", str(full)]) == 0
    monkeypatch.setenv("LGVIT_SIGTERM_AT_STEP", str(steps + 1))  # epoch 2, step 1
    code = main([*base, "--out", str(cut)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM and len(err) == 1, err
    command = err[0].split("Continue with: ", 1)[1].split()
    assert command == ["lgvit", "train", "--out", str(cut), "--resume", "auto"]
    monkeypatch.delenv("LGVIT_SIGTERM_AT_STEP")
    assert main(command[1:]) == 0, capsys.readouterr().err
    assert f"at epoch 2 step 1/{steps}" in (cut / "train.log").read_text()
    a, b = history(full), history(cut)
    assert len(a) == len(b) == 2
    assert keys[1] in a[1] and keys[1] not in a[0]  # eval_every=2: the last epoch only
    for key in keys:
        assert [m.get(key) for m in a] == [m.get(key) for m in b], key
    wa, wb = load_weights(full / "last"), load_weights(cut / "last")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Item 6: a resume may not change the input size (it once accepted a new det/seg_scale)
    # nor the task; refused before anything is read or written.
    scale = "seg_scale=[80,60]" if task == "segmentation" else "det_scale=[64,48]"
    before = (cut / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    for change, key in ((["--set", scale], scale.split("=")[0]), (["--task", "classification"],
                                                                   "task")):  # fmt: skip
        code = main(["train", "--out", str(cut), "--resume", "auto", *change])
        one_line(capsys, code, f"the run trained with {key}=", "--initial-checkpoint")
    assert (cut / "metrics.jsonl").read_bytes() == before


# ------------------------------------------------------- item 9: an evaluation that raises


def test_an_evaluation_that_raises_keeps_the_epoch_and_a_resume_evaluates_it(
    tmp_path, monkeypatch, capsys
):
    """The epoch's ``last`` checkpoint is written before its evaluation (it once came after,
    so an evaluation that raised lost the epoch); resuming evaluates that epoch and the run
    ends with the metrics, history and weights of an uninterrupted run."""
    from test_train import FAST

    from lgvit.checkpoints.files import load_checkpoint_pair, load_weights
    from lgvit.tasks.classification.train import ClassificationTask

    # 512 images at batch 128: 4 steps an epoch.
    base = ["train", *FAST, "--data", "synthetic", "--epochs", "2", "--batch-size", "128",
            "--amp", "none"]  # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main([*base, "--out", str(full)]) == 0
    real, calls = ClassificationTask.evaluate, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # epoch 1's evaluation
            raise RuntimeError("out of memory in evaluation")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ClassificationTask, "evaluate", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        main([*base, "--out", str(cut)])
    _, state = load_checkpoint_pair(cut / "last")
    assert state["epoch"] == 0 and state["extra"]["pending_eval"]["epoch"] == 0
    assert not (cut / "metrics.jsonl").exists()  # the epoch is recorded once evaluated
    monkeypatch.setattr(ClassificationTask, "evaluate", real)
    capsys.readouterr()
    assert main(["train", "--out", str(cut), "--resume", "auto"]) == 0
    assert "epoch 1/2, evaluated on resuming: test top-1" in capsys.readouterr().out
    a, b = history(full), history(cut)
    for key in ("epoch", "train_loss", "lr", "test_acc1", "test_acc5", "test_loss"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert load_checkpoint_pair(cut / "last")[1]["extra"]["history"] == b
    wa, wb = load_weights(full / "last"), load_weights(cut / "last")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------- tiny dense checkpoints (random weights, no run)

SEG_META = {
    "task": "segmentation", "model": "lsa_micro_cifar", "img_size": "32", "num_classes": "3",
    "classes": json.dumps(["background", "disc", "square"]), "dataset": "segfolder",
    "mean": "[0.5, 0.5, 0.5]", "std": "[0.25, 0.25, 0.25]", "seg_scale": "[64, 48]",
}  # fmt: skip
DET_META = {
    "task": "detection", "detector": "retinanet", "model": "lsa_micro_cifar", "img_size": "32",
    "num_classes": "2", "classes": '["disc", "square"]', "cat_ids": "[3, 7]", "dataset": "coco",
    "det_scale": "[48, 32]",
}  # fmt: skip


def dense_checkpoint(path: Path, task: str, edit=None, extra: int = 0, **meta: str) -> Path:
    """A segmentation or detection checkpoint of lsa_micro_cifar as the tasks write them
    (``extra`` classes more than the fixtures' data); ``meta`` replaces metadata values,
    ``edit(weights)`` changes the weights."""
    from lgvit.core.atomic import atomic_save_safetensors

    torch.manual_seed(0)
    if task == "segmentation":
        from lgvit.dense.semfpn import create_segmenter

        model = create_segmenter("lsa_micro_cifar", 3 + extra, img_size=32)
        names = ["background", "disc", "square"] + [f"more{i}" for i in range(extra)]
        base = {**SEG_META, "classes": json.dumps(names), "num_classes": str(len(names))}
    else:
        from lgvit.dense.detection import create_detector

        model = create_detector("retinanet", "lsa_micro_cifar", 2 + extra, min_size=32,
                                max_size=48, img_size=32)  # fmt: skip
        names = ["disc", "square"] + [f"more{i}" for i in range(extra)]
        base = {**DET_META, "classes": json.dumps(names), "num_classes": str(len(names)),
                "cat_ids": json.dumps([3, 7] + [10 + i for i in range(extra)])}  # fmt: skip
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(weights)
    atomic_save_safetensors(weights, path, {**base, **meta})
    return path


def _as_int32(weights: dict) -> None:
    key = next(k for k, v in weights.items() if v.is_floating_point() and v.dim() > 1)
    weights[key] = (weights[key] * 0).to(torch.int32) + 3  # all 3, where floats belong


# ------------------------------------------------- item 5: integer weights in dense loaders


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_integer_weights_in_a_dense_checkpoint_are_refused(task, seg_root, coco_root, tmp_path,
                                                           capsys):  # fmt: skip
    """Float weights stored as int32 were cast silently by the dense loaders (eval, predict
    and --initial-checkpoint ran on, with other numbers); classification refused them."""
    from lgvit.core.errors import LgvitError

    ckpt = dense_checkpoint(tmp_path / "int.safetensors", task, edit=_as_int32)
    data = ["--data", "segfolder", "--data-dir", str(seg_root)] if task == "segmentation" else \
        ["--data", "coco", "--data-dir", str(coco_root)]  # fmt: skip
    image = next((seg_root / "images" / "validation").iterdir())
    for cmd in (
        ["eval", "--checkpoint", str(ckpt), *data, "-j", "0"],
        ["predict", "--checkpoint", str(ckpt), str(image), "--out", str(tmp_path / "p")],
    ):
        one_line(capsys, main(cmd), str(ckpt), "is int32, not floating point")
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())
    if task == "segmentation":
        from lgvit.dense.semfpn import create_segmenter
        from lgvit.tasks.segmentation.train import SegmentationTask

        model, t = create_segmenter("lsa_micro_cifar", 3, img_size=32), SegmentationTask()
    else:
        from lgvit.dense.detection import create_detector
        from lgvit.tasks.detection.train import DetectionTask

        model = create_detector("retinanet", "lsa_micro_cifar", 2, min_size=32, max_size=48,
                                img_size=32)  # fmt: skip
        t = DetectionTask()
    from lgvit.run.config import TrainConfig

    t.cfg = TrainConfig(task=task, model="lsa_micro_cifar", data=data[1])
    with pytest.raises(LgvitError, match="is int32, not floating point"):
        t.load_initial(model, str(ckpt))


# --------------------------------------------------- item 2: predict never overwrites itself


def _same_stem_images(root: Path) -> list[str]:
    """``a/x.png``, ``a/x.jpg``, ``b/x.png``, three different pictures; ``b/X.png`` too."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = [root / "a" / "x.png", root / "a" / "x.jpg", root / "b" / "x.png", root / "b" / "X.png"]
    for i, p in enumerate(paths):
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (40 + 3 * i, 52, 3), np.uint8)).save(p)
    return [str(root / "a"), str(paths[2]), str(paths[3])]


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_predict_writes_one_set_of_files_per_input(task, tmp_path, capsys):
    """Inputs sharing a file name (``a/x.png``, ``a/x.jpg``, ``b/x.png``) once all wrote
    ``x_mask.png``: the last one survived while the report listed three images. Each now
    gets its own files, and the report lists exactly the files written."""
    from lgvit.tasks.commands import output_stems

    assert output_stems(["a/x.png", "a/x.jpg", "b/x.png", "b/X.png", "y.png"]) == [
        "x_png", "x_jpg", "x_png_2", "X_png_3", "y"
    ]  # fmt: skip
    ckpt = dense_checkpoint(tmp_path / "m.safetensors", task)
    out = tmp_path / "P"
    args = _same_stem_images(tmp_path / "in")
    assert main(["predict", "--checkpoint", str(ckpt), *args, "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    keys = ("mask", "overlay") if task == "segmentation" else ("drawn", "json")
    listed = [r[k] for r in report for k in keys]
    assert len(report) == 4 and len(set(listed)) == 8
    assert sorted(listed) == sorted(str(p) for p in out.iterdir())
    assert [r["image"] for r in report] == [
        str(tmp_path / "in" / n) for n in ("a/x.jpg", "a/x.png", "b/x.png", "b/X.png")
    ]
    if task == "segmentation":  # each mask is its own image's (their heights differ)
        from PIL import Image

        for r in report:
            assert Image.open(r["mask"]).size == Image.open(r["image"]).size


# ------------------------------------ item 7: flags a dense eval cannot honour, flip TTA


def test_flags_dense_eval_cannot_honour_are_one_line(seg_root, coco_root, tmp_path, capsys):
    """``--predictions`` on a segmentation checkpoint wrote nothing and ``--tta`` changed
    nothing for detection (or segmentation's flip-translate), silently; ``eval_tta`` in a
    detection training config likewise."""
    from lgvit.core.errors import LgvitError
    from lgvit.run.config import TrainConfig, validate_config

    seg = dense_checkpoint(tmp_path / "seg.safetensors", "segmentation")
    det = dense_checkpoint(tmp_path / "det.safetensors", "detection")
    seg_data = ["--data", "segfolder", "--data-dir", str(seg_root), "-j", "0"]
    csv = tmp_path / "p.csv"
    code = main(["eval", "--checkpoint", str(seg), *seg_data, "--predictions", str(csv)])
    one_line(capsys, code, "--predictions:", "segmentation eval does not take --predictions",
             "lgvit predict --checkpoint")  # fmt: skip
    code = main(["eval", "--checkpoint", str(seg), *seg_data, "--tta", "flip-translate"])
    one_line(capsys, code, "--tta flip-translate", "--tta flip")
    code = main(["eval", "--checkpoint", str(det), "--data", "coco", "--data-dir",
                 str(coco_root), "-j", "0", "--tta", "flip"])  # fmt: skip
    one_line(capsys, code, "--tta flip:", "detection eval takes --tta none")
    assert not csv.exists()
    for task, data, tta in (("detection", "coco", "flip"),
                            ("segmentation", "segfolder", "flip-translate")):  # fmt: skip
        with pytest.raises(LgvitError, match=f"eval_tta='{tta}'.*task={task}"):
            validate_config(TrainConfig(task=task, data=data, eval_tta=tta))


def test_segmentation_flip_tta_is_the_mean_softmax_of_the_image_and_its_mirror(
    seg_root, tmp_path, capsys
):
    """``lgvit eval --tta flip`` on a segmenter: mmseg's flip test, recomputed here by hand
    (softmax of each view at the mask's size, the mirror's flipped back, averaged)."""
    import torch.nn.functional as F

    from lgvit.data.segmentation import SegEvalLoader, load_seg_split
    from lgvit.tasks.segmentation.evaluate import SegMetrics, load_segmenter, normalise

    ckpt = dense_checkpoint(tmp_path / "seg.safetensors", "segmentation")
    data = ["--data", "segfolder", "--data-dir", str(seg_root), "-j", "0", "--amp", "none"]
    res = {}
    for tta in ("none", "flip"):
        assert main(["eval", "--checkpoint", str(ckpt), *data, "--tta", tta, "--json"]) == 0
        res[tta] = json.loads(capsys.readouterr().out)
    model = load_segmenter(str(ckpt), "cpu")
    info = model.seg_info
    loader = SegEvalLoader(load_seg_split("segfolder", seg_root, "val"), info["scale"],
                           workers=0)  # fmt: skip
    by_hand = {"none": SegMetrics(3), "flip": SegMetrics(3)}
    changed = 0
    with torch.no_grad():
        for image, mask in loader:
            views = []
            for x in (image, image.flip(-1)):
                logits = model(normalise(x, info["mean"], info["std"]))
                views.append(F.interpolate(logits, size=mask.shape[-2:], mode="bilinear",
                                           align_corners=False))  # fmt: skip
            plain = views[0].argmax(1)
            flip = ((views[0].softmax(1) + views[1].flip(-1).softmax(1)) / 2).argmax(1)
            by_hand["none"].update(plain, mask)
            by_hand["flip"].update(flip, mask)
            changed += int((plain != flip).sum())
    assert changed > 0  # the flip test changes predictions here, so the comparison means it
    for tta in ("none", "flip"):
        want = by_hand[tta].result()
        assert res[tta]["tta"] == tta
        assert res[tta]["mIoU"] == pytest.approx(want["mIoU"], abs=1e-9)
        assert res[tta]["per_class_iou"] == want["per_class_iou"]


# ------------------------- item 10: class counts, dense sizes and checkpoint metadata


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_any_classes_with_another_class_count_is_one_line(task, seg_root, coco_root,
                                                          tmp_path, capsys):  # fmt: skip
    """``--any-classes`` allows other names, not another count: a checkpoint with one class
    more than the data once ended in a zip(strict) ValueError or an IndexError."""
    ckpt = dense_checkpoint(tmp_path / "more.safetensors", task, extra=1)
    data = ["--data", "segfolder", "--data-dir", str(seg_root)] if task == "segmentation" else \
        ["--data", "coco", "--data-dir", str(coco_root)]  # fmt: skip
    code = main(["eval", "--checkpoint", str(ckpt), *data, "-j", "0", "--any-classes"])
    one_line(capsys, code, str(ckpt), "has 3 " if task == "detection" else "has 4 classes",
             "--any-classes allows other")  # fmt: skip


@pytest.mark.parametrize("key", ["det_scale", "seg_scale"])
def test_dense_scales_have_an_upper_bound(key, tmp_path, capsys):
    """[100000, 100000] passed the 64 px size probe, then asked for 96 GB."""
    code = main(["train", "--task", "detection", "--data", "coco", "--data-dir",
                 str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--set",
                 f"{key}=[100000,100000]"])  # fmt: skip
    one_line(capsys, code, f"{key}=(100000, 100000)", "two sizes in [1, 8192] pixels")
    assert not (tmp_path / "run").exists()


BAD_META = [
    ("segmentation", "classes", '"background,disc,square"'),
    ("segmentation", "classes", "[]"),
    ("segmentation", "seg_scale", "[64]"),
    ("segmentation", "seg_scale", '[64, "48"]'),
    ("segmentation", "mean", "[0.5, 0.5]"),
    ("segmentation", "std", "[0.25, 0.25, 0.25, 0.25]"),
    ("segmentation", "img_size", "32.5"),
    ("detection", "cat_ids", "[3]"),
    ("detection", "cat_ids", "[3, 3]"),
    ("detection", "cat_ids", '"3, 7"'),
    ("detection", "classes", "[1, 2]"),
    ("detection", "det_scale", "[48]"),
    ("detection", "det_scale", "[100000, 100000]"),
]


@pytest.mark.parametrize(("task", "key", "value"), BAD_META)
def test_malformed_dense_metadata_is_one_line_naming_the_key(task, key, value, tmp_path,
                                                             capsys):  # fmt: skip
    """A hand-edited or foreign header: a value of the wrong type or length was an
    IndexError, a TypeError, a RuntimeError, or silently broadcast."""
    ckpt = dense_checkpoint(tmp_path / "bad.safetensors", task, **{key: value})
    image = _same_stem_images(tmp_path / "in")[1]
    code = main(["predict", "--checkpoint", str(ckpt), image, "--out", str(tmp_path / "P")])
    one_line(capsys, code, str(ckpt), f"metadata {key}=")


# ------------------------------------------- item 11: export and viz of a dense checkpoint


@pytest.mark.parametrize("task", ["segmentation", "detection"])
def test_export_and_viz_of_a_dense_checkpoint_say_what_it_is(task, tmp_path, capsys):
    ckpt = dense_checkpoint(tmp_path / "m.safetensors", task)
    image = _same_stem_images(tmp_path / "in")[1]
    what = "Semantic FPN" if task == "segmentation" else "retinanet"
    for cmd in (
        ["export", str(ckpt), "--format", "onnx", "--out", str(tmp_path / "m.onnx")],
        ["viz", str(ckpt), image, "--what", "attention", "--out", str(tmp_path / "v")],
    ):
        one_line(capsys, main(cmd), f"is a {task} checkpoint ({what} on lsa_micro_cifar)",
                 "export and viz take classification checkpoints")  # fmt: skip
    assert not (tmp_path / "m.onnx").exists()


# ------------------------------------------ item 12: --predictions checked before evaluating


def test_predictions_path_is_checked_before_the_evaluation(coco_root, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    """A folder (or a path under a file) as ``--predictions`` failed only after the whole
    evaluation, naming a temp file; classification and detection both check it first."""
    import lgvit.tasks.classification.evaluate
    import lgvit.tasks.detection.evaluate

    def never(*a, **k):
        raise AssertionError("evaluated before the --predictions path was checked")

    monkeypatch.setattr(lgvit.tasks.classification.evaluate, "evaluate", never)
    monkeypatch.setattr(lgvit.tasks.detection.evaluate, "evaluate_detection", never)
    det = dense_checkpoint(tmp_path / "det.safetensors", "detection")
    (tmp_path / "afile").write_text("x")
    for bad, needle in ((tmp_path, "a directory"), (tmp_path / "afile" / "p.json",
                                                    "is not a directory")):  # fmt: skip
        code = main(["eval", "--checkpoint", str(det), "--data", "coco", "--data-dir",
                     str(coco_root), "-j", "0", "--predictions", str(bad)])  # fmt: skip
        one_line(capsys, code, f"--predictions {bad}", needle)
        code = main(["eval", "--checkpoint", "lsa_micro_cifar_missing", "--data", "synthetic",
                     "--predictions", str(bad)])  # fmt: skip
        one_line(capsys, code, f"--predictions {bad}", needle)
