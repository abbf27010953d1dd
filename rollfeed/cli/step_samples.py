"""Every sample of a step directory, read as the loader reads it, a finding per unreadable one.

Through the loaders' own step-file reading (:mod:`rollfeed.loaders.step_files`,
:mod:`rollfeed.loaders.step_index`), so the commands follow the step format as it changes: a
step file with an index is read sample by sample through it
(:func:`~rollfeed.loaders.step_index.read_indexed_sample`: each line's bounds and its indexed
token count checked, as a DataLoader worker reads it); one without an index, or whose index
cannot be read (a finding of its own), is parsed line by line
(:func:`~rollfeed.loaders.step_index.parse_sample`), each bad line a finding that names it.

Example (``steps/step_000003.jsonl`` of two samples, the second line malformed)::

    [StepFile(step=3, name="step_000003.jsonl", ...)] = step_files("steps")
    list(samples(step_files("steps")[0]))
        -> [StepSample(sample=0, line=1, value=Sample(...)),
            StepSample(sample=1, line=2, error=StepFileError("malformed sample record ..."))]
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from rollfeed.cli.errors import UsageError
from rollfeed.cli.report import shown
from rollfeed.cli.root_scan import check_directory
from rollfeed.collate import Sample
from rollfeed.errors import RollfeedError
from rollfeed.loaders.errors import StepFileError
from rollfeed.loaders.step_files import list_steps, step_file_name
from rollfeed.loaders.step_index import (
    StepIndex,
    parse_sample,
    read_indexed_sample,
    read_step_index,
)
from rollfeed.payload import PayloadError


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """Sample ``sample`` (0-based, in file order) of a step file, on 1-based line ``line``:
    its ``value``, or the ``error`` that reading it raised."""

    sample: int
    line: int
    value: Sample | None = None
    error: StepFileError | None = None


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepFile:
    """One step file: its step number, name (in the directory) and path, and its index (None
    without one, or when ``index_error`` says why it cannot be read)."""

    step: int
    name: str
    path: str
    index: StepIndex | None
    index_error: StepFileError | None

    @property
    def indexed(self) -> bool:
        return self.index is not None


def step_numbers(directory: str) -> list[int]:
    """The steps present in ``directory``; :class:`UsageError` when it is not a directory or
    holds no step file."""
    check_directory(directory, "step")
    steps = list_steps(directory)
    if not steps:
        raise UsageError(
            f"no step files found in {shown(directory)} (step files are named like "
            f"{step_file_name(42)})"
        )
    return steps


def open_step(directory: str, step: int) -> StepFile:
    """Step ``step`` of ``directory`` with its checked index, if it has one."""
    name = step_file_name(step)
    path = os.path.join(directory, name)
    try:
        index, problem = read_step_index(path), None
    except StepFileError as err:
        index, problem = None, err
    except OSError as err:
        index, problem = None, _unreadable(err, path)
    return StepFile(step=step, name=name, path=path, index=index, index_error=problem)


def samples(step: StepFile) -> Iterator[StepSample]:
    """Every sample of ``step`` in file order (module doc)."""
    try:
        with open(step.path, "rb") as f:
            if step.index is None:
                yield from _parsed(f, step.path)
            else:
                yield from _indexed(f.fileno(), step.index, step.path)
    except OSError as err:  # the step file itself cannot be opened or read
        yield StepSample(sample=0, line=0, error=_unreadable(err, step.path))


def _indexed(fd: int, index: StepIndex, path: str) -> Iterator[StepSample]:
    for i in range(len(index)):
        line = int(index.lines[i])
        try:
            yield StepSample(
                sample=i, line=line, value=read_indexed_sample(fd, index, i, file=path)
            )
        except StepFileError as err:
            yield StepSample(sample=i, line=line, error=err)


def _parsed(f: BinaryIO, path: str) -> Iterator[StepSample]:
    i = 0
    for number, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            yield StepSample(
                sample=i, line=number, value=parse_sample(text, file=path, line_number=number)
            )
        except StepFileError as err:
            yield StepSample(sample=i, line=number, error=err)
        i += 1


def _unreadable(err: OSError, path: str) -> StepFileError:
    return StepFileError(f"cannot read the step file: {err.strerror or err}", file=path)


def step_finding(step: StepFile, err: RollfeedError, **where: Any) -> dict[str, Any]:
    """A finding in ``step`` as a JSON record: ``type``, ``message``, ``step_file``, ``step``,
    then ``where`` (line, sample, uid: None left out) and, for a payload error, its ``field``,
    ``pos``, ``file`` (in the payload root) and ``offset`` (a step file error's own place is the
    step file and line, given already)."""
    out: dict[str, Any] = {"type": type(err).__name__, "message": err.message}
    out.update(step_file=step.name, step=step.step)
    out.update({k: v for k, v in where.items() if v is not None})
    if "line" not in out and isinstance(err, StepFileError) and err.line is not None:
        out["line"] = err.line  # a step index finding that knows the line
    if isinstance(err, PayloadError):
        place = {k: v for k, v in err.place.items() if v is not None}
        out.update({k: place[k] for k in ("field", "pos", "file", "offset") if k in place})
    return out


def step_finding_line(f: dict[str, Any]) -> str:
    """A :func:`step_finding` record as one line of text::

    BAD step_000002.jsonl line 3 (sample 2, uid s2): sampling_mask at pos 4: <message>
        [file=step_000002/a.rfp, offset=1414]
    """
    where = shown(f["step_file"])
    if "sample" in f:
        uid = f", uid {shown(str(f['uid']))}" if "uid" in f else ""
        where += f" line {f['line']} (sample {f['sample']}{uid})"
    elif "line" in f:
        where += f" line {f['line']}"
    what = shown(f["field"]) if "field" in f else ""
    what += f" at pos {f['pos']}" if "pos" in f else ""
    place = ", ".join(f"{k}={shown(str(f[k]))}" for k in ("file", "offset") if k in f)
    return (
        f"BAD {where}: {what + ': ' if what else ''}{shown(f['message'])}"
        f"{f' [{place}]' if place else ''}"
    )
