"""Training config: defaults, YAML, command-line flags, --set overrides, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lgvit.core.errors import LgvitError
from lgvit.run.config import (
    TrainConfig,
    config_from_dict,
    config_keys,
    config_to_dict,
    load_config,
    save_config,
    scaled_lr,
)


def _yaml(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(*args, **kwargs) -> str:
    with pytest.raises(LgvitError) as err:
        load_config(*args, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg == TrainConfig()
    assert (cfg.model, cfg.epochs, cfg.batch_size, cfg.lr) == ("lsa_micro_cifar", 300, 64, 5e-4)
    assert cfg.opt_betas == (0.9, 0.999) and cfg.num_classes is None and cfg.amp == "auto"


def test_yaml_overrides_defaults(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "epochs: 10\nlr: 5e-4\nwarmup_lr: 1.0e-6\nopt_betas: [0.9, 0.95]\n"
        "clip_grad: null\nhflip: false\ndata: synthetic\nwarmup_epochs: 2\n",
    )
    cfg = load_config(path)
    assert cfg.epochs == 10
    assert cfg.lr == 5e-4 and isinstance(cfg.lr, float)  # YAML 1.1 reads "5e-4" as a string
    assert cfg.warmup_lr == 1e-6
    assert cfg.opt_betas == (0.9, 0.95)
    assert cfg.clip_grad is None and cfg.hflip is False and cfg.data == "synthetic"
    assert cfg.warmup_epochs == 2.0 and isinstance(cfg.warmup_epochs, float)
    assert cfg.batch_size == 64  # untouched keys keep their defaults
    assert load_config(_yaml(tmp_path, "", "empty.yaml")) == TrainConfig()


def test_precedence_defaults_yaml_cli_then_set(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "epochs: 10\nbatch_size: 32\nseed: 5\n")
    cfg = load_config(path, [], epochs=20, batch_size=None)
    assert (cfg.epochs, cfg.batch_size, cfg.seed) == (20, 32, 5)  # None flags do not override
    cfg = load_config(path, ["epochs=30", "seed=7"], epochs=20)
    assert (cfg.epochs, cfg.seed) == (30, 7)
    cfg = load_config(path, ["seed=1", "seed=2"])
    assert cfg.seed == 2  # later --set items win


@pytest.mark.parametrize(
    ("item", "key", "expected"),
    [
        ("epochs=12", "epochs", 12),
        ("lr=1e-3", "lr", 1e-3),
        ("lr=2", "lr", 2.0),
        ("hflip=false", "hflip", False),
        ("ema=true", "ema", True),
        ("num_classes=null", "num_classes", None),
        ("clip_grad=none", "clip_grad", None),
        ("time_limit_min=1.5", "time_limit_min", 1.5),
        ("rand_augment=null", "rand_augment", None),
        ("rand_augment=rand-m7-mstd0.5", "rand_augment", "rand-m7-mstd0.5"),
        ("opt_betas=[0.9, 0.95]", "opt_betas", (0.9, 0.95)),
        ("opt_betas=0.8,0.9", "opt_betas", (0.8, 0.9)),
        ("out=007", "out", "007"),  # the text typed, not YAML's int 7
        ("resume=auto", "resume", "auto"),
        ("resume=", "resume", None),
    ],
)
def test_set_coerces_to_the_field_type(item: str, key: str, expected: object) -> None:
    value = getattr(load_config(None, [item]), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("item", "expected_message"),
    [
        ("epochs=abc", "--set epochs=abc: expected an integer"),
        ("epochs=1.5", "--set epochs=1.5: expected an integer"),
        ("epochs=true", "--set epochs=true: expected an integer"),
        ("epochs=null", "--set epochs=null: expected an integer"),
        ("hflip=maybe", "--set hflip=maybe: expected true or false"),
        ("lr=fast", "--set lr=fast: expected a number"),
        ("clip_grad=big", "--set clip_grad=big: expected a number or null"),
        ("opt_betas=[0.9]", "--set opt_betas=[0.9]: expected a list of 2 numbers"),
        ("epochs", "--set 'epochs': expected key=value"),
        ("=3", "expected key=value"),
    ],
)
def test_set_rejects_bad_values(item: str, expected_message: str) -> None:
    assert expected_message in _error(None, [item])


def test_yaml_and_cli_bad_values_name_the_source(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "batch_size: lots\n")
    msg = _error(path)
    assert str(path) in msg and "batch_size" in msg and "expected an integer" in msg
    assert "--epochs 'x': expected an integer" in _error(None, epochs="x")


def test_unknown_key_suggests_a_close_match_and_lists_valid_keys(tmp_path: Path) -> None:
    msg = _error(None, ["epoch=5"])
    assert "unknown config key 'epoch'" in msg and "did you mean 'epochs'" in msg
    assert all(key in msg for key in config_keys())

    path = _yaml(tmp_path, "batchsize: 8\n")
    msg = _error(path)
    assert str(path) in msg and "'batchsize'" in msg and "did you mean 'batch_size'" in msg

    msg = _error(None, ["zzzz=1"])
    assert "'zzzz'" in msg and "did you mean" not in msg and "valid keys" in msg
    assert "unknown config key 'colour'" in _error(None, colour="red")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("epochs: [1\n", "invalid YAML (line"),
        ("- epochs\n- 3\n", "top level must be a mapping"),
        ("schedule:\n  epochs: 3\n", "'schedule' holds a nested mapping"),
        ("epochs: 3\nepochs: 4\n", "duplicate key 'epochs'"),
    ],
)
def test_bad_yaml_files_are_named(tmp_path: Path, text: str, needle: str) -> None:
    path = _yaml(tmp_path, text)
    msg = _error(path)
    assert str(path) in msg and needle in msg


def test_missing_yaml_file(tmp_path: Path) -> None:
    msg = _error(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in msg and "no such config file" in msg


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        ("epochs=0", "epochs=0 (from --set): must be >= 1"),
        ("batch_size=-2", "batch_size=-2 (from --set): must be >= 1"),
        ("mixup_prob=1.5", "mixup_prob=1.5 (from --set): must be in [0, 1]"),
        ("reprob=-0.1", "reprob=-0.1"),
        ("label_smoothing=1", "label_smoothing=1.0"),
        ("amp=fp8", "amp='fp8' (from --set): must be one of auto, bf16, fp16, none"),
        ("data=imagenet", "data='imagenet' (from --set): must be one of cifar10"),
        ("train_crop=center", "train_crop='center'"),
        ("data=imagefolder", "data_dir=None: data=imagefolder needs data_dir"),
        ("opt_betas=[0.9, 1.5]", "opt_betas=(0.9, 1.5)"),
        ("clip_grad=0", "clip_grad=0.0 (from --set): must be > 0"),
        ("lr=nan", "lr=nan"),
    ],
)
def test_out_of_range_values_are_rejected(item: str, needle: str) -> None:
    assert needle in _error(None, [item])


def test_validation_names_yaml_source(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "epochs: 0\n")
    assert f"epochs=0 (from {path}): must be >= 1" in _error(path)


def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "epochs=7",
            "lr=3e-4",
            "opt_eps=1e-9",
            "opt_betas=[0.9, 0.95]",
            "clip_grad=null",
            "num_classes=10",
            "rand_augment=null",
            "data=imagefolder",
            "data_dir=/data/x",
            "out=007",
            "time_limit_min=2.5",
            "ema=true",
        ],
    )
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    data = yaml.safe_load(path.read_text())
    assert data["opt_betas"] == [0.9, 0.95] and data["out"] == "007"
    assert list(data) == config_keys()
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert save_config(TrainConfig(), path) is None and load_config(path) == TrainConfig()
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp files left


def test_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(LgvitError, match="checkpoint: unknown config key 'old_key'"):
        config_from_dict({"old_key": 1}, source="checkpoint")


def test_scaled_lr() -> None:
    cfg = TrainConfig(lr=5e-4, batch_size=64, lr_base_batch=512)
    assert scaled_lr(cfg, 8) == pytest.approx(5e-4)
    assert scaled_lr(cfg, 1) == pytest.approx(5e-4 / 8)
    assert scaled_lr(TrainConfig(lr=1e-3, batch_size=128, lr_base_batch=256), 2) == 1e-3


# ------------------------------------------------------------------ the shipped configs


CONFIGS = sorted((Path(__file__).parent.parent / "src/lgvit/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds_its_model(path):
    import torch

    import lgvit
    from lgvit.tasks.classification.train import model_kwargs

    cfg = load_config(str(path), ["data_dir=/data/imagenet"])  # ImageNet configs need one
    assert lgvit.models.is_model(cfg.model), cfg.model
    size = cfg.img_size or lgvit.get_model_config(cfg.model).input_size[-1]
    with torch.device("meta"):
        m = lgvit.create_model(cfg.model, img_size=size, **model_kwargs(cfg))
    assert sum(p.numel() for p in m.parameters()) > 0
