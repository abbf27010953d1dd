"""``make gpu-check``: the device-parametrized tests on CUDA, ``bench scoring --device cuda`` and
``bench attention --device cuda``.

For a one-GPU machine with its own Python and torch (any recent torch, no network, no vLLM, no
virtualenv): run from the repository root with ``PYTHONPATH=.``. It installs and downloads
nothing. Steps:

1. No CUDA device (``torch.cuda.is_available()`` False): say so and exit 2 — this is a GPU check.
2. Name each optional dependency that is missing and what is not run without it.
3. Import each test module that parametrizes over ``tests.devices.DEVICES``; a module whose
   import needs a missing third-party package is not run, and the package is named.
4. ``pytest -k cuda`` over the modules that import (only their CUDA cases), then the scoring and
   attention benchmarks on CUDA (the attention benchmark's hybrid stack needs transformers).
   Exit non-zero when any fails or when no CUDA test ran.

Example (a machine without transformers)::

    gpu-check: NVIDIA H200, torch 2.9.1, CUDA 12.8, Python 3.12.3
    missing here: transformers (the tiny-model scorer tests)
    not run: tests/models/test_policy.py (needs transformers)
    ... pytest output of the CUDA cases ...
    ... bench scoring --device cuda output ...
    not run: bench attention's hybrid stack (needs transformers)
    ... bench attention --device cuda --parts attention output ...
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# Optional here: what goes untested without each (rollfeed's hard runtime needs, numpy and
# pydantic, are listed too: without them no rollfeed module imports).
OPTIONAL = {
    "numpy": "every rollfeed module",
    "pydantic": "every rollfeed module (payload records)",
    "transformers": "the tiny-model scorer tests and bench attention's hybrid stack",
    "crc32c": "payload checksums (the payload tests, none of them on CUDA)",
    "hypothesis": "the property tests (none of them on CUDA)",
    "pytest_timeout": "per-test timeouts (tests run without one)",
}


def device_test_files() -> list[Path]:
    """The single-process test modules that parametrize over the available devices."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if "dist" in path.relative_to(REPO).parts:
            continue  # multi-rank tests stay on gloo
        if "tests.devices import" in path.read_text(encoding="utf-8"):
            found.append(path)
    return found


def missing_import(path: Path) -> str | None:
    """Why ``path`` does not import here (a third-party package absent or too old), or None.

    Example: ``"transformers"`` when it is not installed; ``"transformers: cannot import name
    'Qwen3Config' ..."`` when the installed version lacks a name.
    """
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    try:
        importlib.import_module(module)
    except ImportError as err:
        top = (err.name or "").split(".")[0]
        if top in ("", "rollfeed", "tests"):
            raise  # our own code does not import: a bug, not a missing dependency
        return top if isinstance(err, ModuleNotFoundError) else f"{top}: {err}"
    return None


def _benchmarks(absent: list[str]) -> list[list[str]]:
    """The benchmark command lines to run on CUDA, given the missing optional packages."""
    run = [sys.executable, "-m", "rollfeed.bench"]
    attention = [*run, "attention", "--device", "cuda"]
    if "transformers" in absent:
        print("not run: bench attention's hybrid stack (needs transformers)")
        attention += ["--parts", "attention"]
    return [[*run, "scoring", "--device", "cuda"], attention]


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # our lines before the children's output
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}): torch.cuda.is_available() is False. Run `make gpu-check` "
            "on a machine with a GPU and a CUDA build of torch; `make test` is the CPU suite.",
            file=sys.stderr,
        )
        return 2
    print(
        f"gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, Python {platform.python_version()}"
    )
    absent = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    for name in absent:
        print(f"missing here: {name} ({OPTIONAL[name]})")
    if importlib.util.find_spec("pytest") is None:
        print("gpu-check: pytest is not installed here, so no test can run", file=sys.stderr)
        return 1
    run, failed = [], False
    for path in device_test_files():
        need = missing_import(path)
        if need is None:
            run.append(str(path.relative_to(REPO)))
        else:
            print(f"not run: {path.relative_to(REPO)} (needs {need})")
    if not run:
        print("gpu-check: no device test module imports here; nothing ran", file=sys.stderr)
        return 1
    flags = ["-k", "cuda", "-p", "no:cacheprovider", "-q", "-ra"]
    tests = subprocess.run([sys.executable, "-m", "pytest", *run, *flags], cwd=REPO)
    failed |= tests.returncode != 0  # 5: no CUDA case collected, which is a failure here too
    if "pydantic" in absent or "numpy" in absent:
        print("not run: the benchmarks on cuda (rollfeed does not import here)")
        failed = True
    else:
        for bench in _benchmarks(absent):
            failed |= subprocess.run(bench, cwd=REPO).returncode != 0
    print(f"gpu-check: {'FAILED' if failed else 'passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
