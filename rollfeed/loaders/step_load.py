"""Loading one step of a step directory or store: its version, and its index or parsed samples.

A local step file is opened first, by the payload's open rule (:mod:`rollfeed.loaders.step_open`:
a symlink, FIFO or directory is a :class:`StepFileError`), and its version taken from that
descriptor (:mod:`rollfeed.loaders.step_version`); the index is checked against that version's
size and bytes, and the descriptor is what the step's lines are read through later, so a step file
replaced after loading is never read through this index. A store's step is pinned by its ETag.
Without an index, or with one of an older format version (which holds no content hash per
line), the step is parsed whole (``missing_index="parse"``, with a warning) or refused
(``"error"``); a step without a file raises :class:`StepMissingError` naming the step and the
directory.

Example::

    loaded, f = load_local("/steps/step_000003.jsonl", 3, "/steps", missing_index="parse")
    loaded.version, len(loaded.entry)    -> StepVersion(...), 3 samples; f: the open step file
    loaded.identity                      -> StepIdentity(samples=3, tokens=..., digest=...)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, Literal, TypeVar

from rollfeed.collate import Sample
from rollfeed.loaders.errors import StepFileError, StepIndexVersionError, StepMissingError
from rollfeed.loaders.step_files import list_steps, step_file_name
from rollfeed.loaders.step_identity import StepIdentity
from rollfeed.loaders.step_index import StepIndex, index_path, read_step_index
from rollfeed.loaders.step_lines import ParsedStep, parse_step
from rollfeed.loaders.step_open import fd_pread, open_step
from rollfeed.loaders.step_store import StepStore
from rollfeed.loaders.step_version import StepVersion

logger = logging.getLogger(__name__)
MissingIndex = Literal["parse", "error"]
MISSING_INDEX: tuple[MissingIndex, ...] = ("parse", "error")
_NO_INDEX = "has no index"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LoadedStep:
    """One step as a process holds it: the version of its file, its index (or, without one, its
    parsed samples) and the identity of its samples (:mod:`~rollfeed.loaders.step_identity`)."""

    version: StepVersion
    entry: StepIndex | list[Sample]
    identity: StepIdentity

    @property
    def indexed(self) -> bool:
        return isinstance(self.entry, StepIndex)

    @classmethod
    def of_index(cls, version: StepVersion, index: StepIndex) -> LoadedStep:
        identity = StepIdentity.of(index.lengths, index.crc32c)
        return cls(version=version, entry=index, identity=identity)

    @classmethod
    def of_parsed(cls, version: StepVersion, parsed: ParsedStep) -> LoadedStep:
        identity = StepIdentity.of(parsed.lengths, parsed.crcs)
        return cls(version=version, entry=parsed.samples, identity=identity)


def load_local(
    path: str, step: int, directory: str, *, missing_index: MissingIndex
) -> tuple[LoadedStep, BinaryIO | None]:
    """Step ``step`` from ``path``, and the open step file its lines are read through (``None``
    when it was parsed whole)."""
    fd = open_step(path, what="step file")
    if fd is None:
        raise missing_step(step, directory, path)
    f = os.fdopen(fd, "rb", buffering=0)
    try:
        version = StepVersion.of_stat(os.fstat(fd))
        pread = fd_pread(fd)
        index, why = _index(lambda: read_step_index(path, size=version.size, pread=pread))
        if index is None:
            _without_index(path, missing_index, why)
            parsed = parse_step(pread, version.size, file=path)
    except BaseException:
        f.close()
        raise
    if index is None:
        f.close()
        return LoadedStep.of_parsed(version, parsed), None
    return LoadedStep.of_index(version, index), f


def load_stored(store: StepStore, step: int, *, missing_index: MissingIndex) -> LoadedStep:
    """Step ``step`` from an object store (see :mod:`rollfeed.loaders.step_store`)."""
    got, why = _index(lambda: store.read_versioned_index(step))
    if got is not None:
        return LoadedStep.of_index(got[1], got[0])
    store.step_version(step)  # a missing step is named as such
    _without_index(store.where(step_file_name(step)), missing_index, why)
    parsed, version = store.read_step_file(step)
    return LoadedStep.of_parsed(version, parsed)


def _index(read: Callable[[], T | None]) -> tuple[T | None, str | StepIndexVersionError]:
    """``(read(), why)``: the reader's answer, or ``(None, why)`` for an index of an older
    version, which is not used (its error, raised as is under ``missing_index="error"``)."""
    try:
        return read(), _NO_INDEX
    except StepIndexVersionError as err:
        return None, err


def _without_index(
    path: str, missing_index: MissingIndex, why: str | StepIndexVersionError
) -> None:
    """The ``missing_index`` policy for a step file without a usable index (``why``: none, or
    the error of an index of an older version): refuse, or warn (and the caller parses it
    whole)."""
    if missing_index == "error":
        if isinstance(why, StepIndexVersionError):
            raise why
        raise StepFileError(
            f"step file has no index {index_path(path).name} and missing_index='error'; "
            "write it with build_step_index, or pass missing_index='parse'",
            file=path,
        )
    if isinstance(why, StepIndexVersionError):
        why = f"has an index it does not use ({why.message})"
    logger.warning(
        "step file %s %s; parsing it whole (missing_index='parse'); build_step_index writes one",
        path,
        why,
    )


def missing_step(step: int, directory: str, path: str) -> StepMissingError:
    present = list_steps(directory)
    have = f"steps {present[0]}..{present[-1]} ({len(present)} files)" if present else "none"
    return StepMissingError(
        f"step {step} has no step file {step_file_name(step)} in {directory} (present: "
        f"{have}); ask for a step that is there, or wait for it (stream=True)",
        file=path,
        step=step,
    )
