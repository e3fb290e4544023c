"""Precision by device: native bf16 read from the CPU's flags, `--amp auto` choosing fp32
where bf16 is emulated, and one warning line, with a measured slowdown, when bf16 is asked
for there anyway."""

from __future__ import annotations

import csv
import io
import warnings

import pytest
import torch

from lgvit.cli import main
from lgvit.core import runtime
from lgvit.tools.bench import BenchOptions, format_result, run_bench

# Excerpts of /proc/cpuinfo: an AMX Xeon, an AVX-512-BF16 EPYC, an AVX2-only EPYC, an AVX-512
# Skylake without bf16 instructions (oneDNN calls it bf16-capable), a Neoverse V1 (Arm BF16).
XEON_AMX = (
    "model name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
)
EPYC_BF16 = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
EPYC_AVX2 = "model name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: avx2 avx512f avx512bw avx512vl\n"
NEOVERSE = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(
    "text, want",
    [
        (XEON_AMX, "amx_bf16"),
        (EPYC_BF16, "avx512_bf16"),
        (EPYC_AVX2, None),
        (SKYLAKE, None),
        (NEOVERSE, "bf16"),
    ],
)
def test_native_bf16_from_cpu_flags(text, want):
    flags = runtime.cpu_flags(text)
    assert flags is not None and runtime.native_bf16(flags) == want


def test_no_flags_line_is_unknown_not_emulated():
    assert runtime.cpu_flags("processor\t: 0\nmodel name\t: something\n") is None


def _emulated(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: None)


def test_auto_picks_fp32_where_bf16_is_emulated(monkeypatch, recwarn):
    _emulated(monkeypatch)
    cpu = torch.device("cpu")
    assert runtime.resolve_amp("auto", cpu) is None
    assert not recwarn.list  # auto chose fp32: nothing to warn about
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: "avx512_bf16")
    assert runtime.resolve_amp("auto", cpu) is torch.bfloat16


def test_explicit_bf16_on_an_emulating_cpu_warns_once_with_the_measured_slowdown(monkeypatch):
    _emulated(monkeypatch)
    monkeypatch.setattr(runtime, "bf16_matmul_slowdown", lambda: 6.25)
    with pytest.warns(UserWarning) as seen:
        assert runtime.resolve_amp("bf16", torch.device("cpu")) is torch.bfloat16
    assert len(seen) == 1
    text = str(seen[0].message)
    assert "emulated" in text and "6.2x slower" in text and "\n" not in text
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: "amx_bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # native bf16: no warning
        runtime.resolve_amp("bf16", torch.device("cpu"))


def test_bf16_slowdown_is_a_measured_ratio():
    slow = runtime.bf16_matmul_slowdown(n=64, repeats=2)
    assert 0 < slow < 1000


def test_cli_prints_one_warning_line_and_bench_rows_say_emulated(monkeypatch, capsys):
    _emulated(monkeypatch)
    code = main(
        ["bench", "lsa_micro_cifar", "--batch-size", "2", "--img-size", "16", "--rounds", "1",
         "--no-memory", "--amp", "bf16", "--format", "csv"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0
    warn = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and warn[0].startswith("lgvit bench: warning: bf16 is emulated")
    row = next(csv.DictReader(io.StringIO(out[out.index("model,") :])))
    assert row["cpu_bf16"] == "bf16 emulated"


def test_bench_names_native_bf16(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_bf16_support", lambda: "amx_bf16")
    opts = BenchOptions(batch_size=1, img_size=16, rounds=1, amp="none", memory=False)
    result = run_bench(["lsa_micro_cifar"], opts, log=lambda m: None)
    assert result["rows"][0]["cpu_bf16"] == "native bf16: amx_bf16"
    assert "native bf16: amx_bf16" in format_result(result, "table")


def test_tune_cpu_allocator_tunes_the_allocator_unless_told_not_to():
    import os
    import subprocess
    import sys

    # create_model leaves the process alone; the library user's one call tunes it
    code = ("import lgvit, lgvit.core.runtime as r; assert not r._done; "
            "lgvit.create_model('lsa_micro_cifar'); assert not r._done; "
            "lgvit.tune_cpu_allocator(); print(r._done)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LGVIT_DEFAULT_MALLOC"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == str(sys.platform.startswith("linux")), out.stderr[-500:]
    env["LGVIT_DEFAULT_MALLOC"] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "False", out.stderr[-500:]
