"""Loading one step of a step directory or store: its version, and its index or parsed samples.

A local step file is opened first and its version taken from that descriptor
(:mod:`rollfeed.loaders.step_version`); the index is checked against that version's size and
bytes, and the descriptor is what the step's lines are read through later, so a step file
replaced after loading is never read through this index. A store's step is pinned by its ETag.
Without an index the step is parsed whole (``missing_index="parse"``, with a warning) or refused
(``"error"``); a step without a file raises :class:`StepMissingError` naming the step and the
directory.

Example::

    loaded, f = load_local("/steps/step_000003.jsonl", 3, "/steps", missing_index="parse")
    loaded.version, len(loaded.entry)    -> StepVersion(...), 3 samples; f: the open step file
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import BinaryIO, Literal

from rollfeed.collate import Sample
from rollfeed.loaders.errors import StepFileError, StepMissingError
from rollfeed.loaders.step_files import list_steps, parse_step_lines, step_file_name
from rollfeed.loaders.step_index import StepIndex, index_path, read_step_index
from rollfeed.loaders.step_store import StepStore
from rollfeed.loaders.step_version import StepVersion

logger = logging.getLogger(__name__)
MissingIndex = Literal["parse", "error"]
MISSING_INDEX: tuple[MissingIndex, ...] = ("parse", "error")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LoadedStep:
    """One step as a process holds it: the version of its file, and its index (or, without
    one, its parsed samples)."""

    version: StepVersion
    entry: StepIndex | list[Sample]

    @property
    def indexed(self) -> bool:
        return isinstance(self.entry, StepIndex)


def load_local(
    path: str, step: int, directory: str, *, missing_index: MissingIndex
) -> tuple[LoadedStep, BinaryIO | None]:
    """Step ``step`` from ``path``, and the open step file its lines are read through (``None``
    when it was parsed whole)."""
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115
    except FileNotFoundError:
        raise missing_step(step, directory, path) from None
    try:
        version = StepVersion.of_stat(os.fstat(f.fileno()))
        pread = lambda n, at: os.pread(f.fileno(), n, at)  # noqa: E731
        index = read_step_index(path, size=version.size, pread=pread)
        if index is None:
            _without_index(path, missing_index)
            samples = parse_step_lines(f.readall().splitlines(keepends=True), file=path)
    except BaseException:
        f.close()
        raise
    if index is None:
        f.close()
        return LoadedStep(version=version, entry=samples), None
    return LoadedStep(version=version, entry=index), f


def load_stored(store: StepStore, step: int, *, missing_index: MissingIndex) -> LoadedStep:
    """Step ``step`` from an object store (see :mod:`rollfeed.loaders.step_store`)."""
    got = store.read_versioned_index(step)
    if got is not None:
        return LoadedStep(version=got[1], entry=got[0])
    store.step_version(step)  # a missing step is named as such
    _without_index(store.where(step_file_name(step)), missing_index)
    samples, version = store.read_step_file(step)
    return LoadedStep(version=version, entry=samples)


def _without_index(path: str, missing_index: MissingIndex) -> None:
    """The ``missing_index`` policy for a step file without an index: refuse, or warn (and the
    caller parses it whole)."""
    if missing_index == "error":
        raise StepFileError(
            f"step file has no index {index_path(path).name} and missing_index='error'; "
            "write it with build_step_index, or pass missing_index='parse'",
            file=path,
        )
    logger.warning(
        "step file %s has no index; parsing it whole (missing_index='parse'); "
        "build_step_index writes one",
        path,
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
