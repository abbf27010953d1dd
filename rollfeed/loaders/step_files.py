"""Step files: one JSON line per sample, dropped by an orchestrator beside the payload root.

Naming: step ``42`` lives in ``step_000042.jsonl``. A writer must make the file appear whole, e.g.
write ``.step_000042.jsonl.tmp`` and ``os.replace`` it: names that do not match the pattern are
ignored, so a half-written temporary file is never read.

Each line is a :class:`~rollfeed.collate.Sample` record (``Sample.to_json``); blank lines are
skipped. Beside each step file :func:`write_step_file` puts its index, ``step_000042.index.json``
(token counts, line offsets, a content hash and the loss runs of each line,
:mod:`rollfeed.loaders.step_index`). A line that does not parse raises :class:`StepFileError`
naming the file and the 1-based line number; so does anything but a regular file under a step
file's name (:mod:`rollfeed.loaders.step_open`). A write that fails (disk full, a file size limit,
an I/O error) raises :class:`StepWriteError` naming the file and leaves neither temporary file nor
a new index behind.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rollfeed.collate import Sample
from rollfeed.loaders.errors import StepFileError, StepWriteError
from rollfeed.loaders.step_index import index_of_lines, index_path, write_step_index
from rollfeed.loaders.step_lines import parse_step
from rollfeed.loaders.step_open import fd_pread, open_step

_NAME = re.compile(r"^step_(\d+)\.jsonl$")


def step_file_name(step: int) -> str:
    """``step_000042.jsonl`` for ``step=42`` (six digits, more when needed)."""
    if step < 0:
        raise StepFileError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}.jsonl"


def parse_step_name(name: str) -> int | None:
    """The step number of a step file name, or ``None`` for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def list_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Sorted step numbers of the step files present in ``directory`` (none when it does not
    exist)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(s for n in names if (s := parse_step_name(n)) is not None)


def read_step_file(path: str | os.PathLike[str]) -> list[Sample]:
    """The samples of one step file, in line order, parsing every line (see module doc for errors).

    Ignores the step index: this is the whole-file read that the index spares planners and workers.
    The file is opened by the payload's open rule and read up to its size at open
    (:mod:`rollfeed.loaders.step_open`).
    """
    file = os.fspath(path)
    fd = open_step(file, what="step file")
    if fd is None:
        raise StepFileError("no such step file", file=file)
    try:
        return parse_step(fd_pread(fd), os.fstat(fd).st_size, file=file).samples
    finally:
        os.close(fd)


def write_step_file(
    directory: str | os.PathLike[str], step: int, samples: list[Sample] | tuple[Sample, ...]
) -> Path:
    """Write step ``step`` and its index atomically; returns the step file's path.

    Both go to temporary names; the index is moved into place first, then the step file, so a
    reader that sees the step file sees its index (:mod:`rollfeed.loaders.step_index`). The
    directory is made when missing, as a payload writer makes its group. A write that fails
    raises :class:`StepWriteError` and removes what it wrote (a new index too).
    """
    path = Path(directory) / step_file_name(step)
    tmp = path.with_name(f".{path.name}.tmp")
    indexed = False
    try:
        lines = [(s.to_json() + "\n").encode("utf-8") for s in samples]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.writelines(lines)
        write_step_index(path, index_of_lines(lines, samples))
        indexed = True
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if indexed:  # the index is in place but its step file is not: it would describe nothing
            index_path(path).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise StepWriteError(
                f"writing step {step} failed ({type(err).__name__}: {err.strerror or err}); "
                "nothing of it was left behind: free space (or raise the file size limit) and "
                "write the step again",
                file=os.fspath(path),
                step=step,
            ) from err
        raise
    return path
