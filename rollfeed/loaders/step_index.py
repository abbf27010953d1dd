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

Checks (each failure a :class:`StepFileError` naming the file, and the line where known):

- reading the index (planning): a JSON object of this layout holding integers in ``[0, 2**62)``
  only; ``file_bytes`` equals the step file's size; entries are in file order, at least one token
  and one byte each, never overlapping; the bytes no entry covers are blank lines, as many as the
  line numbers skip (an index that leaves samples out, empty arrays included, fails here). A file
  without blank lines, as ``write_step_file`` writes it, is checked from the index and its size
  alone; blank lines are read, only they;
- reading a line (a worker): its bytes are exactly one line and its sample has the indexed token
  count.

A file rewritten to the very same size with lines of other sizes fails the line checks; one with
identical line sizes and token counts is not detected (that would need reading the whole file,
which the index exists to avoid).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
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
_MAX = 1 << 62  # bound on every index value, so that sums of two stay in int64
Pread = Callable[[int, int], bytes]  # (n, offset) -> up to n bytes of the step file at offset


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
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as err:
        # collate and payload errors are ValueError subclasses; the others are what malformed
        # input raises from Python or NumPy, named here with the place rather than escaping bare
        kind = type(err).__name__
        if not isinstance(err, CollateError | PayloadError):
            kind = f"malformed sample record ({kind})"
        raise StepFileError(
            f"{kind}: {err}; fix or remove the line", file=file, line=line_number
        ) from err


def step_index_bytes(index: StepIndex) -> bytes:
    """The sidecar's bytes for ``index`` (the layout of the module doc)."""
    record = {"format": FORMAT, "version": VERSION, "file_bytes": int(index.file_bytes)}
    record.update({k: getattr(index, k).tolist() for k in _ARRAYS})
    return json.dumps(record, separators=(",", ":")).encode("utf-8")


def write_step_index(step_path: str | os.PathLike[str], index: StepIndex) -> Path:
    """Write ``index`` as ``step_path``'s sidecar atomically (temporary name, ``os.replace``);
    a failed write leaves no temporary file (its ``OSError`` goes on to the caller)."""
    path = index_path(step_path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(step_index_bytes(index))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_step_index(
    step_path: str | os.PathLike[str], *, size: int | None = None, pread: Pread | None = None
) -> StepIndex | None:
    """The checked index of ``step_path`` (``size``, ``pread``: of the step file version it
    is checked against, default the file at the path), or ``None`` when it has no sidecar."""
    ipath = index_path(step_path)
    try:
        text = ipath.read_bytes()
    except FileNotFoundError:
        return None
    return step_index_from_bytes(
        text, os.fspath(step_path), os.fspath(ipath), size=size, pread=pread
    )


def step_index_from_bytes(
    text: bytes,
    step_file: str,
    where: str,
    *,
    size: int | None = None,
    pread: Pread | None = None,
) -> StepIndex:
    """The index ``text`` (read from ``where``), checked against ``step_file``: its ``size`` and
    ``pread(n, offset)`` (default: the local file's)."""
    try:
        index = _parse(text)
    except (ValueError, RecursionError) as err:
        raise StepFileError(
            f"unreadable step index ({type(err).__name__}: {err}), expected {FORMAT} version "
            f"{VERSION}; rebuild it with build_step_index or delete it",
            file=where,
        ) from None
    _check(index, step_file, where, size=size, pread=pread)
    return index


def _parse(text: bytes) -> StepIndex:
    """The index record as a :class:`StepIndex`; ``ValueError`` for anything but JSON ints in
    ``[0, 2**62)`` where the layout has them (no floats, booleans or wrapping huge ints)."""
    if b"true" in text or b"false" in text:  # JSON booleans would pass as the ints 1 and 0
        raise ValueError("a boolean where an integer belongs")
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise ValueError(f"format/version {record.get('format')!r}/{record.get('version')!r}")
    file_bytes = record.get("file_bytes")
    if type(file_bytes) is not int or not 0 <= file_bytes < _MAX:
        raise ValueError(f"file_bytes {file_bytes!r} is not an integer in [0, 2**62)")
    arrays = {}
    for k in _ARRAYS:
        values = record.get(k)
        arr = np.asarray(values) if isinstance(values, list) else None
        if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind != "i"):
            raise ValueError(f"{k!r} is not a list of integers")
        arr = arr.astype(np.int64)
        if arr.size and not (arr.min() >= 0 and arr.max() < _MAX):
            raise ValueError(f"{k!r} holds a value outside [0, 2**62)")
        arrays[k] = arr
    return StepIndex(file_bytes=file_bytes, **arrays)


def _check(
    index: StepIndex, step_file: str, where: str, *, size: int | None, pread: Pread | None
) -> None:
    """The index against the step file: from the index and the file's size alone when the file
    has no blank lines (what ``write_step_file`` writes); bytes between indexed lines are read
    and must be blank lines, so an index that skips samples cannot pass."""
    size = os.stat(step_file).st_size if size is None else size
    if index.file_bytes != size:
        raise StepFileError(
            f"step index says {index.file_bytes} bytes, the step file has {size}: the file changed "
            "after its index was written; rebuild the index with build_step_index",
            file=step_file,
        )
    ok = len({len(getattr(index, k)) for k in _ARRAYS}) == 1
    if ok:  # every value is in [0, 2**62) (_parse), so these sums cannot wrap
        ends = index.offsets + index.sizes
        gaps = index.offsets - np.concatenate([[0], ends])[:-1]  # bytes before each line
        blanks = np.diff(index.lines, prepend=0) - 1  # blank lines the index says lie there
        ok = bool(
            (index.lengths >= 1).all()
            and (index.sizes >= 1).all()
            and (blanks >= 0).all()
            and (gaps >= blanks).all()
            and (ends <= size).all()
        )
    if not ok:
        raise StepFileError(
            "step index is inconsistent (array lengths differ, a sample of no tokens, or lines "
            f"overlap, go backwards or run past the file's {size} bytes); rebuild it with "
            "build_step_index",
            file=where,
        )
    tail = size - (int(ends[-1]) if len(ends) else 0)
    if tail or gaps.any():
        if pread is not None:
            _check_gaps(index, step_file, gaps, blanks, tail, pread)
            return
        fd = os.open(step_file, os.O_RDONLY)
        try:
            _check_gaps(index, step_file, gaps, blanks, tail, lambda n, at: os.pread(fd, n, at))
        finally:
            os.close(fd)


def _check_gaps(
    index: StepIndex,
    step_file: str,
    gaps: np.ndarray,
    blanks: np.ndarray,
    tail: int,
    pread: Pread,
) -> None:
    """Bytes no entry covers must be blank lines, as many as the line numbers skip.

    ``gaps [n]``: bytes before each entry's line; ``blanks [n]``: lines the index skips there;
    ``tail``: bytes after the last entry (any number of blank lines)."""
    last = int(index.lines[-1]) if len(index) else 0
    at = np.flatnonzero(gaps)
    starts, lines = index.offsets[at] - gaps[at], index.lines[at] - blanks[at]
    spans: list[tuple[int, int, int | None, int]] = list(
        zip(starts.tolist(), gaps[at].tolist(), blanks[at].tolist(), lines.tolist(), strict=True)
    )
    if tail:
        spans.append((index.file_bytes - tail, tail, None, last + 1))
    for start, length, want, line in spans:
        newlines = _blank_newlines(pread, start, length)
        if newlines is None or (want is not None and newlines != want):
            what = (
                "are not blank lines"
                if newlines is None
                else f"hold {newlines} lines where the index says {want}"
            )
            raise StepFileError(
                f"step index leaves bytes [{start}, {start + length}) of the step file "
                f"unindexed and they {what}: the index has {len(index)} entries and does not "
                "cover the file's samples (it is stale or cut short); rebuild it with "
                "build_step_index",
                file=step_file,
                line=line,
            )


_BLANK = b" \t\n\r\x0b\x0c"  # what bytes.strip() removes: a line of these holds no sample


def _blank_newlines(pread: Pread, start: int, length: int, chunk: int = 1 << 16) -> int | None:
    """Newlines in bytes ``[start, start + length)`` if they are all blank, else None.
    Reads in chunks and stops at the first other byte."""
    newlines = 0
    while length > 0:
        data = pread(min(chunk, length), start)
        if not data or data.translate(None, _BLANK):
            return None
        newlines += data.count(b"\n")
        start, length = start + len(data), length - len(data)
    return newlines


def read_indexed_sample(fd: int | Pread, index: StepIndex, i: int, *, file: str) -> Sample:
    """Sample ``i`` of the step file open as ``fd`` (or read by ``pread(n, offset)``, e.g. a
    ranged GET): reads and parses its line only.

    Reads one byte before the line too, to check that the bytes are exactly one line.
    """
    offset, size = int(index.offsets[i]), int(index.sizes[i])
    line_number = int(index.lines[i])
    lead = 1 if offset else 0
    data = (
        fd(size + lead, offset - lead) if callable(fd) else os.pread(fd, size + lead, offset - lead)
    )
    end = offset + size
    aligned = (
        len(data) == size + lead
        and (not lead or data[:1] == b"\n")
        and (data.endswith(b"\n") or end == index.file_bytes)
        and data.find(b"\n", lead, lead + size - 1) < 0
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
