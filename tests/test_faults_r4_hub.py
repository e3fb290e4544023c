"""Faults and bad input, round four: ``save_pretrained`` folders. Class names in one place (where
timm reads them), checked against the head; the folder on the command line in each of its
forms; a contradictory ``config.json`` refused as a checkpoint's record is; folders timm reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import quick_init
from PIL import Image

import lgvit
from lgvit.checkpoints.files import save_checkpoint
from lgvit.checkpoints.record import CheckpointRecord
from lgvit.cli import main
from lgvit.core.errors import LgvitError


@pytest.fixture(autouse=True)
def _quick_init():
    with quick_init():  # every model here is loaded from a folder: its draw is moot
        yield


def _folder(tmp_path: Path, names: list[str] | None = None, n: int = 3) -> Path:
    """A ``save_pretrained`` folder of a tiny ``n``-class model (16 px), with class names."""
    m = lgvit.create_model("lsa_micro_cifar", num_classes=n, img_size=16)
    if names is not None:
        m.pretrained_cfg["label_names"] = names
    m.pretrained_cfg["dataset"] = "digits"
    return m.save_pretrained(tmp_path / "hf")


def _edit(folder: Path, **keys) -> None:
    """Set top-level keys, and ``pretrained_cfg`` ones given as ``cfg={...}``; None: removed."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for holder, values in ((config["pretrained_cfg"], keys.pop("cfg", {})), (config, keys)):
        holder.update(values)
        for k in [k for k, v in values.items() if v is None]:
            del holder[k]
    path.write_text(json.dumps(config))


def _one_line(e: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


# --------------------------------------------------------------------- 3: class names, once


def test_names_are_written_once_at_the_top_where_timm_reads_them(tmp_path):
    timm = pytest.importorskip("timm")
    folder = _folder(tmp_path, ["cat", "dog", "fox"])
    config = json.loads((folder / "config.json").read_text())
    assert config["label_names"] == ["cat", "dog", "fox"]
    assert "label_names" not in config["pretrained_cfg"]  # one source of names
    assert lgvit.create_model(f"local-dir:{folder}").pretrained_cfg["label_names"] == [
        "cat", "dog", "fox",
    ]  # fmt: skip
    via_timm = timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert list(via_timm.pretrained_cfg["label_names"]) == ["cat", "dog", "fox"]
    # A new head through timm: the folder's names named the old one's outputs.
    other = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=5)
    assert other.num_classes == 5 and "label_names" not in other.pretrained_cfg


def test_names_in_both_places_must_agree(tmp_path):
    folder = _folder(tmp_path, ["cat", "dog", "fox"])
    _edit(folder, label_names=["x", "y", "z"], cfg={"label_names": ["cat", "dog", "fox"]})
    with pytest.raises(LgvitError) as e:
        lgvit.create_model(f"local-dir:{folder}")
    _one_line(e, str(folder / "config.json"), "label_names [x, y, z]",
              "pretrained_cfg.label_names [cat, dog, fox] differ")  # fmt: skip


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c", "d", "e"]])
def test_names_must_name_every_output_of_the_head(tmp_path, names):
    folder = _folder(tmp_path, ["cat", "dog", "fox"])
    _edit(folder, label_names=names)
    with pytest.raises(LgvitError) as e:
        lgvit.create_model(f"local-dir:{folder}")
    _one_line(e, str(folder / "config.json"), f"names {len(names)} classes", "head has 3")
    _edit(folder, label_names=None, cfg={"label_names": names})  # timm's other place: the same
    with pytest.raises(LgvitError, match=f"names {len(names)} classes but the model's head has 3"):
        lgvit.create_model(f"local-dir:{folder}")


def test_a_model_whose_names_fit_another_head_writes_none(tmp_path):
    m = lgvit.create_model("lsa_micro_cifar", num_classes=3, img_size=16)
    m.pretrained_cfg["label_names"] = ["cat", "dog", "fox"]
    m.reset_classifier(4)
    config = json.loads((m.save_pretrained(tmp_path / "hf") / "config.json").read_text())
    assert "label_names" not in config and config["pretrained_cfg"]["num_classes"] == 4
    assert "label_names" not in lgvit.create_model(f"local-dir:{tmp_path / 'hf'}").pretrained_cfg


def test_folders_lgvit_wrote_before_still_load(tmp_path):
    """The layout of earlier versions: names at the top and in pretrained_cfg, the dataset in
    pretrained_cfg."""
    folder = _folder(tmp_path)
    _edit(folder, cfg={"label_names": ["cat", "dog", "fox"], "dataset": "digits"},
          label_names=["cat", "dog", "fox"], dataset=None)  # fmt: skip
    cfg = lgvit.create_model(f"local-dir:{folder}").pretrained_cfg
    assert cfg["label_names"] == ["cat", "dog", "fox"] and cfg["dataset"] == "digits"
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert lgvit.create_model(f"local-dir:{folder}").eval()(x).shape == (1, 3)


# ------------------------------------------------------ 13: the folder on the command line


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _twins(tmp_path: Path, names: list[str]) -> tuple[Path, Path]:
    """The same weights, class names, mean/std and input size (16 px) as a ``save_pretrained``
    folder and as an lgvit checkpoint (whose loading is the reference)."""
    m = lgvit.create_model("lsa_micro_cifar", num_classes=len(names), img_size=16)
    mean, std = (0.3, 0.4, 0.5), (0.2, 0.25, 0.3)
    m.pretrained_cfg.update(label_names=names, mean=mean, std=std)
    folder = m.save_pretrained(tmp_path / "hf")
    record = CheckpointRecord(model="lsa_micro_cifar", img_size=16, num_classes=len(names),
                              classes=tuple(names), mean=mean, std=std)  # fmt: skip
    save_checkpoint(tmp_path / "ck", m.state_dict(), {"step": 0}, metadata=record.to_meta())
    return folder, tmp_path / "ck"


def _forms(folder: Path) -> list[str]:
    return [f"local-dir:{folder}", str(folder), str(folder / "model.safetensors")]


def test_eval_takes_the_folder_in_each_form(tmp_path, capsys):
    folder, ck = _twins(tmp_path, [str(i) for i in range(10)])  # digits' classes
    runs = {}
    for form in [str(ck), *_forms(folder)]:
        rc, out, err = _cli(capsys, "eval", "--checkpoint", form, "--data", "digits",
                            "--amp", "none", "--device", "cpu", "-j", "0", "--json")  # fmt: skip
        assert rc == 0, (form, err)
        runs[form] = json.loads(out)
    ref = runs.pop(str(ck))
    assert ref["preprocessing"]["mean"] == [0.3, 0.4, 0.5] and ref["images"] == 300
    for form, res in runs.items():
        assert res["preprocessing"] == ref["preprocessing"], form
        assert (res["acc1"], res["loss"]) == (ref["acc1"], ref["loss"]), form


def test_predict_takes_the_folder_in_each_form(tmp_path, capsys):
    folder, ck = _twins(tmp_path, ["cat", "dog", "fox"])
    img = tmp_path / "x.png"
    Image.new("RGB", (40, 30), (200, 90, 40)).save(img)
    outs = []
    for form in [str(ck), *_forms(folder)]:
        rc, out, err = _cli(capsys, "predict", "--checkpoint", form, "--device", "cpu",
                            "--json", str(img))  # fmt: skip
        assert rc == 0, (form, err)
        outs.append(json.loads(out))
    assert {lbl for lbl, _ in outs[0][0]["top"]} == {"cat", "dog", "fox"}
    assert all(o == outs[0] for o in outs[1:])
    rc, _, err = _cli(capsys, "predict", "--checkpoint", str(folder), "--model", "lit_ti",
                      str(img))  # fmt: skip
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert f"{folder} holds lsa_micro_cifar (its config.json names it), but --model lit_ti" in err


def test_export_takes_the_folder_in_each_form(tmp_path, capsys):
    folder, _ = _twins(tmp_path, ["cat", "dog", "fox"])
    from lgvit.tools.export import file_metadata

    for i, form in enumerate(_forms(folder)):
        out = tmp_path / f"m{i}.pt2"
        rc, _, err = _cli(capsys, "export", form, "--format", "pt2", "--out", str(out),
                          "--no-check")  # fmt: skip
        assert rc == 0, (form, err)
        meta = file_metadata(out)
        assert meta["lgvit_model"] == "lsa_micro_cifar", form
        assert json.loads(meta["label_names"]) == ["cat", "dog", "fox"], form
        assert json.loads(meta["mean"]) == [0.3, 0.4, 0.5], form
        assert json.loads(meta["input_size"]) == [3, 16, 16], form


def test_a_directory_without_a_checkpoint_suggests_none_it_lacks(tmp_path, capsys):
    rc, _, err = _cli(capsys, "predict", "--checkpoint", str(tmp_path), str(tmp_path / "x.png"))
    assert rc == 2 and "no checkpoint in it" in err and "save_pretrained folder" in err, err


# ------------------------------------------------- 14: a config.json that contradicts itself


@pytest.mark.parametrize(
    ("cfg", "key", "words"),
    [
        ({"std": [0, 0, 0]}, "pretrained_cfg.std", "3 positive numbers"),
        ({"mean": [0.5, "0.5", 0.5]}, "pretrained_cfg.mean", "list of 3 numbers"),
        ({"interpolation": "lanczos9"}, "pretrained_cfg.interpolation", "one of bicubic"),
        ({"crop_pct": 0}, "pretrained_cfg.crop_pct", "(0, 1]"),
        ({"label_names": ["cat", " ", "fox"]}, "pretrained_cfg.label_names", "class names"),
    ],
)  # fmt: skip
def test_config_values_follow_the_records_rules(tmp_path, capsys, cfg, key, words):
    folder = _folder(tmp_path)
    _edit(folder, cfg=cfg)
    rc, _, err = _cli(capsys, "predict", "--checkpoint", str(folder), str(tmp_path / "x.png"))
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert f"{folder / 'config.json'}: {key} " in err and words in err, err


def test_the_record_and_the_folder_share_one_rule_per_key():
    from lgvit.checkpoints.record import value_problem

    assert value_problem("std", [0.2, 0.2, 0.2]) is None
    assert value_problem("std", [0, 0.2, 0.2]) == "a JSON list of 3 positive numbers"
    assert value_problem("num_classes", 3) is None
    for bad in ("3", 3.0, True, 0):  # a JSON string or float is not the record's whole number
        assert value_problem("num_classes", bad) is not None, bad
    assert value_problem("mean", "[0.5, 0.5, 0.5]") is not None  # a string, not a list
    assert value_problem("dataset", 5) is not None and value_problem("dataset", "digits") is None


def test_input_size_must_be_the_models(tmp_path, capsys):
    folder = _folder(tmp_path)  # built at 16
    _edit(folder, cfg={"input_size": [3, 64, 64]})
    with pytest.raises(LgvitError) as e:
        lgvit.create_model(f"local-dir:{folder}")
    _one_line(e, f"{folder / 'config.json'}: pretrained_cfg.input_size [3, 64, 64]", "[3, 16, 16]")
    rc, _, err = _cli(capsys, "export", str(folder), "--format", "hf", "--out",
                      str(tmp_path / "out"))  # fmt: skip
    assert rc == 2 and "pretrained_cfg.input_size" in err and not (tmp_path / "out").exists()
    _edit(folder, cfg={"input_size": [3, 16, 16]})
    # Built at another size by the caller: the model's own input size, not the folder's.
    m = lgvit.create_model(f"local-dir:{folder}", img_size=32)
    assert m.pretrained_cfg["input_size"] == (3, 32, 32)
    with torch.no_grad():
        assert m.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)


# ----------------------------------------------------------------- 15: folders timm reads


def test_lgvit_keys_stay_out_of_timms_pretrained_cfg(tmp_path):
    """timm builds its PretrainedCfg from pretrained_cfg: a key it lacks (lgvit's dataset) was
    a TypeError for any architecture of timm's own."""
    timm = pytest.importorskip("timm")
    folder = _folder(tmp_path, ["cat", "dog", "fox"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "lsa_micro_cifar" and config["dataset"] == "digits"
    assert set(config["pretrained_cfg"]) <= set(timm.models.PretrainedCfg.__dataclass_fields__)
    _edit(folder, architecture="test_vit", model_args={})
    m = timm.create_model(f"local-dir:{folder}")  # timm's own model, from lgvit's folder
    assert m.num_classes == 3 and list(m.pretrained_cfg["label_names"]) == ["cat", "dog", "fox"]
    assert lgvit.create_model(f"local-dir:{_folder(tmp_path / 'b')}").pretrained_cfg[
        "dataset"
    ] == "digits"  # fmt: skip


def test_a_folder_without_architecture_is_one_line(tmp_path, capsys):
    folder = _folder(tmp_path)
    _edit(folder, architecture=None)
    rc, _, err = _cli(capsys, "predict", "--checkpoint", f"local-dir:{folder}", "x.png")
    assert rc == 2 and err.strip().count("\n") == 0, err
    missing = "the key 'architecture' (the model to build) is missing"
    assert f"{folder / 'config.json'}: {missing}" in err, err
    _edit(folder, architecture=["lsa_micro_cifar"])
    with pytest.raises(LgvitError, match=r"architecture \['lsa_micro_cifar'\] is not a model name"):
        lgvit.create_model(f"local-dir:{folder}")
