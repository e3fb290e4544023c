"""The authors' released weights by name: the table, the download cache and every path that
loads from it (create_model, timm.create_model, create_detector, create_segmenter, eval/predict by
name, the ``lgvit weights`` commands).

A local HTTP server on 127.0.0.1 stands for the authors' release pages (``$LGVIT_WEIGHTS_MIRROR``
points lgvit at it); it serves files in each authors' layout, built from the key/shape fixtures
with random values, and can answer 404, close mid-body or send less than its Content-Length.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import quick_init

import lgvit
from lgvit.cli import main
from lgvit.core.errors import LgvitError
from lgvit.models.download import ENV_DIR, ENV_MIRROR, read_record
from lgvit.models.weights import WEIGHTS, Weights, find_weights

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = find_weights("localvit_tiny.in1k_authors")  # 5.9M parameters: the real-size test file


# ----------------------------------------------------------------------------- the server


class FakeReleases:
    """Files by name over HTTP; ``mode[name]``: ok, 404, interrupt (no Content-Length, the
    connection closed halfway), truncate (a Content-Length larger than the body sent)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.mode: dict[str, str] = {}
        self.hits: Counter[str] = Counter()
        self.delay = 0.0
        releases = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                name = self.path.lstrip("/")
                releases.hits[name] += 1
                body, mode = releases.files.get(name), releases.mode.get(name, "ok")
                if body is None or mode == "404":
                    self.send_error(404)
                    return
                time.sleep(releases.delay)
                self.send_response(200)
                if mode != "interrupt":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body if mode == "ok" else body[: len(body) // 2])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.files.clear()
        self.mode.clear()
        self.hits.clear()
        self.delay = 0.0


@pytest.fixture(autouse=True)
def _quick_init():
    """Models built here are loaded strictly from a file, which sets every value, so their
    initial draw does not matter."""
    with quick_init():
        yield


@pytest.fixture(scope="module")
def releases():
    server = FakeReleases()
    yield server
    server.httpd.shutdown()


@pytest.fixture
def cache(tmp_path, monkeypatch, releases):
    """An empty weights cache, downloads going to the fake release server."""
    releases.reset()
    folder = tmp_path / "weights"
    monkeypatch.setenv(ENV_DIR, str(folder))
    monkeypatch.setenv(ENV_MIRROR, releases.base)
    return folder


# ------------------------------------------------------------------- the authors' files


def _pvt_full_msa(keys: list) -> dict[str, list[int]]:
    """Their PVT-S layout -> their ``pvt_full_msa.py`` (classification/code_for_lit_ti): no
    spatial reduction, one fused ``qkv`` per block (q's rows, then kv's)."""
    out = {}
    for key, shape in keys:
        if re.search(r"\.attn\.(sr|norm|kv)\.", key):
            continue
        out[key.replace(".attn.q.", ".attn.qkv.")] = (
            [3 * shape[0], *shape[1:]] if ".attn.q." in key else shape
        )
    return out


def _shapes(w: Weights) -> dict[str, list[int]]:
    if w.task == "detection":
        return json.loads((FIXTURES / f"mmdet_{w.detector}_{w.model}_keys.json").read_text())
    if w.task == "segmentation":
        return json.loads((FIXTURES / f"mmseg_semfpn_{w.model}_keys.json").read_text())
    if w.model.startswith("lit_"):
        return dict(json.loads((FIXTURES / "lit_keys.json").read_text())[w.model])
    keys = json.loads((FIXTURES / "localvit_authors_keys.json").read_text())
    if w.model == "pvt_small_full_msa":
        return _pvt_full_msa(keys["pvt_small"])
    return dict(keys[w.model])


def _state(w: Weights, seed: int = 0, cheap: bool = False) -> dict[str, torch.Tensor]:
    """Random values in the authors' key names and shapes. ``cheap``: each tensor one random
    number expanded to its shape (torch.save keeps the one-number storage, so an 87M-parameter
    file is a few hundred KB and every released model can be served in a few seconds)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in _shapes(w).items():
        if key.endswith("num_batches_tracked"):
            out[key] = torch.tensor(7)
        elif cheap:
            out[key] = torch.randn(1, generator=g).expand(shape)
        else:
            out[key] = torch.randn(shape, generator=g)
    return out


def _file(w: Weights, state: dict[str, torch.Tensor]) -> bytes:
    """As their training scripts save: DeiT/Swin's dict with the argparse Namespace (which
    weights_only refuses; lgvit reads the weights beside it), mmdet/mmseg's meta + state_dict."""
    if w.task == "classification":
        obj = {"model": state, "epoch": 299, "args": argparse.Namespace(model=w.model)}
    else:
        obj = {"meta": {"iter": 80000, "mmcv_version": "1.3.0"}, "state_dict": state}
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@functools.cache
def _small_file(seed: int = 0) -> bytes:
    return _file(SMALL, _state(SMALL, seed))


def _serve_small(releases: FakeReleases, seed: int = 0) -> bytes:
    releases.files[SMALL.filename] = data = _small_file(seed)
    return data


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def _left(folder: Path) -> list[str]:
    """What a failed download left in the cache besides the lock file."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------- table


def test_the_table_names_registered_models_and_release_files():
    names = lgvit.list_models()
    assert len(WEIGHTS) == 17 and len({w.name for w in WEIGHTS}) == 17
    for w in WEIGHTS:
        assert w.model in names and re.fullmatch(r"[a-z0-9_]+", w.tag)
        assert re.fullmatch(r"https://github\.com/[\w-]+/(LIT|LocalViT)/releases/download/"
                            r"v[\d.]+/[\w]+\.pth", w.url), w.url  # fmt: skip
        assert w.license in ("apache-2.0", "mit") and w.paper_ids.startswith("arXiv:")
        assert w.metrics and (w.detector is not None) == (w.task == "detection")
    assert find_weights("lit_ti.in1k_authors").metrics == {"top1": 81.1}
    assert find_weights("lit_s.coco_maskrcnn_authors").metrics == {"box_ap": 42.9, "mask_ap": 39.6}
    assert find_weights("pvt_small_full_msa.in1k_authors").filename == "pvt_full_msa.pth"


def test_no_weights_wrong_tag_wrong_task_are_one_line():
    with pytest.raises(LgvitError) as e:
        lgvit.create_model("lsa_micro_cifar", pretrained=True)
    assert "no released classification weights" in _one_line(e) and "lit_ti" in str(e.value)
    with pytest.raises(LgvitError, match="no such weights.*lit_ti.in1k_authors"):
        lgvit.create_model("lit_ti.in21k", pretrained=True)
    with pytest.raises(LgvitError, match=r"detection weights .*create_detector\('retinanet'"):
        lgvit.create_model("lit_ti.coco_retinanet_authors", pretrained=True)
    from lgvit.dense.semfpn import create_segmenter

    with pytest.raises(LgvitError, match="has 150 classes .* num_classes=19"):
        create_segmenter("lit_ti", 19, pretrained=True)
    # The name.tag form without pretrained builds the architecture.
    with torch.device("meta"):
        assert lgvit.create_model("lit_ti.in1k_authors").model_name == "lit_ti"


# ------------------------------------------------------------------------------- the cache


def test_first_download_then_cache_hits(cache, releases):
    data = _serve_small(releases)
    m = lgvit.create_model("localvit_tiny", pretrained=True)
    assert releases.hits[SMALL.filename] == 1
    path = cache / SMALL.filename
    assert path.read_bytes() == data
    assert read_record(path)["sha256"] == hashlib.sha256(data).hexdigest()
    state = _state(SMALL)
    assert torch.equal(m.head.weight, state["head.weight"])
    cfg = m.pretrained_cfg
    assert (cfg["tag"], cfg["license"], cfg["paper_ids"]) == ("in1k_authors", "mit",
                                                              "arXiv:2104.05707")  # fmt: skip
    assert cfg["url"] == SMALL.url and cfg["origin_url"].endswith("ofsoundof/LocalViT")
    # Again, by tag, with timm's new-classifier rule and a features model: no second request.
    again = lgvit.create_model("localvit_tiny.in1k_authors", pretrained=True, num_classes=10)
    feats = lgvit.create_model("localvit_tiny", pretrained=True, features_only=True)
    assert releases.hits[SMALL.filename] == 1
    assert again.num_classes == 10 and torch.equal(again.blocks[0].attn.proj.weight,
                                                   m.blocks[0].attn.proj.weight)  # fmt: skip
    assert len(feats(torch.randn(1, 3, 224, 224))) == len(feats.feature_info)
    assert _left(cache) == [SMALL.filename, SMALL.filename + ".lgvit.json"]


def test_interrupted_and_truncated_downloads_keep_nothing(cache, releases):
    _serve_small(releases)
    url = f"{releases.base}/{SMALL.filename}"
    for mode, said in (("interrupt", "not a valid PyTorch checkpoint"),
                       ("truncate", "the connection closed after")):  # fmt: skip
        releases.mode[SMALL.filename] = mode
        with pytest.raises(LgvitError) as e:
            lgvit.create_model("localvit_tiny", pretrained=True)
        text = _one_line(e)
        assert url in text and said in text and "checkpoint_path=FILE" in text
        assert _left(cache) == []  # no file, no temp file, no record
    releases.mode[SMALL.filename] = "ok"  # the next try downloads it whole
    lgvit.create_model("localvit_tiny", pretrained=True)
    assert _left(cache) == [SMALL.filename, SMALL.filename + ".lgvit.json"]


def test_404_and_offline_name_the_url_and_the_way_by_hand(cache, releases, monkeypatch):
    with pytest.raises(LgvitError) as e:
        lgvit.create_model("localvit_tiny", pretrained=True)
    text = _one_line(e)
    assert f"could not download {releases.base}/localvit_t.pth (HTTP 404" in text
    assert "checkpoint_path=FILE" in text and str(cache / "localvit_t.pth") in text
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(ENV_MIRROR, f"http://127.0.0.1:{port}")
    with pytest.raises(LgvitError, match=f"could not download http://127.0.0.1:{port}/") as e:
        lgvit.create_model("localvit_tiny", pretrained=True)
    _one_line(e)
    assert _left(cache) == []


def test_a_file_that_does_not_fit_is_refused_and_not_kept(cache, releases):
    buf = io.BytesIO()
    torch.save({"model": {"blocks.0.nope": torch.zeros(3)}}, buf)
    releases.files[SMALL.filename] = buf.getvalue()
    with pytest.raises(LgvitError) as e:
        lgvit.create_model("localvit_tiny", pretrained=True)
    text = _one_line(e)
    assert f"{releases.base}/localvit_t.pth does not fit model localvit_tiny" in text
    assert "not kept" in text and ".tmp-" not in text
    assert _left(cache) == []


def test_a_later_different_file_under_the_same_name_is_refused(cache, releases):
    _serve_small(releases, seed=0)
    lgvit.create_model("localvit_tiny", pretrained=True)
    path = cache / SMALL.filename
    # Replaced in the cache by other weights of the same layout.
    path.write_bytes(_small_file(seed=1))
    with pytest.raises(LgvitError, match="sha256 .* differs from the .* recorded") as e:
        lgvit.create_model("localvit_tiny", pretrained=True)
    assert str(path) in _one_line(e)
    # Deleted; the server now serves another file: refused, not kept, the record stands.
    path.unlink()
    _serve_small(releases, seed=1)
    with pytest.raises(LgvitError, match="is not the one recorded in") as e:
        lgvit.create_model("localvit_tiny", pretrained=True)
    _one_line(e)
    assert _left(cache) == [SMALL.filename + ".lgvit.json"]
    _serve_small(releases, seed=0)  # the recorded file again: accepted
    lgvit.create_model("localvit_tiny", pretrained=True)


def test_a_file_copied_into_the_cache_by_hand_is_checked_then_used_offline(cache, releases):
    cache.mkdir(parents=True)
    (cache / SMALL.filename).write_bytes(_small_file())
    m = lgvit.create_model("localvit_tiny", pretrained=True)  # nothing served: no request
    assert sum(releases.hits.values()) == 0 and torch.equal(m.head.bias, _state(SMALL)["head.bias"])
    assert read_record(cache / SMALL.filename)["url"] is None  # recorded after the check
    wrong = find_weights("localvit_small.in1k_authors")
    (cache / wrong.filename).write_bytes(_small_file())  # LocalViT-T's weights under S's name
    with pytest.raises(LgvitError, match="does not fit model localvit_small.*remove it") as e:
        lgvit.create_model("localvit_small", pretrained=True)
    _one_line(e)
    assert (cache / wrong.filename).is_file()  # a file put there by hand is left to its owner


_CHILD = """
import sys, lgvit
m = lgvit.create_model("localvit_tiny", pretrained=True)
print("ok", float(m.head.bias.sum()))
"""


def test_two_processes_download_the_same_file_once(cache, releases):
    _serve_small(releases)
    releases.delay = 1.5  # both are in flight at once
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert outs[0][0] == outs[1][0] and outs[0][0].startswith("ok")
    assert releases.hits[SMALL.filename] == 1  # the second found the first's file
    assert _left(cache) == [SMALL.filename, SMALL.filename + ".lgvit.json"]


# --------------------------------------------------------------------- every released file


def _load_released(w: Weights) -> torch.nn.Module:
    if w.task == "detection":
        from lgvit.dense.detection import create_detector

        return create_detector(w.detector, w.model, pretrained=True)
    if w.task == "segmentation":
        from lgvit.dense.semfpn import create_segmenter

        return create_segmenter(w.model, pretrained=True)
    return lgvit.create_model(w.name, pretrained=True)


# Where a value of each file lands in the model (the authors' key -> ours).
_PROBES = {
    "classification": ("head.bias", "head.bias"),
    "detection": ("neck.fpn_convs.0.conv.weight", "backbone.fpn.layer_blocks.0.0.weight"),
    "segmentation": ("decode_head.conv_seg.bias", "decode_head.conv_seg.bias"),
}


@pytest.mark.parametrize("w", WEIGHTS, ids=lambda w: w.name)
def test_every_released_file_downloads_and_loads(w, cache, releases):
    state = _state(w, cheap=True)
    releases.files[w.filename] = _file(w, state)
    model = _load_released(w)  # strict: every key, every shape
    theirs, ours = _PROBES[w.task]
    assert torch.equal(model.state_dict()[ours], state[theirs])
    assert model.pretrained_cfg["tag"] == w.tag and releases.hits[w.filename] == 1
    assert (cache / w.filename).is_file() and read_record(cache / w.filename)


# ------------------------------------------------------------------ timm, eval, the CLI


def test_timm_create_model_pretrained_downloads_through_the_cache(cache, releases, tmp_path):
    import timm

    _serve_small(releases)
    assert "localvit_tiny.in1k_authors" in timm.list_pretrained("localvit*")
    assert timm.models.get_pretrained_cfg("lit_ti").url == find_weights("lit_ti.in1k_authors").url
    m = timm.create_model("localvit_tiny", pretrained=True)
    t = timm.create_model("localvit_tiny.in1k_authors", pretrained=True, num_classes=5)
    assert torch.equal(m.head.weight, _state(SMALL)["head.weight"]) and t.num_classes == 5
    assert releases.hits[SMALL.filename] == 1
    other = tmp_path / "timm_cache"  # timm's cache_dir is the folder
    timm.create_model("localvit_tiny", pretrained=True, cache_dir=other)
    assert (other / SMALL.filename).is_file() and releases.hits[SMALL.filename] == 2
    with pytest.raises(LgvitError, match="no released classification weights"):
        timm.create_model("lsa_micro_cifar", pretrained=True)


def test_eval_and_predict_take_released_weights_by_name(cache, releases, tmp_path, capsys):
    from PIL import Image

    from lgvit.inference import load_model
    from lgvit.tasks.detection.evaluate import load_detector

    _serve_small(releases)
    m = load_model("localvit_tiny.in1k_authors", "cpu")
    assert not m.training and m.pretrained_cfg["tag"] == "in1k_authors"
    with pytest.raises(LgvitError, match="are the weights of localvit_tiny, but --model lit_ti"):
        load_model("localvit_tiny.in1k_authors", "cpu", "lit_ti")
    img = tmp_path / "x.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(img)
    assert main(["predict", "--checkpoint", "localvit_tiny.in1k_authors", "--device", "cpu",
                 "--topk", "2", str(img)]) == 0  # fmt: skip
    assert "x.png: " in capsys.readouterr().out
    w = find_weights("lit_ti.coco_retinanet_authors")
    releases.files[w.filename] = _file(w, _state(w, cheap=True))
    det = load_detector(w.name, "cpu")
    assert det.detector == "retinanet" and len(det.det_info["classes"]) == 80
    assert releases.hits[w.filename] == 1


def test_weights_commands_and_info(cache, releases, capsys):
    _serve_small(releases)
    assert main(["weights", "download", "localvit_tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / SMALL.filename)
    assert main(["weights", "list"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"localvit_tiny\.in1k_authors .* top-1 74.84%, top-5 92.61% +mit +yes", out)
    assert "lit_s.coco_maskrcnn_authors" in out and "Google Drive" in out
    assert main(["weights", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["cached"] for r in rows}["localvit_tiny.in1k_authors"]
    assert main(["weights", "download", "lsa_micro_cifar"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("lgvit weights: error: lsa_micro_cifar: no released")
    assert main(["weights", "download", "localvit_small"]) == 2  # 404 on the server
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["info", "localvit_tiny", "lsa_micro_cifar", "--json"]) == 0
    info = {r["name"]: r["weights"] for r in json.loads(capsys.readouterr().out)}
    assert info == {"localvit_tiny": ["in1k_authors"], "lsa_micro_cifar": []}
    assert main(["info", "localvit_tiny", "lsa_micro_cifar"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"localvit_tiny .* in1k\n", out) and re.search(r"lsa_micro_cifar .* -\n", out)
    from lgvit.cli import _released_weights

    assert _released_weights("lit_ti") == [
        "in1k_authors",
        "coco_retinanet_authors",
        "coco_maskrcnn_authors",
        "ade20k_semfpn_authors",
    ]


def test_convert_and_push_to_hub_write_the_model_card(cache, releases, tmp_path, monkeypatch):
    _serve_small(releases)
    out = tmp_path / "hf"
    assert main(["weights", "convert", "localvit_tiny.in1k_authors", "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    sha = hashlib.sha256(_small_file()).hexdigest()
    for text in ("license: mit", "# localvit_tiny.in1k_authors", "top-1 74.84%", SMALL.url,
                 "arXiv:2104.05707", sha, "weights_only=True"):  # fmt: skip
        assert text in card, text
    back = lgvit.create_model(f"local-dir:{out}")
    assert back.pretrained_cfg["license"] == "mit"
    assert torch.equal(back.head.weight, _state(SMALL)["head.weight"])
    # A file by hand with --model: the release's facts only when its hash is the release's.
    own = tmp_path / "localvit_t.pth"
    own.write_bytes(_small_file(seed=1))
    assert main(["weights", "convert", str(own), "--model", "localvit_tiny",
                 "--out", str(tmp_path / "own")]) == 0  # fmt: skip
    assert "license:" not in (tmp_path / "own" / "README.md").read_text()
    # push_to_hub uploads the same card (a stand-in hub: a local folder).
    remote = tmp_path / "remote"
    fake = types.ModuleType("huggingface_hub")

    class HfApi:
        def create_repo(self, repo_id: str, private: bool, exist_ok: bool) -> None:
            (remote / repo_id).mkdir(parents=True, exist_ok=exist_ok)

        def upload_folder(self, repo_id: str, folder_path: str, commit_message: str) -> str:
            for f in Path(folder_path).iterdir():
                (remote / repo_id / f.name).write_bytes(f.read_bytes())
            return "https://hub/commit/1"

    fake.HfApi = HfApi
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    back.push_to_hub("me/localvit")
    assert "top-1 74.84%" in (remote / "me/localvit" / "README.md").read_text()
