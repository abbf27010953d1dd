"""StepVersion: which version of a step file a plan was made from, so a worker reads that one.

A step file can be replaced under its name (a producer that writes a step again, a copy tool).
The sampler plans a step from its index in the trainer's process; a worker reads its samples'
records later, in another process, perhaps after the replacement, with an index of its own. So the
plan carries the version it was made from (and each planned sample's length,
:class:`~rollfeed.loaders.plan.Planned`), a worker reads only through a handle on that version,
and any other is refused with :class:`~rollfeed.loaders.errors.StepReplacedError` naming the file
and the step:

- a local step file: its size, inode and modification time (ns), from ``fstat`` of the descriptor
  the reads go through (a file moved into place is another inode; a rewrite in place moves the
  modification time);
- an object in a store: its size and ETag; every record's ranged GET carries ``If-Match`` on it.

Both are the ``size`` and ``stamp`` of the file as the store opened it
(:class:`~rollfeed.payload.StepRecordFile`)::

    StepVersion(size=97, stamp="inode 1234, mtime_ns 17...")   # a local file
    StepVersion(size=97, stamp='ETag "9b2c"')                  # an object
"""

from __future__ import annotations

from dataclasses import dataclass

from rollfeed.loaders.errors import StepReplacedError


@dataclass(frozen=True, kw_only=True, slots=True)
class StepVersion:
    """One version of a step file: ``size`` in bytes and a ``stamp`` that changes when the file
    is replaced (see the module doc)."""

    size: int
    stamp: str

    def __str__(self) -> str:
        return f"{self.size} bytes, {self.stamp}"


def replaced_error(
    step: int, file: str, planned: StepVersion, found: StepVersion | str
) -> StepReplacedError:
    """The error for a step file that is not the planned version (``found``: what is there)."""
    return StepReplacedError(
        f"step {step} was planned from its step file at ({planned}), but the file read now is "
        f"({found}): it was replaced after planning, so its samples may differ from the plan; "
        "a written step file must not be replaced (write the step under a new step number)",
        file=file,
        step=step,
    )
