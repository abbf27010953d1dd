"""Ending a job the way a crash ends it: the process and every process it started.

``torchrun`` starts each rank in a session of its own (torch's elastic launcher asks for
``start_new_session``), so ``os.killpg`` on the launcher's group kills the launcher alone: its
ranks live on as orphans, holding their memory, and a rank paused or mid-step may still write
after its job was "killed". :func:`kill_tree` follows the parent links instead.

Example: a 2-rank launcher ``L`` with ranks ``R0``, ``R1`` (each its own session)::

    kill_tree(L.pid)   # L, R0 and R1 are stopped, then killed; none is left orphaned
"""

from __future__ import annotations

import contextlib

import psutil


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid`` and all its descendants; nothing when ``pid`` is gone.

    Each process is stopped (SIGSTOP) before its children are listed, so none of them can start
    another one unseen in between; the caller still reaps ``pid`` if it is its child."""
    try:
        todo = [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    stopped = []
    while todo:
        proc = todo.pop()
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.suspend()
            stopped.append(proc)
            todo.extend(proc.children())
    for proc in stopped:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
