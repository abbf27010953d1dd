"""Bounded, logged waits for a step file, and what a step directory holds when none comes.

A pass waits for its step file (stream mode: exactly step ``s``; otherwise step ``s`` or a later
one) by polling the directory or the store (no inotify: it does not see writes made on other hosts
of a shared filesystem). The wait is never silent: it logs at INFO once as it starts and then
every :data:`LOG_EVERY_S` what it waits for and where, and after ``step_timeout_s`` it raises
:class:`StepTimeoutError` naming the directory, what it found there and the producer's last step
seen (the newest step file there). :func:`misplaced_steps` finds the mistake a new user makes most,
a run folder given for its ``steps/`` subfolder, which ``from_step_dir`` refuses at build time.

Example (``/run/steps`` holds steps 0..5, the pass wants 6, ``step_timeout_s=600``)::

    INFO rollfeed.loaders.step_wait: waiting for step 6 (step_000006.jsonl) in /run/steps, for
    at most step_timeout_s=600 (0 s so far); found there: step files up to step 5 (6 files, from
    step 0; the newest written 2 s ago)
    StepTimeoutError: step 6 (step_000006.jsonl) did not appear in /run/steps within
    step_timeout_s=600; found there: step files up to step 5 (...); the producer's last step
    seen: 5. The producer may have stopped or be behind: raise step_timeout_s, or stop after the
    last step [file=/run/steps/step_000006.jsonl]
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollfeed.loaders.errors import LoaderConfigError, StepTimeoutError
from rollfeed.loaders.step_files import list_steps, parse_step_name, step_file_name

logger = logging.getLogger(__name__)
LOG_EVERY_S = 30.0  # how often a wait logs again
_SUBFOLDERS = 64  # subfolders of a directory without step files looked into for some
_EXAMPLES = 3  # names of other entries a description shows


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """What a step directory holds, in words, and its newest step (``None``: no step file)."""

    text: str
    last: int | None


def describe_steps(steps: list[int], *, newest_age_s: float | None = None) -> Found:
    """The words for a directory (or prefix) holding the step files ``steps`` (sorted)."""
    if not steps:
        return Found(text="no step file named step_NNNNNN.jsonl", last=None)
    age = "" if newest_age_s is None else f"; the newest written {newest_age_s:.0f} s ago"
    files = f"{len(steps)} file{'s' if len(steps) > 1 else ''}"
    text = f"step files up to step {steps[-1]} ({files}, from step {steps[0]}{age})"
    return Found(text=text, last=steps[-1])


def describe_directory(directory: str) -> Found:
    """What the local ``directory`` holds (see the module doc's example)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return Found(text="nothing: the directory does not exist", last=None)
    except OSError as err:
        return Found(text=f"nothing readable ({err.strerror})", last=None)
    steps = sorted(s for e in entries if (s := parse_step_name(e.name)) is not None)
    if steps:
        try:
            newest = os.path.join(directory, step_file_name(steps[-1]))
            age = time.time() - os.lstat(newest).st_mtime
        except OSError:
            age = None
        return describe_steps(steps, newest_age_s=age)
    if not entries:
        return Found(text="nothing: the directory is empty", last=None)
    misplaced = misplaced_steps(directory, entries)
    if misplaced:
        where = "; ".join(f"a {name}/ subfolder holding {what}" for name, what in misplaced)
        return Found(text=f"no step file, but {where}", last=None)
    names = ", ".join(sorted(e.name for e in entries)[:_EXAMPLES])
    return Found(
        text=f"{len(entries)} entries, none named step_NNNNNN.jsonl (e.g. {names})", last=None
    )


def misplaced_steps(directory: str, entries: list[os.DirEntry] | None = None) -> list[tuple]:
    """``(name, description)`` of the subfolders of ``directory`` holding step files (the first
    :data:`_SUBFOLDERS` looked into), when ``directory`` itself holds none."""
    if entries is None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return []
    if any(parse_step_name(e.name) is not None for e in entries):
        return []
    found = []
    folders = [e for e in entries if e.is_dir(follow_symlinks=False)]
    for entry in sorted(folders, key=lambda e: e.name)[:_SUBFOLDERS]:
        try:
            names = os.listdir(entry.path)
        except OSError:
            continue
        steps = sorted(s for n in names if (s := parse_step_name(n)) is not None)
        if steps:
            found.append((entry.name, f"step files (steps {steps[0]}..{steps[-1]})"))
    return found


def wait_for_step(
    find: Callable[[], int | None],
    step: int,
    *,
    exact: bool,
    where: str,
    file: str,
    describe: Callable[[], Found],
    timeout_s: float,
    poll_s: float = 0.05,
) -> int:
    """The step ``find()`` gives once it gives one (a step file present: ``step``, or with
    ``exact=False`` a later one); logs while it waits and raises :class:`StepTimeoutError` after
    ``timeout_s`` (see the module doc). ``where``: the directory or prefix; ``file``: the path
    of step ``step``'s file there."""
    found = find()
    if found is not None:
        return found
    began = time.monotonic()
    deadline, logged = began + timeout_s, None
    wanted = step_file_name(step) + ("" if exact else " or a later step file")
    while True:
        now = time.monotonic()
        if logged is None or now - logged >= LOG_EVERY_S:
            logged = now
            logger.info(
                "waiting for step %d (%s) in %s, for at most step_timeout_s=%s (%.0f s so far); "
                "found there: %s",
                step,
                wanted,
                where,
                timeout_s,
                now - began,
                describe().text,
            )
        if now >= deadline:
            there = describe()
            last = "none" if there.last is None else str(there.last)
            raise StepTimeoutError(
                f"step {step} ({wanted}) did not appear in {where} within step_timeout_s="
                f"{timeout_s}; found there: {there.text}; the producer's last step seen: {last}. "
                "The producer may have stopped or be behind: raise step_timeout_s, or stop after "
                "the last step",
                file=file,
                step=step,
            )
        time.sleep(min(poll_s, max(deadline - now, 0.0)))
        found = find()
        if found is not None:
            waited = time.monotonic() - began
            logger.info("step %d present in %s after %.1f s", found, where, waited)
            return found


def wait_in_directory(directory: str, step: int, *, exact: bool, timeout_s: float) -> int:
    """:func:`wait_for_step` over a local step directory."""
    path = os.path.join(directory, step_file_name(step))

    def find() -> int | None:
        if exact:  # lexists: a dangling symlink is found, and refused as the step is read
            return step if os.path.lexists(path) else None
        return next((s for s in list_steps(directory) if s >= step), None)

    return wait_for_step(
        find,
        step,
        exact=exact,
        where=directory,
        file=path,
        describe=lambda: describe_directory(directory),
        timeout_s=timeout_s,
    )


def check_step_dir(directory: str) -> None:
    """Refuse at once a local step directory that cannot be one (``from_step_dir``): a missing
    path or a file, or a directory without step files whose subfolder has some."""
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.lexists(directory) else "does not exist"
        raise LoaderConfigError(
            f"step directory {directory!r} {what}; pass the directory that holds (or will hold) "
            "the step_NNNNNN.jsonl files (a producer's write_step_file makes it with its first "
            "step: create it first to start a trainer before its producer)"
        )
    misplaced = misplaced_steps(directory)
    if misplaced:
        paths = [os.path.join(directory, name) for name, _ in misplaced]
        held = "; ".join(f"{p} holds {what}" for p, (_, what) in zip(paths, misplaced, strict=True))
        raise LoaderConfigError(
            f"step directory {directory!r} holds no step file, but {held}: pass that directory, "
            f"RolloutDataset.from_step_dir({paths[0]!r})"
        )
