"""Every sample of a step directory, read as the loader reads it, a finding per unreadable one.

Through the loaders' own step source (:class:`~rollfeed.loaders.step_source.StoredSteps`), so the
commands follow the step format as it changes: a step file is opened by the payload's open rule
(no symlink followed, no FIFO waited on), its index read and checked against the opened file, and
then each sample read through the index (its record's bytes, CRC-32C, token count and loss runs
checked, as a DataLoader worker reads it). A step whose file or index the loader refuses is a
finding of the step; a sample the loader refuses is a finding of that sample.

Example (``steps/step_000003.rfs`` of two samples, the second's record rewritten)::

    for step, got in walk_steps("steps", [3], progress):
        (StepFile(step=3, name="step_000003.rfs", samples=2, problem=None), None)
        (..., StepSample(sample=0, value=Sample(...)))
        (..., StepSample(sample=1, error=StepFileError("record 1's bytes have CRC-32C ...")))
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollfeed.cli.errors import UsageError
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import shown
from rollfeed.cli.root_scan import check_directory
from rollfeed.collate import Sample
from rollfeed.errors import RollfeedError
from rollfeed.loaders.errors import StepFileError
from rollfeed.loaders.step_files import step_file_name
from rollfeed.loaders.step_source import StoredSteps
from rollfeed.payload import PayloadError


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """Sample ``sample`` (0-based, in file order) of a step file: its ``value``, or the
    ``error`` that reading it raised."""

    sample: int
    value: Sample | None = None
    error: RollfeedError | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFile:
    """One step file: its step number and name, its samples (per its index; 0 when it cannot be
    read) and the ``problem`` of the step as a whole (the loader refuses its file or index)."""

    step: int
    name: str
    samples: int
    problem: RollfeedError | None


def step_numbers(directory: str) -> list[int]:
    """The steps present in ``directory``; :class:`UsageError` when it is not a directory, holds
    no step file, or holds step files of the JSON-lines format (to convert first)."""
    check_directory(directory, "step")
    try:
        steps = StoredSteps(directory).steps_from(0)
    except StepFileError as err:
        raise UsageError(err.message) from None
    if not steps:
        raise UsageError(
            f"no step files found in {shown(directory)} (step files are named like "
            f"{step_file_name(42)})"
        )
    return steps


def walk_steps(
    directory: str, steps: list[int], progress: Progress
) -> Iterator[tuple[StepFile, StepSample | None]]:
    """Each step of ``steps`` read in turn: ``(step, None)`` first, then ``(step, sample)`` for
    each of its samples; the counts go to ``progress``, which is closed at the end."""
    source = StoredSteps(directory, cache_steps=1)
    seen = 0
    try:
        for done, number in enumerate(steps):
            name = step_file_name(number)
            try:
                n = len(source.loaded(number).lengths)
            except (StepFileError, PayloadError) as err:
                yield StepFile(step=number, name=name, samples=0, problem=err), None
                continue
            step = StepFile(step=number, name=name, samples=n, problem=None)
            yield step, None
            for i in range(n):
                try:
                    got = StepSample(sample=i, value=source.sample(number, i, None))
                except (StepFileError, PayloadError) as err:
                    got = StepSample(sample=i, error=err)
                seen += 1
                progress.update(done, len(steps), "step files", f", {seen} samples")
                yield step, got
            progress.update(done + 1, len(steps), "step files", f", {seen} samples")
    finally:
        progress.close()
        source.root.close()


def step_finding(step: StepFile, err: RollfeedError, **where: Any) -> dict[str, Any]:
    """A finding in ``step`` as a JSON record: ``type``, ``message``, ``step_file``, ``step``,
    then ``where`` (sample, uid: None left out) and, for a payload error, its ``field``, ``pos``,
    ``file`` (in the payload root) and ``offset`` (a step file error's own place is the step file
    and the sample, given already)."""
    out: dict[str, Any] = {"type": type(err).__name__, "message": err.message}
    out.update(step_file=step.name, step=step.step)
    out.update({k: v for k, v in where.items() if v is not None})
    if "sample" not in out and isinstance(err, StepFileError) and err.sample is not None:
        out["sample"] = err.sample  # a step's finding that knows its sample
    if isinstance(err, PayloadError):
        place = {k: v for k, v in err.place.items() if v is not None}
        out.update({k: place[k] for k in ("field", "pos", "file", "offset") if k in place})
    return out


def step_finding_line(f: dict[str, Any]) -> str:
    """A :func:`step_finding` record as one line of text::

    BAD step_000002.rfs sample 2 (uid s2): sampling_mask at pos 4: <message>
        [file=step_000002/a.rfp, offset=1414]
    """
    where = shown(f["step_file"])
    if "sample" in f:
        uid = f" (uid {shown(str(f['uid']))})" if "uid" in f else ""
        where += f" sample {f['sample']}{uid}"
    what = shown(f["field"]) if "field" in f else ""
    what += f" at pos {f['pos']}" if "pos" in f else ""
    place = ", ".join(f"{k}={shown(str(f[k]))}" for k in ("file", "offset") if k in f)
    return (
        f"BAD {where}: {what + ': ' if what else ''}{shown(f['message'])}"
        f"{f' [{place}]' if place else ''}"
    )
