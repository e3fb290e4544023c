"""benchmarks/bench_sources.py: its fixture holds the same JPEGs and labels as a folder, as
WebDataset shards and as Hugging Face parquet files, and its ``--smoke`` run prints a row of
numbers for every source and recipe (so the benchmark never rots before it is run for real)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("webdataset", reason="the wds extra (webdataset) is not installed")
pytest.importorskip("datasets", reason="the hfds extra (datasets) is not installed")
pytest.importorskip("timm", reason="timm (the reference the benchmark compares with) is missing")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_sources.py"
NUMBER = r"[+-]?\d+(?:\.\d+)?"


def _load():
    spec = importlib.util.spec_from_file_location("bench_sources", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load()


@pytest.fixture(scope="module")
def smoke_root(bench, tmp_path_factory):
    """The smoke run's fixture, made once through the script's own functions."""
    root = tmp_path_factory.mktemp("bench_sources")
    args = bench.parse_args(["--smoke", "--root", str(root)])
    bench.make_fixture(root, bench.fixture_spec(args), log=lambda _: None)
    return root


def test_every_form_holds_the_same_images_and_labels(bench, smoke_root):
    import datasets
    import webdataset as wds

    classes = sorted(p.name for p in (smoke_root / "folder" / "train").iterdir())
    folder = {
        p.stem: (p.read_bytes(), classes.index(p.parent.name))
        for p in (smoke_root / "folder" / "train").glob("*/*.jpg")
    }
    assert len(folder) == bench.SMOKE["images"] and len(classes) == bench.NUM_CLASSES

    info = json.loads((smoke_root / "wds" / "_info.json").read_text())["splits"]["train"]
    shards = [str(smoke_root / "wds" / f) for f in info["filenames"]]
    samples = {
        s["__key__"]: (s["jpg"], int(s["cls"])) for s in wds.WebDataset(shards, shardshuffle=False)
    }
    assert samples == folder
    assert sum(info["shard_lengths"]) == info["num_samples"] == len(folder)

    files = sorted(str(p) for p in (smoke_root / "hfds").glob("train-*.parquet"))
    assert len(files) == bench.SMOKE["hf_shards"]
    ds = datasets.load_dataset("parquet", data_files=files, split="train",
                               cache_dir=str(smoke_root / "test_cache"))  # fmt: skip
    assert ds.features["label"].names == classes
    parquet = sorted((r["image"]["bytes"], r["label"]) for r in ds.cast_column(
        "image", datasets.Image(decode=False)))  # fmt: skip
    assert parquet == sorted(folder.values())


def test_fixture_is_reused_only_when_its_parameters_match(bench, tmp_path):
    args = bench.parse_args(["--smoke", "--root", str(tmp_path), "--random-images"])
    spec = bench.fixture_spec(args)
    log: list[str] = []
    bench.make_fixture(tmp_path, spec, log=log.append)
    bench.make_fixture(tmp_path, spec, log=log.append)
    more = type(spec)(**{**spec.__dict__, "images": spec.images + 10})
    bench.make_fixture(tmp_path, more, log=log.append)
    assert [line.split()[0] for line in log] == ["writing", "reusing", "writing"]
    assert len(list((tmp_path / "folder" / "train").glob("*/*.jpg"))) == more.images


def test_smoke_prints_numbers_for_every_source_and_recipe(bench, smoke_root):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--root", str(smoke_root), "--recipe", "both"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "reusing the images" in text
    assert re.search(r"^CPU: .+ \(bf16 flags: .+\), \d+ cores; torch .+, \d+ threads", text, re.M)
    for recipe in ("basic", "deit"):
        assert f"\n{recipe} recipe (" in text
    rows = [
        line.split(" | ") for line in text.splitlines() if line.split(" | ")[0] in bench.SOURCES
    ]
    assert [r[0] for r in rows] == [*bench.SOURCES, *bench.SOURCES]  # each source, both recipes
    for row in rows:
        assert len(row) == 8 and all(re.fullmatch(NUMBER, c) for c in row[1:]), row
        assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0, row
