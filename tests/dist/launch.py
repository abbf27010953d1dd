"""Launch a script under ``torchrun`` (gloo, loopback) and fail with every rank's output.

Usage from a test::

    out = torchrun("tests/dist/run_tp_scoring.py", nproc=2, args=["--out", str(tmp_path)])

The script runs as ``python -m torch.distributed.run --standalone --nproc_per_node=N script ...``.
A rank that raises makes torchrun exit non-zero; this helper then raises ``AssertionError`` with the
combined output, so the failing rank's traceback shows up in the pytest report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(
    script: str | Path, *, nproc: int, args: list[str] | None = None, timeout: float = 120
) -> str:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / script),
        *(args or []),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} (nproc={nproc}) exited {proc.returncode}:\n{output}"
        )
    return output


def exit_rank() -> None:
    """End a rank script whose checks have all passed, skipping interpreter teardown.

    Teardown after a backward that ran gloo collectives sometimes aborts the process
    ("terminate called without an active exception", about 1 run in 5 here), which would turn a
    passing rank into a failing one.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
