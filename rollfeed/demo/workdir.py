"""The demo's work directory: a fresh one per run, or an explicit one held under a lock.

Two demos on one machine must never share a payload root, a step file or a writer name. Without
``--workdir`` every run gets a new directory ``<base>/run-<time>-<pid>-<random>`` (created with
``mkdir``, which fails rather than reuse one). With ``--workdir DIR`` the run takes an exclusive
``flock`` on ``DIR/.rollfeed-demo.lock`` for its whole life; a second run on the same ``DIR`` is
refused at once with :class:`DemoWorkdirInUseError`, naming the directory and the run holding it.
The kernel drops the lock when its holder exits, however it exits, so a killed run never leaves a
stale lock behind. Fresh runs hold the same lock on their own directory.

Fresh run directories accumulate (about 13 MB each: payload, step file, checkpoints, plot), so a
new fresh run deletes those beyond the newest :data:`KEEP_RUNS` (its own included), oldest first
by the start time in their names; a directory whose run still holds its lock is never deleted,
nor is anything under ``base`` that is not a ``run-<id>`` directory (a symlink included). An
explicit ``--workdir`` is never deleted.

Example::

    with claim_workdir(None, base=Path("~/.cache/rollfeed/demo").expanduser()) as run:
        run.workdir  # ~/.cache/rollfeed/demo/run-20250101-120000-4242-9f3a1c
        run.run_id   # 20250101-120000-4242-9f3a1c (also names the run's payload writer)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollfeed.errors import RollfeedError

LOCK_NAME = ".rollfeed-demo.lock"
KEEP_RUNS = 5  # fresh run directories kept under the base, the newest ones
_RUN_DIR = re.compile(r"run-\d{8}-\d{6}-\d+-[0-9a-f]+")
logger = logging.getLogger(__name__)


class DemoWorkdirInUseError(RollfeedError):
    """An explicit demo work directory is held by another demo run that is still running."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoRun:
    """The directory one demo run owns and the id that makes its names unique."""

    workdir: Path
    run_id: str
    fresh: bool  # True: created for this run; False: the caller's --workdir
    pruned: tuple[Path, ...] = ()  # earlier run directories this run deleted (prune_runs)


def new_run_id() -> str:
    """``<yyyymmdd-hhmmss>-<pid>-<6 hex>``: sortable by start time, unique across processes."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def _delete_if_idle(work: Path) -> bool:
    """Delete ``work`` unless a run holds its lock (held while deleting); True when deleted."""
    try:
        fd = os.open(work / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None  # a run killed before it took its lock
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(work)
    except BlockingIOError:
        logger.info("demo run directory %s is in use; kept", work)
        return False
    except OSError as err:
        logger.warning("could not delete the old demo run directory %s: %s", work, err)
        return False
    finally:
        if fd is not None:
            os.close(fd)
    return True


def prune_runs(base: Path, keep: int = KEEP_RUNS) -> list[Path]:
    """Delete the fresh run directories under ``base`` beyond the newest ``keep``, skipping any a
    running demo holds; returns the deleted ones, oldest first (see the module doc)."""
    runs = []
    for entry in os.scandir(base):
        if _RUN_DIR.fullmatch(entry.name) and stat.S_ISDIR(
            entry.stat(follow_symlinks=False).st_mode
        ):
            runs.append(Path(entry.path))
    runs.sort(key=lambda p: p.name.split("-")[1:3])  # yyyymmdd, hhmmss: the start time
    return [old for old in runs[: max(len(runs) - keep, 0)] if _delete_if_idle(old)]


@contextlib.contextmanager
def claim_workdir(workdir: str | os.PathLike[str] | None, *, base: Path) -> Iterator[DemoRun]:
    """Own a work directory for the duration of the ``with`` block.

    ``workdir=None``: a new directory under ``base``, whose run directories beyond the newest
    :data:`KEEP_RUNS` are then deleted (:func:`prune_runs`). Otherwise ``workdir`` (created if
    needed), locked; raises :class:`DemoWorkdirInUseError` when another run holds it.
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
        run = DemoRun(workdir=work, run_id=run_id, fresh=fresh)
        if fresh:
            run = dataclasses.replace(run, pruned=tuple(prune_runs(base)))
        yield run
    finally:
        os.close(fd)  # releases the lock
