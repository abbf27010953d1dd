"""A killed launcher takes its torchrun ranks with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from rollfeed.demo.process_tree import kill_tree

RANK = """
import os, sys, time
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(600)
"""


def _launch(tmp_path, name):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    pids = tmp_path / name
    pids.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, str(script), str(pids)], start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len([p for p in pids.iterdir() if p.read_text()]) < 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    return proc, [int(p.read_text()) for p in pids.iterdir()]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pids, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_kill_tree_ends_the_ranks_that_killing_the_launchers_group_leaves_behind(tmp_path):
    proc, ranks = _launch(tmp_path, "group")
    os.killpg(proc.pid, signal.SIGKILL)  # what a process group reaches
    proc.wait()
    try:
        assert all(_alive(p) for p in ranks), "torchrun's ranks no longer outlive its group"
    finally:
        for pid in ranks:
            kill_tree(pid)

    proc, ranks = _launch(tmp_path, "tree")
    kill_tree(proc.pid)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _gone(ranks)
    kill_tree(proc.pid)  # a process already gone: nothing to do
