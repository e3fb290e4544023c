"""``data_on_device``: the decoded splits moved to the device once, batches indexed and augmented
there. The same batches as the default path (the images on the host, each batch copied) from
the same seed, through the task's own loaders: on the CPU here, on a GPU under
LGVIT_TEST_DEVICE=cuda (the GPU check's part b), where the two paths differ. The configs that
use it start; what it cannot take is one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.core.runtime import Dist
from lgvit.data.datasets import load_dataset
from lgvit.data.splits import FileImageSet, splits_on_device
from lgvit.run.config import TrainConfig, config_to_dict, load_config, validate_config
from lgvit.tasks.classification.train import ClassificationTask

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "lgvit" / "configs"
NEW_CONFIGS = ("cifar10_lsa_tiny_gpu_fast", "cifar10_lsa_tiny_paper")


def _batches(device: str, on_device: bool, epochs: int = 2) -> tuple[list, list, torch.Tensor]:
    """Every training batch of ``epochs`` epochs and the test batches of the task's loaders,
    with the whole DeiT recipe on (crop, alternating flip, RandAugment, erasing, mixup/cutmix)
    so that every draw a batch makes is compared; and the train loader's images."""
    cfg = TrainConfig(model="lsa_micro_cifar", data="synthetic", batch_size=32, seed=3,
                      alternate_flip=True, data_on_device=on_device)  # fmt: skip
    prepared = ClassificationTask().prepare(cfg, Dist(device=torch.device(device)))
    train, test = prepared.train_loader, prepared.test_loader
    out = []
    for epoch in range(epochs):
        train.set_epoch(epoch)
        out += [tuple(t.cpu() for t in b) for b in train]
    return out, [tuple(t.cpu() for t in b) for b in test], train.images


@pytest.mark.device
def test_on_device_batches_are_the_default_paths(device):
    want_train, want_test, host = _batches(device, on_device=False)
    got_train, got_test, images = _batches(device, on_device=True)
    assert host.device.type == "cpu" and images.device.type == device
    assert len(got_train) == len(want_train) == 2 * (512 // 32)
    for got, want in zip(got_train + got_test, want_train + want_test, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert want_train[0][1].shape == (32, 10)  # soft targets: mixup/cutmix ran


def test_the_splits_move_whole_and_keep_their_classes_and_statistics():
    splits = load_dataset("synthetic", synthetic_size=(12, 5), num_classes=3, seed=1)
    moved = splits_on_device(splits, "meta")  # a device apart from the host, without a GPU
    for before, after in ((splits.train, moved.train), (splits.test, moved.test)):
        assert after.images.device.type == after.labels.device.type == "meta"
        assert after.images.shape == before.images.shape and after.images.dtype == torch.uint8
        assert after.classes == before.classes
        assert before.images.device.type == "cpu"  # the host's split is left as it was
    assert (moved.name, moved.mean, moved.std) == (splits.name, splits.mean, splits.std)


def test_a_streamed_split_or_one_too_large_for_the_gpu_is_one_line(monkeypatch):
    splits = load_dataset("synthetic", synthetic_size=(12, 5), num_classes=3)
    files = FileImageSet(["a.png"], torch.tensor([0]), ["x"])
    with pytest.raises(LgvitError, match="the test split of synthetic is read from its files"):
        splits_on_device(dataclasses.replace(splits, test=files), "cpu")
    need = sum(s.images.nbytes + s.labels.nbytes for s in (splits.train, splits.test))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need, 2 * need))
    with pytest.raises(LgvitError, match=r"more than 50% of the 0\.0 GiB free on cuda"):
        splits_on_device(splits, "cuda")


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ({"data": "wds", "data_dir": "x"}, "needs a split decoded into memory (data=wds is read"),
        ({"stream": True}, "(stream=true: the files are read while training)"),
        ({"task": "segmentation", "data": "ade20k", "data_dir": "x"}, "applies to task=class"),
    ],
)
def test_the_config_refuses_data_on_device_where_nothing_is_decoded(keys, needle):
    cfg = TrainConfig(data_on_device=True, **keys)
    with pytest.raises(LgvitError, match="data_on_device=True") as e:
        validate_config(cfg)
    assert needle in str(e.value)


def test_the_paper_config_is_the_paper_recipe_of_cifar10_lsa_tiny():
    """One recipe in two files: the GPU form differs only in how it runs."""
    paper = config_to_dict(load_config(str(CONFIGS / "cifar10_lsa_tiny_paper.yaml")))
    base = config_to_dict(load_config(str(CONFIGS / "cifar10_lsa_tiny.yaml")))
    differ = {k for k in paper if paper[k] != base[k]}
    assert differ == {"batch_size", "data_on_device", "eval_every", "out"}
    assert paper["batch_size"] == paper["lr_base_batch"] == 512  # the paper's lr as written


@pytest.mark.parametrize("name", NEW_CONFIGS)
def test_the_gpu_configs_start(name, tmp_path):
    """Two steps of each at batch 4 on synthetic data, with its model, recipe, schedule and
    progressive resizing; the run records its config as shipped."""
    out = tmp_path / "run"
    code = main(["train", "--config", name, "--data", "synthetic", "--iters", "2", "--batch-size",
                 "4", "--amp", "none", "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert code == 0
    saved = load_config(str(out / "config.yaml"))
    assert saved.data_on_device is True and saved.model == "lsa_tiny_cifar"
    assert (out / "last.safetensors").exists()
