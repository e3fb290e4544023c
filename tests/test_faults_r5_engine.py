"""Faults and bad input, round five: the engine and the streaming loaders' reporting. A resume
after the data changed size (no 0-step epoch, one line saying what changed), samples the
streamed sources leave out (counted per epoch in stdout, ``train.log`` and ``metrics.jsonl``),
an accumulation window longer than the epoch, ``lgvit eval --amp`` bare, a seed that fixes a
fine-tuning run whatever the weights cache holds, and timm reading an lgvit folder of one of
its own architectures."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import quick_init
from PIL import Image
from safetensors.torch import load_file

import lgvit
from lgvit.cli import main
from lgvit.core.runtime import precision_name, resolve_amp


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------ 14: eval --amp bare


def test_eval_takes_a_bare_amp_as_train_does(tmp_path, capsys):
    torch.manual_seed(0)
    model = lgvit.create_model("lsa_micro_cifar", num_classes=10, img_size=16)
    torch.save(model.state_dict(), tmp_path / "m.pth")
    base = ["eval", "--checkpoint", str(tmp_path / "m.pth"), "--model", "lsa_micro_cifar",
            "--img-size", "16", "--data", "synthetic", "--batch-size", "256"]  # fmt: skip
    auto = precision_name(resolve_amp("auto", torch.device("cpu")))
    for args in ([*base, "--json", "--amp"], [*base, "--amp", "--json"]):
        code, out, err = _cli(capsys, *args)
        assert code == 0, err
        assert json.loads(out)["precision"] == auto  # bare: auto, as train's --amp
    code, out, err = _cli(capsys, *base, "--json")
    assert code == 0 and json.loads(out)["precision"] == precision_name(None)  # default: fp32


# ------------------------------------------------------------- also: timm reads an lgvit folder


def test_timm_builds_its_own_architecture_from_an_lgvit_folder(tmp_path):
    """An lgvit folder naming one of timm's architectures that takes no ``img_size`` (a
    ConvNeXt): timm read lgvit's ``fixed_input_size`` as "pass img_size" and raised a
    TypeError; lgvit's own models never needed it from the folder."""
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    folder = lgvit.create_model("lsa_micro_cifar", num_classes=3).save_pretrained(tmp_path / "hf")
    ours = timm.create_model(f"local-dir:{folder}", pretrained=True)  # lgvit's, through timm
    assert ours.model_name == "lsa_micro_cifar" and ours.pretrained_cfg["fixed_input_size"]
    torch.manual_seed(0)
    theirs = timm.create_model("test_convnext", num_classes=3).eval()
    save_file(theirs.state_dict(), folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architecture": "test_convnext"}))
    m = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert type(m) is type(theirs) and m.num_classes == 3
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), theirs(x), rtol=0, atol=0)


# --------------------------------------------------------- 15: a seed fixes a fine-tuning run


@pytest.fixture
def releases(tmp_path, monkeypatch):
    """A release server on 127.0.0.1 serving localvit_tiny's file (lgvit's layout, as
    test_finetune's), downloads going to an empty cache."""
    from test_weights import FakeReleases

    from lgvit.models.download import ENV_DIR, ENV_MIRROR
    from lgvit.models.weights import find_weights

    server = FakeReleases()
    w = find_weights("localvit_tiny.in1k_authors")
    torch.manual_seed(1)
    with quick_init():
        state = lgvit.create_model("localvit_tiny").state_dict()
    path = tmp_path / "served" / w.filename
    path.parent.mkdir()
    torch.save({"model": state}, path)
    server.files[w.filename] = path.read_bytes()
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "weights"))
    monkeypatch.setenv(ENV_MIRROR, server.base)
    yield server, path
    server.httpd.shutdown()


def test_a_seed_fixes_a_fine_tuning_run_whatever_the_cache_holds(releases, tmp_path, capsys):
    """Downloading (and checking) the released file built a model, which drew from the run's
    random streams: the same command trained otherwise than once the file was cached."""
    server, served = releases
    run = ["train", "--model", "localvit_tiny", "--data", "synthetic", "--img-size", "32",
           "--iters", "1", "--batch-size", "8", "--seed", "0", "--amp", "none",
           "--set", "log_every=1000"]  # fmt: skip
    outs = {}
    with quick_init():
        for what, start in (
            ("download", "localvit_tiny.in1k_authors"),
            ("cached", "localvit_tiny.in1k_authors"),
            ("file", str(served)),
        ):
            outs[what] = tmp_path / what
            assert main([*run, "--initial-checkpoint", start, "--out", str(outs[what])]) == 0
    assert sum(server.hits.values()) == 1  # downloaded once, then read from the cache
    capsys.readouterr()
    a = load_file(outs["download"] / "last.safetensors")
    for what in ("cached", "file"):
        b = load_file(outs[what] / "last.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (what, k)


def _images(folder, names: list[str], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(folder / name)


def _tree(root, per_class: int, val: int = 2) -> None:
    """An image folder: ``per_class`` training images in each of three classes, ``val``
    validation ones."""
    for c in ("ant", "bee", "cat"):
        _images(root / "train" / c, [f"{i}.png" for i in range(per_class)])
        _images(root / "val" / c, [f"{i}.png" for i in range(val)], seed=1)


def _train(*args: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warm-up as long as the run
        assert main(["train", *args]) == 0


def _folder_run(data, out, *more: str) -> list[str]:
    return ["--model", "lsa_micro_cifar", "--img-size", "16", "--data", "imagefolder",
            "--data-dir", str(data), "--batch-size", "6", "--amp", "none", "--out", str(out),
            "--set", f"cache_dir={out.parent / 'cache'}", "--set", "log_every=1000",
            "--set", "workers=0", *more]  # fmt: skip


# ---------------------------------------------------- 13: a window longer than the epoch


def test_an_accumulation_window_longer_than_the_epoch_is_refused(tmp_path, capsys):
    """512 images in batches of 128: 4 an epoch; a window of 100 stepped once an epoch with
    the lr scaled for a global batch of 12800, said nowhere."""
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "--model", "lsa_micro_cifar", "--img-size", "16",
                        "--data", "synthetic", "--batch-size", "128", "--iters", "2",
                        "--grad-accum-steps", "100", "--out", str(out))  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    for needle in ("--grad-accum-steps 100", "the epoch's 4 batch(es) of 128",
                   "global batch of 12800", "use at most --grad-accum-steps 4"):  # fmt: skip
        assert needle in lines[0], lines[0]
    assert not out.exists()  # nothing written


# --------------------------------------------- 4: a resume after the data changed size


def test_a_finished_budget_resumed_after_the_data_shrank_stays_finished(tmp_path, capsys):
    """18 images in batches of 6, a budget of 3 steps: one epoch. With 12 images an epoch
    has 2 steps, and the resume added a second epoch of 0 steps (train loss 0.0000, 0 img/s)
    to metrics.jsonl, saying nothing of the change."""
    data, run = tmp_path / "data", tmp_path / "run"
    _tree(data, per_class=6)
    _train(*_folder_run(data, run, "--iters", "3"))
    rows = (run / "metrics.jsonl").read_bytes()
    assert len(rows.splitlines()) == 1
    for c in ("ant", "bee", "cat"):
        for i in (4, 5):
            (data / "train" / c / f"{i}.png").unlink()
    capsys.readouterr()
    _train("--out", str(run), "--resume", "auto")
    out = capsys.readouterr().out
    assert (run / "metrics.jsonl").read_bytes() == rows  # nothing appended
    note = (
        f"{run / 'last'}: the training split has 12 images, not 18 as when it was saved "
        "(2 steps an epoch, not 3); the run's budget of 3 steps is spent: it is finished"
    )
    assert note in out and note in (run / "train.log").read_text()
    assert f"{run}: the run is finished (epoch 1 of 1); nothing to do" in out
    assert "0 img/s" not in out


def test_a_budget_resumed_after_the_data_grew_trains_its_steps_left(tmp_path, capsys):
    """12 images, 2 steps an epoch, a budget of 6 cut after the first epoch; with 36 images
    (6 steps an epoch) the budget's epochs were counted from 0 (one), and the resume found the
    run finished with 4 steps left."""
    data, run = tmp_path / "data", tmp_path / "run"
    _tree(data, per_class=4)
    _train(*_folder_run(data, run, "--iters", "6", "--set", "time_limit_min=1e-9"))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    for c in ("ant", "bee", "cat"):
        _images(data / "train" / c, [f"{i}.png" for i in range(4, 12)], seed=2)
    capsys.readouterr()
    _train("--out", str(run), "--resume", "auto", "--set", "time_limit_min=null")
    out = capsys.readouterr().out
    assert (
        "the training split has 36 images, not 12 as when it was saved (6 steps an epoch, "
        "not 2); the budget of 6 steps continues at step 2: 4 more, in 1 epoch(s)"
    ) in out
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1] and rows[1]["train_loss"] > 0
    state = torch.load(run / "last.state.pt", weights_only=True)["train_state"]
    assert state["global_step"] == 6


# ------------------------------------------- 12: samples the streamed sources leave out


def _wds_data(root) -> tuple[list[str], str]:
    """36 training samples in two shards, one undecodable; 12 validation samples, 4 of them
    labelled 5, outside the 3 classes of ``_info.json``."""
    from test_wds import toy_samples, write_shard

    root.mkdir()
    train = toy_samples("train", 0, 36, 0)
    train[2][1]["jpg"] = b"not an image"
    write_shard(root / "toy-train-00.tar", train[:18])
    write_shard(root / "toy-train-01.tar", train[18:])
    val = toy_samples("validation", 0, 12, 100)
    for _, members in val[::3]:
        members["cls"] = b"5"
    val_name = "toy-validation-00.tar"
    write_shard(root / val_name, val)
    splits = {"train": ["toy-train-00.tar", "toy-train-01.tar"], "validation": [val_name]}
    (root / "_info.json").write_text(json.dumps({"classes": ["cat", "dog", "emu"], "splits": {
        k: {"filenames": v} for k, v in splits.items()}}))  # fmt: skip
    return ["--data", "wds", "--batch-size", "12"], f"{root / 'toy-train-00.tar'} sample train0002"


def _hfds_data(root, monkeypatch) -> tuple[list[str], str]:
    """12 training rows, row 3's image undecodable; 6 validation rows."""
    datasets = pytest.importorskip("datasets")
    from test_hfds import toy

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root.parent / "hf-cache"))
    rows = toy(12).to_dict()
    rows["image"][3] = {"bytes": b"not an image", "path": None}
    train = datasets.Dataset.from_dict(rows, features=toy(1).features)
    datasets.DatasetDict(train=train, validation=toy(6)).save_to_disk(str(root))
    return ["--data", "hfds", "--batch-size", "4"], "train[3]"


def _folder_data(root) -> tuple[list[str], str]:
    """An image folder read from its files (``stream: true``): 12 training images, one empty."""
    _tree(root, per_class=4)
    (root / "train" / "bee" / "1.png").write_bytes(b"")
    return ["--data", "imagefolder", "--batch-size", "4", "--set", "stream=true"], str(
        root / "train" / "bee" / "1.png"
    )


@pytest.mark.parametrize("source", ["imagefolder", "wds", "hfds"])
def test_a_streamed_sample_left_out_is_reported_each_epoch(source, tmp_path, capsys, monkeypatch):
    """The streaming loaders left unreadable samples out below max_bad_fraction with no trace
    in stdout, train.log or metrics.jsonl."""
    pytest.importorskip({"wds": "webdataset", "hfds": "datasets"}.get(source, "PIL"))
    data, run = tmp_path / "data", tmp_path / "run"
    if source == "wds":
        args, bad = _wds_data(data)
    elif source == "hfds":
        args, bad = _hfds_data(data, monkeypatch)
    else:
        args, bad = _folder_data(data)
    _train("--model", "lsa_micro_cifar", "--img-size", "16", "--data-dir", str(data), *args,
           "--epochs", "2", "--amp", "none", "--out", str(run), "--set", "log_every=1000",
           "--set", f"cache_dir={tmp_path / 'cache'}", "--set", "workers=0")  # fmt: skip
    out = capsys.readouterr().out
    log = (run / "train.log").read_text()
    lines = [line for line in out.splitlines() if "] epoch " in line]
    assert len(lines) == 2, out
    skipped = f"train loss {{}} (skipped 1 unreadable or unlabelled sample(s), e.g. {bad}"
    for line in lines:  # each epoch reads the sample again, and says so again
        loss = line.split("train loss ")[1].split()[0]
        assert skipped.format(loss) in line and line in log, line
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_skipped"] for r in rows] == [1, 1]
    assert rows[-1]["test_skipped"] == (4 if source == "wds" else 0)
    if source == "wds":  # the evaluation's line says how many were scored
        scored = "% of 8 images (skipped 4 unreadable or unlabelled, e.g. "
        assert all(scored in line and "label 5 is outside [0, 3))" in line for line in lines)
        code, out, err = _cli(capsys, "eval", "--checkpoint", str(run / "last.safetensors"),
                              "--data", "wds", "--data-dir", str(data), "--cache-dir",
                              str(tmp_path / "cache"), "-j", "0")  # fmt: skip
        assert code == 0, err
        assert f"{run / 'last.safetensors'} on wds (8 test images)" in out, out
        left = "4 of 12 images left out (unreadable or unlabelled), e.g. "
        assert left in out and "validation0100: label 5 is outside [0, 3)" in out, out
