"""The Hugging Face hub layout: save_pretrained, local-dir: and hf-hub: (mocked), errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

import lgvit
from lgvit.checkpoints.files import save_checkpoint
from lgvit.core.errors import LgvitError


def _logits(model: torch.nn.Module, size: int = 16) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.no_grad():
        return model.eval()(torch.randn(2, 3, size, size))


def test_save_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    m = lgvit.create_model("lsa_micro_cifar", num_classes=3, img_size=16, drop_path_rate=0.0)
    m.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json", "model.safetensors",
    ]  # fmt: skip
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architecture"] == "lsa_micro_cifar" and config["num_classes"] == 3
    assert config["model_args"] == {"img_size": 16, "drop_path_rate": 0.0}
    assert config["pretrained_cfg"]["input_size"] == [3, 16, 16]
    back = lgvit.create_model(f"local-dir:{tmp_path / 'm'}")
    torch.testing.assert_close(_logits(back), _logits(m), rtol=0, atol=0)
    assert back.pretrained_cfg["input_size"] == (3, 16, 16)
    maps = lgvit.create_model(f"local-dir:{tmp_path / 'm'}", features_only=True)
    assert len(maps(torch.randn(1, 3, 16, 16))) == 3


def test_training_checkpoint_keeps_its_preprocessing(tmp_path):
    m = lgvit.create_model("lsa_micro_cifar", num_classes=2, img_size=16)
    meta = {
        "model": "lsa_micro_cifar", "img_size": "16", "classes": json.dumps(["cat", "dog"]),
        "mean": json.dumps([0.5, 0.5, 0.5]), "std": json.dumps([0.25, 0.25, 0.25]),
    }  # fmt: skip
    save_checkpoint(tmp_path / "best", m.state_dict(), {"step": 0}, metadata=meta)
    trained = lgvit.create_model("lsa_micro_cifar", checkpoint_path=str(tmp_path / "best"))
    trained.save_pretrained(tmp_path / "hf")
    back = lgvit.create_model(f"local-dir:{tmp_path / 'hf'}")
    cfg = back.pretrained_cfg
    assert cfg["label_names"] == ["cat", "dog"] and cfg["std"] == (0.25, 0.25, 0.25)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["label_names"] == [
        "cat", "dog",
    ]  # fmt: skip
    torch.testing.assert_close(_logits(back), _logits(m), rtol=0, atol=0)
    # timm's spelling: pretrained=True with a file in the overlay.
    timm_style = lgvit.create_model(
        "lsa_micro_cifar",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "hf" / "model.safetensors")),
        num_classes=2,
        img_size=16,
    )
    torch.testing.assert_close(_logits(timm_style), _logits(m), rtol=0, atol=0)


def test_bad_folders_are_one_line_errors(tmp_path):
    with pytest.raises(LgvitError, match="no config.json"):
        lgvit.create_model(f"local-dir:{tmp_path}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LgvitError, match="not readable JSON"):
        lgvit.create_model(f"local-dir:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "resnet50"}))
    with pytest.raises(LgvitError, match="unknown architecture 'resnet50'"):
        lgvit.create_model(f"local-dir:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "lsa_micro_cifar"}))
    with pytest.raises(LgvitError, match="no model.safetensors"):
        lgvit.create_model(f"local-dir:{tmp_path}")
    odd = lgvit.create_model("lsa_micro_cifar", img_size=16)
    odd.model_args["shifts"] = object()
    with pytest.raises(LgvitError, match="shifts are not plain data"):
        odd.save_pretrained(tmp_path / "x")


def test_hf_hub_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(LgvitError, match="pip install huggingface_hub"):
        lgvit.create_model("hf-hub:someone/lsa")


def test_hf_hub_download_and_push_mocked(tmp_path, monkeypatch):
    # A stand-in for huggingface_hub: "the hub" is a local folder; nothing leaves the machine.
    remote = tmp_path / "remote"
    fake = types.ModuleType("huggingface_hub")

    def hf_hub_download(repo_id: str, filename: str, revision=None) -> str:  # noqa: ANN001
        path = remote / repo_id / filename
        if not path.is_file():
            raise FileNotFoundError(f"{repo_id}/{filename} is not on the hub")
        return str(path)

    class HfApi:
        def create_repo(self, repo_id: str, private: bool, exist_ok: bool) -> None:
            (remote / repo_id).mkdir(parents=True, exist_ok=exist_ok)

        def upload_folder(self, repo_id: str, folder_path: str, commit_message: str):  # noqa: ANN201
            for f in Path(folder_path).iterdir():
                (remote / repo_id / f.name).write_bytes(f.read_bytes())
            return types.SimpleNamespace(commit_url=f"https://hub/{repo_id}/commit/1")

    fake.hf_hub_download, fake.HfApi = hf_hub_download, HfApi
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    m = lgvit.create_model("lsa_micro_cifar", num_classes=4, img_size=16)
    assert m.push_to_hub("me/micro") == "https://hub/me/micro/commit/1"
    back = lgvit.create_model("hf-hub:me/micro")
    torch.testing.assert_close(_logits(back), _logits(m), rtol=0, atol=0)
    with pytest.raises(LgvitError, match="hf-hub:me/missing: FileNotFoundError"):
        lgvit.create_model("hf-hub:me/missing")
