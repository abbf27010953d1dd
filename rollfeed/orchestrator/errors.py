"""Typed errors of the orchestrator's durable side: its cursor, trainer progress, producer.

Each is a :class:`~rollfeed.errors.RollfeedError` (a ``ValueError``: bad data on disk or inputs
that contradict it, never an internal bug) naming what it knows of the place:

- ``file``: the cursor log, a record object or the progress file; ``offset``: a byte offset in it;
- ``record``: a cursor record's sequence number;
- ``step``, ``prompt``, ``sample``: the training step, the prompt id and the sample index.

Example: ``CursorCorruptError("...", file="steps/cursor/log.rfc", offset=4096, record=17)`` reads
``"... [file=steps/cursor/log.rfc, offset=4096, record=17]"``.
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class OrchestratorError(RollfeedError):
    """Base class: the orchestrator's durable state or its inputs."""

    PLACE = ("file", "offset", "record", "step", "prompt", "sample")


class CursorCorruptError(OrchestratorError):
    """A cursor record that is not the torn tail of an interrupted append does not check out
    (its checksum, its sequence number, its JSON): the log was damaged, not cut short."""


class CursorInUseError(OrchestratorError):
    """Another producer holds the cursor (a local log's lock, or an object store's record of the
    same number written by someone else): one cursor has one writer."""


class CursorMismatchError(OrchestratorError):
    """What the cursor recorded contradicts the producer's inputs or the step directory (other
    prompts for a step, a step file holding other samples than its recorded rollouts)."""


class CursorWriteError(OrchestratorError):
    """An append that could not be made durable (disk full, an I/O error, a store that refused);
    nothing of it is left in the log."""


class ProgressFileError(OrchestratorError):
    """The trainer's progress file is not a progress record."""
