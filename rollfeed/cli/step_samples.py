"""Every sample of a step directory, read as the loader reads it, a finding per unreadable one.

Through the loaders' own step-file reading, so the commands follow the step format as it
changes: a step file is opened by the loader's open rule (:func:`~rollfeed.loaders.step_open.
open_step`: no symlink followed, no FIFO waited on), its index read and checked against that
opened file (:func:`~rollfeed.loaders.step_index.read_step_index`), and then each sample read
through the index (:func:`~rollfeed.loaders.step_index_check.read_indexed_sample`: the line's
bounds, content hash and indexed token count checked, as a DataLoader worker reads it). A step
file without a usable index (none, or one of an older version: the loader parses such a step
whole) is read line by line (:func:`~rollfeed.loaders.step_lines.step_lines`, bounded as the
loader's), each line parsed alone (:func:`~rollfeed.loaders.step_lines.parse_sample`), so each
bad line is a finding of its own. An index the loader refuses is a finding of the step, and its
lines are then read line by line too.

Example (``steps/step_000003.jsonl`` of two samples, the second line malformed)::

    with open_step_file("steps", 3) as step:
        step.indexed, step.problem       -> True, None
        list(samples(step))
            -> [StepSample(sample=0, line=1, value=Sample(...)),
                StepSample(sample=1, line=2, error=StepFileError("malformed sample record ..."))]
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollfeed.cli.errors import UsageError
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import shown
from rollfeed.cli.root_scan import check_directory
from rollfeed.collate import Sample
from rollfeed.errors import RollfeedError
from rollfeed.loaders.errors import StepFileError, StepIndexVersionError
from rollfeed.loaders.step_files import list_steps, step_file_name
from rollfeed.loaders.step_index import StepIndex, read_step_index
from rollfeed.loaders.step_index_check import read_indexed_sample
from rollfeed.loaders.step_lines import parse_sample, step_lines
from rollfeed.loaders.step_open import Pread, fd_pread, open_step
from rollfeed.payload import PayloadError


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """Sample ``sample`` (0-based, in file order) of a step file, on 1-based line ``line``:
    its ``value``, or the ``error`` that reading it raised. ``sample`` is None for an error of
    the file itself (a NUL byte, a line too long, a read that failed): the loader refuses the
    whole step, and the lines after it are not read."""

    sample: int | None
    line: int | None
    value: Sample | None = None
    error: StepFileError | None = None


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepFile:
    """One opened step file: its step number, name (in the directory) and path, its size and
    ``pread`` (None when it could not be opened), its index (None without a usable one) and the
    ``problem`` of the step as a whole (the file cannot be opened, the loader refuses its index)."""

    step: int
    name: str
    path: str
    size: int
    pread: Pread | None
    index: StepIndex | None
    problem: StepFileError | None

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


@contextlib.contextmanager
def open_step_file(directory: str, step: int) -> Iterator[StepFile]:
    """Step ``step`` of ``directory`` opened, with its checked index if it has a usable one."""
    name = step_file_name(step)
    path = os.path.join(directory, name)
    closed = {"step": step, "name": name, "path": path, "size": 0, "pread": None, "index": None}
    try:
        fd = open_step(path, what="step file")
    except StepFileError as err:  # a symlink, a FIFO, a directory under the name
        yield StepFile(**closed, problem=err)
        return
    if fd is None:
        yield StepFile(
            **closed, problem=StepFileError("the step file vanished after it was listed", file=path)
        )
        return
    try:
        size, pread = os.fstat(fd).st_size, fd_pread(fd)
        index, problem = None, None
        try:
            index = read_step_index(path, size=size, pread=pread)
        except StepIndexVersionError:
            pass  # the loader does not use it and parses the step whole: so do we
        except StepFileError as err:
            problem = err
        except OSError as err:
            problem = _unreadable(err, path)
        yield StepFile(
            step=step,
            name=name,
            path=path,
            size=size,
            pread=pread,
            index=index,
            problem=problem,
        )
    finally:
        os.close(fd)


def samples(step: StepFile) -> Iterator[StepSample]:
    """Every sample of ``step`` in file order (module doc); none when it could not be opened."""
    if step.pread is None:
        return
    try:
        if step.index is None:
            yield from _parsed(step.pread, step.size, step.path)
        else:
            yield from _indexed(step.pread, step.index, step.path)
    except OSError as err:  # the step file cannot be read
        yield StepSample(sample=None, line=None, error=_unreadable(err, step.path))


def walk_steps(
    directory: str, steps: list[int], progress: Progress
) -> Iterator[tuple[StepFile, StepSample | None]]:
    """Each step of ``steps`` opened in turn: ``(step, None)`` first, then ``(step, sample)``
    for each of its samples; the counts go to ``progress``, which is closed at the end."""
    seen = 0
    try:
        for done, number in enumerate(steps):
            with open_step_file(directory, number) as step:
                yield step, None
                for got in samples(step):
                    seen += 1
                    progress.update(done, len(steps), "step files", f", {seen} samples")
                    yield step, got
            progress.update(done + 1, len(steps), "step files", f", {seen} samples")
    finally:
        progress.close()


def _indexed(pread: Pread, index: StepIndex, path: str) -> Iterator[StepSample]:
    for i in range(len(index)):
        line = int(index.lines[i])
        try:
            sample = read_indexed_sample(pread, index, i, file=path)
        except StepFileError as err:
            yield StepSample(sample=i, line=line, error=err)
            continue
        yield StepSample(sample=i, line=line, value=sample)


def _parsed(pread: Pread, size: int, path: str) -> Iterator[StepSample]:
    i = 0
    try:
        for number, _, text in step_lines(pread, size, file=path):
            if not text.strip():
                continue
            try:
                sample = parse_sample(text, file=path, line_number=number)
            except StepFileError as err:
                yield StepSample(sample=i, line=number, error=err)
            else:
                yield StepSample(sample=i, line=number, value=sample)
            i += 1
    except StepFileError as err:  # the file itself: a NUL byte, a line too long, it shrank
        yield StepSample(sample=None, line=err.line, error=err)


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
    if "sample" in f:  # a sample's finding
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
