"""Measuring one benchmark variant in its own process, so no variant's allocations hide in
another's peak.

``run_variant("rollfeed.bench.scoring", ["--child", "fused", ...])`` runs the module in a fresh
interpreter and returns the JSON object its child mode prints last. Inside the child,
:func:`resident_bytes` is the current resident set (taken after the inputs exist, so their
transients are not credited to the variant) and :func:`peak_bytes` the high-water mark so far;
PyTorch's CPU allocator does not cache, so the difference is what the variant held at once.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def run_variant(
    module: str, argv: list[str], env: dict[str, str] | None = None
) -> dict[str, float]:
    """``env``: variables added to this process's environment for the child."""
    out = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        check=True,
        env=None if env is None else {**os.environ, **env},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def resident_bytes() -> int:
    """Current resident set (``/proc/self/statm``), not the high-water mark."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_bytes() -> int:
    """The process's resident-set high-water mark (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
