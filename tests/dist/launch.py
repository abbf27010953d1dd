"""Launch a script under ``torchrun`` (gloo, loopback) and end its ranks cleanly.

Usage from a test::

    out = torchrun("tests/dist/run_tp_scoring.py", nproc=2, args=["--out", str(tmp_path)])

and in the rank script::

    if __name__ == "__main__":
        run_rank(main)

The script runs as ``python -m torch.distributed.run --standalone --nproc_per_node=N script ...``.
A rank that raises makes torchrun exit non-zero; :func:`torchrun` then raises ``AssertionError``
with the combined output, so the failing rank's traceback shows up in the pytest report.

Why :func:`run_rank` frees every process group before the interpreter ends: a gloo group owns
worker threads, and a worker may still hold the last reference to a finished collective (a barrier
keeps references to the collectives queued before it), whose tensors belong to Python objects. If
the group is still alive when the interpreter finalizes, the worker releases those tensors then,
needs the GIL, and Python ends the thread with ``pthread_exit``; unwinding through a C++
destructor aborts the process ("terminate called without an active exception"), after every check
has passed. Freeing the group while the interpreter is alive joins its workers first. So the rank:
destroys every group (``dist.destroy_process_group()``: the default group and every subgroup),
drops what holds one (``main``'s locals: groups, cp groups, scorers, loaders, whose threads are
joined on close), collects cycles, and asserts no gloo thread is left. One trap: a module imported
*after* ``init_process_group`` that takes ``group.WORLD`` as a default argument value
(``torch.distributed.nn.functional``, imported with transformers' model classes) holds the default
group for good; rank scripts import such modules (the tiny models) before :func:`run_rank` starts
the process group.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from rollfeed.demo.process_tree import kill_tree

REPO = Path(__file__).resolve().parents[2]
# Threads a live gloo process group owns (its workers and its transport's event loop).
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


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
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the ranks too: killing torchrun alone would leave them running
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"torchrun {script} (nproc={nproc}) ran past {timeout} s:\n{stdout}{stderr}"
        ) from None
    output = stdout + stderr
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} (nproc={nproc}) exited {proc.returncode}:\n{output}"
        )
    return output


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to a live gloo process group (Linux)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if n in GLOO_THREADS)


def run_rank(main: Callable[..., None], *args: object) -> None:
    """Run ``main(*args)`` between ``init_process_group("gloo")`` and a teardown that frees every
    process group (see the module doc), then return so the interpreter exits normally."""
    dist.init_process_group("gloo")
    try:
        main(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    gc.collect()
    left = gloo_threads()
    assert not left, (
        f"gloo threads {left} outlive destroy_process_group(): something still holds a process "
        "group (an object of the script, or a module imported after init_process_group that took "
        "group.WORLD as a default argument); they would abort interpreter teardown"
    )
