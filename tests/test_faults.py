"""Faults and bad input, round two (issue 28): nothing lost, nothing silently wrong, never a
traceback. One tiny run (stopped mid-epoch) gives the checkpoint the cases below break."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_train import ENV, FAST, lgvit, one_line_error

from lgvit.checkpoints.files import load_metadata, load_weights
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.models import create_model
from lgvit.models.hub import save_pretrained
from lgvit.models.loading import load_initial_weights

# digits has 10 classes; the head has 20 (--num-classes above the data's count)
DIGITS = [*FAST, "--data", "digits", "--num-classes", "20", "--set", "warmup_epochs=0"]


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """A run stopped by SIGTERM at epoch 1 step 5 of 46 (batch 32): a mid-epoch checkpoint."""
    out = tmp_path_factory.mktemp("faults") / "cut"
    p = lgvit("train", *DIGITS, "--epochs", "1", "--out", str(out),
              env={**ENV, "LGVIT_SIGTERM_AT_STEP": "5"})  # fmt: skip
    assert p.returncode == 143, p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), np.uint8)).save(path)
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_error(capsys, *args: str, needles: tuple[str, ...] = ()) -> str:
    rc, _, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def rewrite(cut, dest, tensors=None, **meta_changes):
    """A copy of ``cut/last.safetensors`` with other tensors or metadata values."""
    meta = {**load_metadata(cut / "last"), **meta_changes}
    save_file(tensors or load_weights(cut / "last"), str(dest), metadata=meta)
    return dest


# ------------------------------------------------------------------------------ 2, 3: resume


def test_resume_auto_without_the_checkpoint_is_refused_and_changes_nothing(cut, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cut, run)
    (run / "last.safetensors").unlink()
    before = {f.name: f.read_bytes() for f in run.iterdir()}
    p = lgvit("train", "--out", str(run), "--resume", "auto")
    one_line_error(p, "--resume auto", "holds a run", "last.safetensors")
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before
    # an empty directory (or a new one) still starts a fresh run: nothing to lose there
    from lgvit.run.rundir import check_resumable

    check_resumable(tmp_path / "new", tmp_path / "new" / "last.safetensors")


def test_mid_epoch_resume_with_another_batch_size_is_refused(cut):
    before = (cut / "last.state.pt").read_bytes()
    p = lgvit("train", "--out", str(cut), "--resume", "auto", "--batch-size", "64")
    one_line_error(p, "inside epoch 1", "--batch-size 32")
    assert (cut / "last.state.pt").read_bytes() == before


# ----------------------------------------------------------------------- 4, 7: wrong weights


def test_weights_of_the_wrong_dtype_or_non_finite_are_refused(cut, image, tmp_path, capsys):
    sd = load_weights(cut / "last")
    as_int = {k: v.to(torch.int32) if v.is_floating_point() else v for k, v in sd.items()}
    ints = rewrite(cut, tmp_path / "ints.safetensors", as_int)
    err = cli_error(
        capsys, "predict", "--checkpoint", str(ints), str(image), needles=(str(ints), "int32")
    )
    assert "not floating point" in err
    with pytest.raises(LgvitError, match="int32"):
        create_model("lsa_micro_cifar", checkpoint_path=str(ints))
    nan = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
           for k, v in sd.items()}  # fmt: skip
    nans = rewrite(cut, tmp_path / "nans.safetensors", nan)
    for cmd in (
        ["predict", "--checkpoint", str(nans), str(image)],
        ["export", str(nans), "--format", "hf", "--out", str(tmp_path / "x")],
    ):
        cli_error(capsys, *cmd, needles=(str(nans), "non-finite"))


def test_initial_checkpoint_of_other_shapes_is_one_line(cut, tmp_path):
    sd = load_weights(cut / "last")
    key = next(k for k, v in sd.items() if v.ndim == 2 and "head" not in k and "pos" not in k)
    sd[key] = torch.zeros(sd[key].shape[0] + 3, *sd[key].shape[1:])
    path = tmp_path / "other.safetensors"
    save_file(sd, str(path))
    model = create_model("lsa_micro_cifar", img_size=16, num_classes=20)
    with pytest.raises(LgvitError) as e:
        load_initial_weights(model, str(path))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and key in msg, msg
    assert str(tuple(sd[key].shape)).replace(" ", "")[1:-1] in msg.replace(" ", ""), msg


# ------------------------------------------------------------ 6, 8, 10: metadata and config


def test_img_size_must_be_a_number(tmp_path):
    with pytest.raises(ValueError, match="img_size '32'"):
        create_model("lsa_micro_cifar", img_size="32")
    with pytest.raises(ValueError, match="img_size"):
        create_model("lsa_micro_cifar", img_size=(16, "16"))
    folder = save_pretrained(create_model("lsa_micro_cifar", img_size=16), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_args"]["img_size"] = "16"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LgvitError, match=r"config.json: model_args.img_size '16'"):
        create_model(f"local-dir:{folder}")


def test_predict_names_the_head_outputs_the_data_did_not_name(cut, image, capsys):
    args = ["--checkpoint", str(cut / "last"), str(image), "--topk", "20", "--json"]
    rc, out, err = cli(capsys, "predict", *args)
    assert rc == 0, err
    labels = [lbl for lbl, _ in json.loads(out)[0]["top"]]
    assert len(labels) == 20 and "class_12" in labels and "3" in labels


@pytest.mark.parametrize(
    ("key", "value"),
    [("mean", "5"), ("std", "[1, 2]"), ("model_kwargs", "[]"), ("model_kwargs", '{"foo": 1}'),
     ("classes", '"abc"'), ("classes", "[1, 2]"), ("img_size", "x"), ("crop_pct", "big")],
)  # fmt: skip
def test_malformed_checkpoint_metadata_is_one_line(cut, image, tmp_path, capsys, key, value):
    bad = rewrite(cut, tmp_path / "bad.safetensors", **{key: value})
    cli_error(capsys, "predict", "--checkpoint", str(bad), str(image), needles=(str(bad), key))
    cli_error(
        capsys,
        "export",
        str(bad),
        "--format",
        "hf",
        "--out",
        str(tmp_path / "x"),
        needles=(str(bad), key),
    )
    with pytest.raises(LgvitError, match=key):
        create_model("lsa_micro_cifar", checkpoint_path=str(bad))


def test_short_class_list_in_metadata_names_the_rest(cut, image, tmp_path, capsys):
    short = rewrite(cut, tmp_path / "short.safetensors", classes='["zero", "one"]')
    rc, out, err = cli(
        capsys, "predict", "--checkpoint", str(short), str(image), "--topk", "20", "--json"
    )
    assert rc == 0, err
    labels = {lbl for lbl, _ in json.loads(out)[0]["top"]}
    assert {"zero", "one", "class_2", "class_19"} <= labels


@pytest.mark.parametrize(
    ("key", "value"),
    [("model_args", []), ("model_args", {"foo": 1}), ("pretrained_cfg.mean", "5"),
     ("label_names", "abc"), ("pretrained_cfg.label_names", [1]), ("num_classes", "10"),
     ("pretrained_cfg.input_size", [3, 16]), ("pretrained_cfg.crop_pct", "0.9")],
)  # fmt: skip
def test_malformed_hub_config_is_one_line(tmp_path, key, value):
    folder = save_pretrained(create_model("lsa_micro_cifar", img_size=16), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    outer, _, inner = key.partition(".")
    (config[outer] if inner else config)[inner or outer] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LgvitError, match=f"config.json: {outer}") as e:
        create_model(f"local-dir:{folder}")
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------- 13: damaged caches


def test_a_damaged_decoded_cache_is_rebuilt(tmp_path):
    from test_train import _folder

    from lgvit.data.datasets import load_dataset

    root, cache = tmp_path / "tree", tmp_path / "cache"
    _folder(root, {"train": ["a", "b"], "val": ["a", "b"]}, n=3)
    first = load_dataset("imagefolder", str(root), cache_dir=str(cache))
    want = first.train.images.clone()  # the loaded set maps the cache file: copy it first
    del first
    (npy,) = cache.glob("imagefolder/*.npy")
    meta = npy.with_suffix(".json")
    full = json.loads(meta.read_text())
    damages = [
        lambda: (npy.unlink(), npy.write_bytes(b"")),  # 0 bytes beside a valid JSON
        lambda: meta.write_text(json.dumps({k: v for k, v in full.items() if k != "counts"})),
        lambda: meta.write_text(json.dumps({**full, "skipped": "x"})),
        lambda: meta.write_text("[]"),
    ]
    for damage in damages:
        damage()
        again = load_dataset("imagefolder", str(root), cache_dir=str(cache))
        assert torch.equal(again.train.images, want) and again.test.classes == ["a", "b"]
        del again
        assert json.loads(meta.read_text()) == full  # rebuilt whole


# --------------------------------------------------------------------------- paths (item 9)


def test_paths_that_cannot_be_used_are_one_line(cut, image, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cli_error(capsys, "train", *DIGITS, "--epochs", "1", "--out", str(a_file / "run"),
              needles=(str(a_file), "Not a directory"))  # fmt: skip
    cli_error(capsys, "train", *DIGITS, "--epochs", "1", "--out", str(a_file),
              needles=(str(a_file), "exists"))  # fmt: skip
    ckpt = str(cut / "last")
    cli_error(capsys, "export", ckpt, "--format", "hf", "--out", str(a_file / "x"),
              needles=(str(a_file),))  # fmt: skip
    cli_error(capsys, "viz", ckpt, str(image), "--what", "attention", "--device", "bogus",
              needles=("--device 'bogus'",))  # fmt: skip
    if not torch.cuda.is_available():
        cli_error(capsys, "viz", ckpt, str(image), "--what", "attention", "--device", "cuda",
                  needles=("CUDA is not available",))  # fmt: skip


def test_odd_run_locks_are_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    (out / ".lock").mkdir(parents=True)
    cli_error(capsys, "train", *DIGITS, "--epochs", "1", "--out", str(out),
              needles=(".lock is not a lock file (a folder)",))  # fmt: skip
    (out / ".lock").rmdir()
    (out / ".lock").write_text(
        json.dumps({"pid": 10**30, "host": __import__("socket").gethostname()})
    )
    from lgvit.run.rundir import RunLock

    lock = RunLock(out).acquire()  # a pid no process can have: a stale lock, taken over
    assert "no longer runs" in lock.note
    lock.release()


def test_resume_with_an_initial_checkpoint_is_refused(cut, capsys):
    cli_error(capsys, "train", "--out", str(cut), "--resume", "auto", "--initial-checkpoint",
              str(cut / "last"), needles=("--initial-checkpoint starts a new run",))  # fmt: skip


# --------------------------------------------------------------------------- config (item 11)


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("patch_size=0", "patch_size=0"), ("patch_size=-4", "patch_size=-4"),
        ("seed=18446744073709551616", "seed="), ("crop_padding=100000", "crop_padding=100000"),
        ("crop_padding=-5", "crop_padding=-5"), ("img_size=100000", "img_size=100000"),
        ("drop_path=1", "drop_path=1"),
    ],
)  # fmt: skip
def test_out_of_range_config_values_name_their_key(capsys, setting, needle):
    line = cli_error(capsys, "train", *DIGITS, "--epochs", "1", "--set", setting)
    assert needle in line, line


def test_an_empty_out_is_refused(capsys):
    cli_error(capsys, "train", *DIGITS, "--epochs", "1", "--out", "", needles=("out=''",))


def test_yaml_alias_bombs_and_unhashable_keys_are_refused(tmp_path, capsys):
    bomb = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        bomb.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}"] * 9) + "]")
    bomb.append("model: *i")
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    line = cli_error(capsys, "train", "--config", str(tmp_path / "bomb.yaml"),
                     needles=("bomb.yaml", "YAML aliases"))  # fmt: skip
    assert len(line) < 300
    (tmp_path / "key.yaml").write_text("? [a, b]\n: 1\n")
    cli_error(capsys, "train", "--config", str(tmp_path / "key.yaml"),
              needles=("key.yaml", "a key must be a name, not a list"))  # fmt: skip
    # A few aliases are fine, and a huge value is quoted short.
    (tmp_path / "ok.yaml").write_text(
        "model: &m lsa_micro_cifar\nout: x\nlr: [" + "1," * 5000 + "1]\n"
    )
    line = cli_error(capsys, "train", "--config", str(tmp_path / "ok.yaml"), needles=("lr=",))
    assert len(line) < 300


def test_mid_epoch_resume_with_another_process_count_is_refused(tmp_path):
    from lgvit.run.rundir import check_mid_epoch_batch

    state = {"epoch": 0, "config": {"batch_size": 32},
             "extra": {"mid_epoch": {"batch": 5}, "rng_per_rank": [{}, {}]}}  # fmt: skip
    with pytest.raises(LgvitError, match=r"by 2 process\(es\); resume it with 2"):
        check_mid_epoch_batch(state, None, tmp_path / "last", world_size=1)
    check_mid_epoch_batch(state, None, tmp_path / "last", world_size=2)
    check_mid_epoch_batch({**state, "extra": {"rng_per_rank": [{}, {}]}}, 64, tmp_path, 1)
