"""Step index: a sidecar giving each sample's token count and where its line lies in the step file.

With it, planning reads the token counts without parsing the step file, and a worker seeks to and
parses only the lines of the samples it is asked for, instead of the whole file.

Layout: ``step_000042.index.json`` beside ``step_000042.jsonl`` (:func:`index_path`), one JSON
object; arrays have one entry per sample, in the step file's sample order::

    {"format": "rollfeed.step_index", "version": 1, "file_bytes": 97,
     "lengths": [3, 5],      # token count of each sample (len(Sample))
     "offsets": [0, 41],     # byte offset of its line in the step file
     "sizes": [41, 56],      # bytes of the line, its "\\n" included
     "lines": [1, 2]}        # 1-based line number (blank lines hold no sample)

:func:`~rollfeed.loaders.step_files.write_step_file` writes the index first and then moves the
step file into place, so a reader that sees a step file sees its index. A step file that has none
(written by another producer) gets one from :func:`build_step_index`.

Checks (each failure a :class:`StepFileError` naming the file): reading the index, its shape and
``file_bytes`` against the step file's size; reading a line, that it starts and ends on a line
boundary and that its sample has the indexed token count. A file rewritten to the very same size
with lines of other sizes fails the line checks; one with identical line sizes and token counts
is not detected (that would need reading the whole file, which the index exists to avoid).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollfeed.collate import Sample
from rollfeed.collate.errors import CollateError
from rollfeed.loaders.errors import StepFileError
from rollfeed.payload import PayloadError

FORMAT = "rollfeed.step_index"
VERSION = 1
_ARRAYS = ("lengths", "offsets", "sizes", "lines")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepIndex:
    """Per sample ``[n]`` int64 arrays (see the module doc) and the step file's size in bytes."""

    file_bytes: int
    lengths: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    lines: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def index_path(step_path: str | os.PathLike[str]) -> Path:
    """``.../step_000042.index.json`` for ``.../step_000042.jsonl``."""
    path = Path(step_path)
    return path.with_name(f"{path.stem}.index.json")


def parse_sample(line: bytes | str, *, file: str, line_number: int) -> Sample:
    """One step file line as a :class:`Sample`; :class:`StepFileError` naming file and line."""
    try:
        return Sample.from_json(line)
    except (ValueError, TypeError, KeyError) as err:
        # json, pydantic (segments) and collate errors are all ValueError subclasses
        kind = type(err).__name__
        if not isinstance(err, CollateError | PayloadError):
            kind = f"malformed sample record ({kind})"
        raise StepFileError(
            f"{kind}: {err}; fix or remove the line", file=file, line=line_number
        ) from err


def write_step_index(step_path: str | os.PathLike[str], index: StepIndex) -> Path:
    """Write ``index`` as ``step_path``'s sidecar atomically (temporary name, ``os.replace``)."""
    path = index_path(step_path)
    record = {"format": FORMAT, "version": VERSION, "file_bytes": int(index.file_bytes)}
    record.update({k: getattr(index, k).tolist() for k in _ARRAYS})
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_step_index(step_path: str | os.PathLike[str]) -> StepIndex | None:
    """The checked index of ``step_path``, or ``None`` when it has no sidecar."""
    ipath = index_path(step_path)
    try:
        text = ipath.read_bytes()
    except FileNotFoundError:
        return None
    where = os.fspath(ipath)
    try:
        record = json.loads(text)
        if record.get("format") != FORMAT or record.get("version") != VERSION:
            raise ValueError(f"format/version {record.get('format')!r}/{record.get('version')!r}")
        arrays = {k: np.asarray(record[k], dtype=np.int64).reshape(-1) for k in _ARRAYS}
        index = StepIndex(file_bytes=int(record["file_bytes"]), **arrays)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise StepFileError(
            f"unreadable step index ({type(err).__name__}: {err}), expected {FORMAT} version "
            f"{VERSION}; rebuild it with build_step_index or delete it",
            file=where,
        ) from err
    _check(index, os.fspath(step_path), where)
    return index


def _check(index: StepIndex, step_file: str, where: str) -> None:
    size = os.stat(step_file).st_size
    if index.file_bytes != size:
        raise StepFileError(
            f"step index says {index.file_bytes} bytes, the step file has {size}: the file changed "
            "after its index was written; rebuild the index with build_step_index",
            file=step_file,
        )
    n = {len(getattr(index, k)) for k in _ARRAYS}
    ends = index.offsets + index.sizes
    ok = (
        len(n) == 1
        and (index.lengths >= 0).all()
        and (index.sizes >= 1).all()
        and (index.offsets >= 0).all()
        and (ends[:-1] <= index.offsets[1:]).all()
        and (ends <= size).all()
        and (index.lines >= 1).all()
        and (np.diff(index.lines) >= 1).all()
    )
    if not ok:
        raise StepFileError(
            "step index is inconsistent (array lengths differ, or lines overlap or run past the "
            f"file's {size} bytes); rebuild it with build_step_index",
            file=where,
        )


def read_indexed_sample(fd: int, index: StepIndex, i: int, *, file: str) -> Sample:
    """Sample ``i`` of the step file open as ``fd``: reads and parses its line only.

    Reads one byte before the line too, to check that the line starts on a line boundary.
    """
    offset, size = int(index.offsets[i]), int(index.sizes[i])
    line_number = int(index.lines[i])
    lead = 1 if offset else 0
    data = os.pread(fd, size + lead, offset - lead)
    end = offset + size
    aligned = (
        len(data) == size + lead
        and (not lead or data[:1] == b"\n")
        and (data.endswith(b"\n") or end == index.file_bytes)
    )
    if not aligned:
        raise StepFileError(
            f"step index points at bytes [{offset}, {end}), which are not one whole line of the "
            "step file: the file changed after its index was written; rebuild the index with "
            "build_step_index",
            file=file,
            line=line_number,
        )
    sample = parse_sample(data[lead:], file=file, line_number=line_number)
    if len(sample) != index.lengths[i]:
        raise StepFileError(
            f"step index says {int(index.lengths[i])} tokens, the line's sample has {len(sample)}: "
            "the file changed after its index was written; rebuild the index with build_step_index",
            file=file,
            line=line_number,
        )
    return sample


def build_step_index(step_path: str | os.PathLike[str]) -> Path:
    """Index an existing step file (parses it once); returns the sidecar's path.

    For step files written without one, e.g. by another producer. Overwrites a present index.
    """
    path = os.fspath(step_path)
    rows: list[tuple[int, int, int, int]] = []
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                sample = parse_sample(line, file=path, line_number=number)
                rows.append((len(sample), offset, len(line), number))
            offset += len(line)
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    index = StepIndex(file_bytes=offset, **{k: table[:, j] for j, k in enumerate(_ARRAYS)})
    return write_step_index(path, index)
