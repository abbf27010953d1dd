"""The demo's work directory: a fresh one per run, or an explicit one held under a lock.

Two demos on one machine must never share a payload root, a step file or a writer name. Without
``--workdir`` every run gets a new directory ``<base>/run-<time>-<pid>-<random>`` (created with
``mkdir``, which fails rather than reuse one). With ``--workdir DIR`` the run takes an exclusive
``flock`` on ``DIR/.rollfeed-demo.lock`` for its whole life; a second run on the same ``DIR`` is
refused at once with :class:`DemoWorkdirInUseError`, naming the directory and the run holding it.
The kernel drops the lock when its holder exits, however it exits, so a killed run never leaves a
stale lock behind.

Example::

    with claim_workdir(None, base=Path("~/.cache/rollfeed/demo").expanduser()) as run:
        run.workdir  # ~/.cache/rollfeed/demo/run-20250101-120000-4242-9f3a1c
        run.run_id   # 20250101-120000-4242-9f3a1c (also names the run's payload writer)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollfeed.errors import RollfeedError

LOCK_NAME = ".rollfeed-demo.lock"


class DemoWorkdirInUseError(RollfeedError):
    """An explicit demo work directory is held by another demo run that is still running."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoRun:
    """The directory one demo run owns and the id that makes its names unique."""

    workdir: Path
    run_id: str
    fresh: bool  # True: created for this run; False: the caller's --workdir


def new_run_id() -> str:
    """``<yyyymmdd-hhmmss>-<pid>-<6 hex>``: sortable by start time, unique across processes."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


@contextlib.contextmanager
def claim_workdir(workdir: str | os.PathLike[str] | None, *, base: Path) -> Iterator[DemoRun]:
    """Own a work directory for the duration of the ``with`` block.

    ``workdir=None``: a new directory under ``base``. Otherwise ``workdir`` (created if needed),
    locked; raises :class:`DemoWorkdirInUseError` when another run holds it.
    """
    run_id = new_run_id()
    if workdir is None:
        base.mkdir(parents=True, exist_ok=True)
        work, fresh = base / f"run-{run_id}", True
        work.mkdir()  # never exist_ok: a directory that exists belongs to someone else
    else:
        work, fresh = Path(workdir), False
        work.mkdir(parents=True, exist_ok=True)
    fd = os.open(work / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown run"
            raise DemoWorkdirInUseError(
                f"demo work directory {work} is in use by another demo run ({holder}); "
                "wait for that run to finish, pass another --workdir, or leave --workdir out "
                "to get a fresh directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"run {run_id}, pid {os.getpid()}\n".encode(), 0)
        yield DemoRun(workdir=work, run_id=run_id, fresh=fresh)
    finally:
        os.close(fd)  # releases the lock
