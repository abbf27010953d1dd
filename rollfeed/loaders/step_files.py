"""Step files: one JSON line per sample, dropped by an orchestrator beside the payload root.

Naming: step ``42`` lives in ``step_000042.jsonl``. A writer must make the file appear whole, e.g.
write ``.step_000042.jsonl.tmp`` and ``os.replace`` it: names that do not match the pattern are
ignored, so a half-written temporary file is never read.

Each line is a :class:`~rollfeed.collate.Sample` record (``Sample.to_json``); blank lines are
skipped. A line that does not parse raises :class:`StepFileError` naming the file and the 1-based
line number.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from rollfeed.collate import Sample
from rollfeed.collate.errors import CollateError
from rollfeed.loaders.errors import StepFileError, StepTimeoutError
from rollfeed.payload import PayloadError

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
    """The samples of one step file, in line order (see module doc for errors)."""
    samples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                samples.append(Sample.from_json(line))
            except (ValueError, TypeError, KeyError) as err:
                # json, pydantic (segments) and collate errors are all ValueError subclasses
                kind = type(err).__name__
                if not isinstance(err, CollateError | PayloadError):
                    kind = f"malformed sample record ({kind})"
                raise StepFileError(
                    f"{kind}: {err}; fix or remove the line", file=os.fspath(path), line=number
                ) from err
    return samples


def wait_for_step(
    directory: str | os.PathLike[str], step: int, *, timeout_s: float, poll_s: float = 0.02
) -> Path:
    """Path of step ``step``'s file once it exists; :class:`StepTimeoutError` after ``timeout_s``.

    Polls (no inotify: it does not see writes made on other hosts of a shared filesystem).
    """
    path = Path(directory) / step_file_name(step)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise StepTimeoutError(
                f"step {step} did not appear within step_timeout_s={timeout_s}; the producer may "
                "have stopped, or raise step_timeout_s",
                file=os.fspath(path),
            )
        time.sleep(poll_s)
    logger.debug("step file %s present", path)
    return path


def write_step_file(
    directory: str | os.PathLike[str], step: int, samples: list[Sample] | tuple[Sample, ...]
) -> Path:
    """Write step ``step`` atomically (temporary name, then ``os.replace``); returns its path."""
    path = Path(directory) / step_file_name(step)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(s.to_json() + "\n" for s in samples)
    os.replace(tmp, path)
    return path
