"""Step files: one JSON line per sample, dropped by an orchestrator beside the payload root.

Naming: step ``42`` lives in ``step_000042.jsonl``. A writer must make the file appear whole, e.g.
write ``.step_000042.jsonl.tmp`` and ``os.replace`` it: names that do not match the pattern are
ignored, so a half-written temporary file is never read.

Each line is a :class:`~rollfeed.collate.Sample` record (``Sample.to_json``); blank lines are
skipped. Beside each step file :func:`write_step_file` puts its index, ``step_000042.index.json``
(token counts and line offsets, :mod:`rollfeed.loaders.step_index`). A line that does not parse
raises :class:`StepFileError` naming the file and the 1-based line number. A write that fails
(disk full, a file size limit, an I/O error) raises :class:`StepWriteError` naming the file and
leaves neither temporary file nor a new index behind.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from rollfeed.collate import Sample
from rollfeed.loaders.errors import StepFileError, StepTimeoutError, StepWriteError
from rollfeed.loaders.step_index import StepIndex, index_path, parse_sample, write_step_index

logger = logging.getLogger(__name__)
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
    """Sorted step numbers of the step files present in ``directory``."""
    steps = (parse_step_name(n) for n in os.listdir(directory))
    return sorted(s for s in steps if s is not None)


def read_step_file(path: str | os.PathLike[str]) -> list[Sample]:
    """The samples of one step file, in line order, parsing every line (see module doc for errors).

    Ignores the step index: this is the whole-file read that the index spares planners and workers.
    """
    with open(path, "rb") as f:
        return parse_step_lines(f, file=os.fspath(path))


def parse_step_lines(lines: Iterable[bytes], *, file: str) -> list[Sample]:
    """The samples of a step file's ``lines`` (e.g. the open file), blank lines skipped."""
    return [
        parse_sample(line, file=file, line_number=number)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]


def poll_for_step(
    present: Callable[[], bool], step: int, *, where: str, timeout_s: float, poll_s: float
) -> None:
    """Return once ``present()`` holds; :class:`StepTimeoutError` naming ``where`` after
    ``timeout_s`` (a local directory and an object store are both polled)."""
    deadline = time.monotonic() + timeout_s
    while not present():
        if time.monotonic() >= deadline:
            raise StepTimeoutError(
                f"step {step} did not appear within step_timeout_s={timeout_s}; the producer may "
                "have stopped, or raise step_timeout_s",
                file=where,
            )
        time.sleep(poll_s)


def wait_for_step(
    directory: str | os.PathLike[str], step: int, *, timeout_s: float, poll_s: float = 0.02
) -> Path:
    """Path of step ``step``'s file once it exists; :class:`StepTimeoutError` after ``timeout_s``.

    Polls (no inotify: it does not see writes made on other hosts of a shared filesystem).
    """
    path = Path(directory) / step_file_name(step)
    poll_for_step(path.exists, step, where=os.fspath(path), timeout_s=timeout_s, poll_s=poll_s)
    logger.debug("step file %s present", path)
    return path


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
        lengths, sizes = [], []
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            for s in samples:
                line = (s.to_json() + "\n").encode("utf-8")
                f.write(line)
                lengths.append(len(s))
                sizes.append(len(line))
        ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
        index = StepIndex(
            file_bytes=int(ends[-1]) if len(ends) else 0,
            lengths=np.asarray(lengths, dtype=np.int64),
            offsets=ends - np.asarray(sizes, dtype=np.int64),
            sizes=np.asarray(sizes, dtype=np.int64),
            lines=np.arange(1, len(sizes) + 1, dtype=np.int64),
        )
        write_step_index(path, index)
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
