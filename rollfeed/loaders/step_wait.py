"""A step directory as a listing: the steps it holds, bounded, logged waits for the next, and what
it holds when none comes.

:class:`StepDirectory` lists a directory or prefix through its root's store (one folder deep,
:meth:`~rollfeed.payload.stores.store.Store.names`): the step files present, and a JSON-lines
step file without its step record file refused naming the command that converts it.

A pass waits for its step file (stream mode: exactly step ``s``; otherwise step ``s`` or a later
one) by polling that listing (no inotify: it does not see writes made on other hosts of a shared
filesystem). The wait is never silent: it logs at INFO once as it starts and then every
:data:`LOG_EVERY_S` what it waits for and where, and after ``step_timeout_s`` it raises
:class:`StepTimeoutError` naming the directory, what it found there and the producer's last step
seen (the newest step file there). :func:`describe` finds the mistake a new user makes most, a
run folder given for its ``steps/`` subfolder, which ``from_step_dir`` refuses at build time
(:meth:`StepDirectory.check`) and a wait as it starts (an object-store prefix, which is not asked
before the first pass; or a local folder whose subfolder got its step files since):
:class:`LoaderConfigError`, not a wait of ``step_timeout_s``.

Example (``/run/steps`` holds steps 0..5, the pass wants 6, ``step_timeout_s=600``)::

    INFO rollfeed.loaders.step_wait: waiting for step 6 (step_000006.rfs) in /run/steps, for
    at most step_timeout_s=600 (0 s so far); found there: step files up to step 5 (6 files, from
    step 0; the newest written 2 s ago)
    StepTimeoutError: step 6 (step_000006.rfs) did not appear in /run/steps within
    step_timeout_s=600; found there: step files up to step 5 (...); the producer's last step
    seen: 5. The producer may have stopped or be behind: raise step_timeout_s, or stop after the
    last step [file=/run/steps/step_000006.rfs]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rollfeed.loaders.errors import LoaderConfigError, StepFileError, StepTimeoutError
from rollfeed.loaders.step_files import (
    listing_start,
    parse_json_step_name,
    parse_step_name,
    step_file_name,
)
from rollfeed.payload import PayloadMissingFileError, PayloadPathError, PayloadRoot

logger = logging.getLogger(__name__)
LOG_EVERY_S = 30.0  # how often a wait logs again
SUBFOLDERS = 64  # subfolders of a directory without step files looked into for some
_EXAMPLES = 3  # names of other entries a description shows


class Entry(Protocol):
    """One entry of a listing: its name (``rel``), modification time and kind."""

    rel: str
    mtime: float
    folder: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """What a step directory holds, in words, its newest step (``None``: no step file) and its
    subfolders that hold step files (``(name, description)``), when it holds none itself."""

    text: str
    last: int | None
    misplaced: tuple[tuple[str, str], ...] = ()


def describe_steps(steps: list[int], *, newest_age_s: float | None = None) -> Found:
    """The words for a directory (or prefix) holding the step files ``steps`` (sorted)."""
    if not steps:
        return Found(text="no step file named step_NNNNNN.rfs", last=None)
    age = "" if newest_age_s is None else f"; the newest written {newest_age_s:.0f} s ago"
    files = f"{len(steps)} file{'s' if len(steps) > 1 else ''}"
    text = f"step files up to step {steps[-1]} ({files}, from step {steps[0]}{age})"
    return Found(text=text, last=steps[-1])


def describe(entries: Sequence[Entry] | None, look: Callable[[str], Sequence[Entry]]) -> Found:
    """What a directory of ``entries`` holds (``None``: it does not exist); ``look(folder)``
    lists a subfolder, looked into (the first :data:`SUBFOLDERS`) when it holds no step file."""
    if entries is None:
        return Found(text="nothing: the directory does not exist", last=None)
    steps = {s: e for e in entries if (s := parse_step_name(e.rel)) is not None}
    if steps:
        newest = steps[max(steps)]
        age = time.time() - newest.mtime if newest.mtime else None
        return describe_steps(sorted(steps), newest_age_s=age)
    if not entries:
        return Found(text="nothing: the directory is empty", last=None)
    misplaced = []
    for folder in [e.rel for e in entries if e.folder][:SUBFOLDERS]:
        try:
            inside = sorted(
                s for e in look(folder) if (s := parse_step_name(_base(e.rel))) is not None
            )
        except ValueError:  # a typed error of the store: that folder cannot be listed
            continue
        if inside:
            misplaced.append((folder, f"step files (steps {inside[0]}..{inside[-1]})"))
    if misplaced:
        where = "; ".join(f"a {name}/ subfolder holding {what}" for name, what in misplaced)
        return Found(text=f"no step file, but {where}", last=None, misplaced=tuple(misplaced))
    names = ", ".join(sorted(e.rel for e in entries)[:_EXAMPLES])
    return Found(
        text=f"{len(entries)} entries, none named step_NNNNNN.rfs (e.g. {names})", last=None
    )


def _base(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


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


class StepDirectory:
    """The step files of ``directory`` (as given), listed through ``root``'s store; picklable.

    A step the last listing found is not waited for with another: a step file, once there, stays
    (a rewrite replaces it whole, which reading it checks; a step that was removed is missing
    when read, and the listing that error makes forgets it), so a pass whose step the pass before
    found (it plans the next step ahead, :mod:`~rollfeed.loaders.next_step`) starts without a
    listing, a request over an object store."""

    def __init__(self, root: PayloadRoot, directory: str) -> None:
        self.root, self.directory = root, directory
        self._seen: set[int] = set()  # steps a listing found

    def entries(self, after: str = "") -> list | None:
        """The directory's entries (those whose names sort after ``after``; ``None`` when it
        does not exist); a JSON-lines step file without its step record file is a
        :class:`StepFileError` naming it and the command that converts the directory."""
        try:
            entries = self.root.store.names("", after=after)
        except PayloadMissingFileError:
            return None
        names = {e.rel for e in entries}
        for e in entries:
            old = parse_json_step_name(e.rel)
            if old is not None and step_file_name(old) not in names:
                raise StepFileError(
                    f"step {old} is a step file of the JSON-lines format, which this loader no "
                    "longer reads; convert the directory once: python -m rollfeed steps convert "
                    f"{self.directory}",
                    file=self.root.store.where(e.rel),
                    step=old,
                )
        return entries

    def describe(self, entries: list | None = None) -> Found:
        return describe(self.entries() if entries is None else entries, look=self.root.store.names)

    def steps_from(self, step: int) -> list[int]:
        """The steps present from ``step`` on, sorted (listed from there: a long run's earlier
        steps are not listed again)."""
        names = (parse_step_name(e.rel) for e in self.entries(listing_start(step)) or [])
        found = sorted(n for n in names if n is not None and n >= step)
        self._seen = {n for n in self._seen if n < step} | set(found)  # a step pruned: forgotten
        return found

    def wait_for_step(self, step: int, *, timeout_s: float, exact: bool) -> int:
        """:func:`wait_for_step` over this directory's listing (none for a step found before:
        the first step from ``step`` on is ``step`` itself)."""
        if step in self._seen:
            return step

        def find() -> int | None:
            present = self.steps_from(step)
            if exact:
                return step if present[:1] == [step] else None
            return present[0] if present else None

        return wait_for_step(
            find,
            step,
            exact=exact,
            where=self.directory,
            file=self.root.store.where(step_file_name(step)),
            describe=self._described,
            timeout_s=timeout_s,
        )

    def _described(self) -> Found:
        """:meth:`describe`, refusing at once a directory whose step files are in a subfolder
        (an object-store prefix is not checked at build time: its first wait does it)."""
        found = self.describe()
        if found.misplaced:
            raise self._misplaced(found)
        return found

    def check(self) -> None:
        """Refuse at once a local directory that cannot be a step directory: a missing path or
        a file, or a directory without step files whose subfolder has some (a run folder given
        for its ``steps/``); :class:`LoaderConfigError` naming it (and that subfolder)."""
        what = None
        try:
            entries = self.root.store.names("")
        except PayloadMissingFileError:
            what = "does not exist"
        except PayloadPathError:
            what = "is not a directory"
        if what is not None:
            raise LoaderConfigError(
                f"step directory {self.directory!r} {what}; pass the directory that holds (or "
                "will hold) the step_NNNNNN.rfs files (a producer's StepWriter makes it with its "
                "first step: create it first to start a trainer before its producer)"
            )
        found = self.describe(entries)
        if found.misplaced:
            raise self._misplaced(found)

    def _misplaced(self, found: Found) -> LoaderConfigError:
        paths = [self.root.store.where(name) for name, _ in found.misplaced]
        held = "; ".join(f"{p} holds {w}" for p, (_, w) in zip(paths, found.misplaced, strict=True))
        return LoaderConfigError(
            f"step directory {self.directory!r} holds no step file, but {held}: pass that "
            f"directory, RolloutDataset.from_step_dir({paths[0]!r})"
        )
