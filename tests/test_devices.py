"""The device parametrization follows ``torch.cuda.is_available()``, and ``make gpu-check`` stops
with a message where no CUDA device is present."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.devices import DEVICES

REPO = Path(__file__).resolve().parents[1]

# A child interpreter in which torch reports CUDA as present or absent, whatever the machine has.
_WITH_CUDA = "import torch; torch.cuda.is_available = lambda: {flag}; "


def _child(flag: bool, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WITH_CUDA.format(flag=flag) + code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _collected(flag: bool) -> list[str]:
    code = (
        "import sys, pytest; sys.exit(pytest.main(['--collect-only', '-q', "
        "'-p', 'no:cacheprovider', 'tests/models/test_fused.py']))"
    )
    out = _child(flag, code)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_cuda_cases_are_collected_exactly_when_cuda_is_available() -> None:
    assert ("cuda" in DEVICES) == torch.cuda.is_available() and DEVICES[0] == "cpu"
    for flag in (False, True):
        ids = _collected(flag)
        on_cpu = [i for i in ids if i.endswith(("[cpu]", "-cpu]"))]
        on_cuda = [i for i in ids if i.endswith(("[cuda]", "-cuda]"))]
        assert len(on_cpu) >= 7  # the parity cases and the determinism test
        # Present: each device case once more, on CUDA; absent: not collected (no skips).
        assert on_cuda == ([i.replace("cpu]", "cuda]") for i in on_cpu] if flag else [])


def test_gpu_check_without_a_cuda_device_stops_with_a_message() -> None:
    out = _child(False, "import runpy; runpy.run_module('tests.gpu_check', run_name='__main__')")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA device here" in out.stderr and "make gpu-check" in out.stderr
    assert out.stdout == ""  # nothing was run


def test_gpu_check_runs_the_scoring_and_attention_benchmarks_on_cuda(capsys) -> None:
    from tests.gpu_check import _benchmarks

    full = [cmd[3:] for cmd in _benchmarks([])]
    assert full == [["scoring", "--device", "cuda"], ["attention", "--device", "cuda"]]
    assert capsys.readouterr().out == ""
    without = [cmd[3:] for cmd in _benchmarks(["transformers"])]
    assert without[1] == ["attention", "--device", "cuda", "--parts", "attention"]
    assert "hybrid stack (needs transformers)" in capsys.readouterr().out
