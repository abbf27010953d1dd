"""The checks of a step index against its step file (:mod:`rollfeed.loaders.step_index`).

Each failure is a :class:`StepFileError` naming the file, and the line where known:

- reading the index (planning, :func:`check_index`): its integers are in ``[0, 2**62)`` (the
  parse); ``file_bytes`` equals the step file's size; entries are in file order, at least one
  token and one byte each, never overlapping; the bytes no entry covers are blank lines, as many
  as the line numbers skip (an index that leaves samples out, empty arrays included, fails here).
  A file without blank lines, as ``write_step_file`` writes it, is checked from the index and its
  size alone; blank lines are read, only they. Each sample's loss runs are in token order,
  non-empty, inside the sample and apart (else the error names the sample and its line);
- reading a line (a worker, :func:`read_indexed_sample`): the entry is at most
  :data:`~rollfeed.loaders.step_lines.MAX_LINE_BYTES`; its bytes are exactly one line, their
  CRC-32C is the index's and the sample has the indexed token count and loss runs.

So a step file rewritten after its index was written -- to another size, to lines of other sizes,
or in place to the very same size and line sizes with other bytes -- is refused when its index is
read or when the changed line is, never read as the indexed sample.

Example (line 4 of ``step_000000.jsonl`` rewritten in place, same size)::

    read_indexed_sample(fd, index, 3, file=".../step_000000.jsonl")
    -> StepFileError: the line's bytes have CRC-32C 91..., the step index says 28...: ...
       [file=.../step_000000.jsonl, line=4]
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from rollfeed.collate import Sample
from rollfeed.collate.loss_runs import mask_runs
from rollfeed.loaders.errors import StepFileError
from rollfeed.loaders.step_lines import MAX_LINE_BYTES, line_too_long, parse_sample
from rollfeed.loaders.step_open import Pread, fd_pread, open_step
from rollfeed.payload.format.checksum import crc

if TYPE_CHECKING:
    from rollfeed.loaders.step_index import StepIndex

_REBUILD = "the file changed after its index was written; rebuild the index with build_step_index"


def check_index(
    index: StepIndex, step_file: str, where: str, *, size: int | None, pread: Pread | None
) -> None:
    """The index against the step file (see the module doc): ``size`` and ``pread`` of the step
    file version it is checked against (default: the file at ``step_file``)."""
    if pread is None or size is None:
        fd = open_step(step_file, what="step file")
        if fd is None:
            raise StepFileError("a step index without its step file", file=step_file)
        try:
            size = os.fstat(fd).st_size if size is None else size
            check_index(index, step_file, where, size=size, pread=fd_pread(fd))
        finally:
            os.close(fd)
        return
    if index.file_bytes != size:
        raise StepFileError(
            f"step index says {index.file_bytes} bytes, the step file has {size}: {_REBUILD}",
            file=step_file,
        )
    ok = len({len(getattr(index, k)) for k in ("lengths", "offsets", "sizes", "lines")}) == 1
    ok = ok and len(index.crc32c) == len(index) == len(index.runs)
    ok = ok and (index.images is None or len(index.images) == len(index))
    if ok:  # every value is in [0, 2**62) (the parse), so these sums cannot wrap
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
    at = index.runs.misplaced(index.lengths)
    if at is not None:
        raise StepFileError(
            f"step index's loss runs of sample {at} ({index.runs.of(at).tolist()}) are not "
            "[start, end) ranges in token order, non-empty, inside the sample's "
            f"{int(index.lengths[at])} tokens and apart; rebuild it with build_step_index",
            file=where,
            line=int(index.lines[at]),
        )
    at = None if index.images is None else index.images.misplaced(index.lengths)
    if at is not None:
        raise StepFileError(
            f"step index's image runs of sample {at} ({index.images.of(at).tolist()}) are not "
            "[start, end) ranges in token order, non-empty, inside the sample's "
            f"{int(index.lengths[at])} tokens and not overlapping; rebuild it with "
            "build_step_index",
            file=where,
            line=int(index.lines[at]),
        )
    tail = size - (int(ends[-1]) if len(ends) else 0)
    if tail or gaps.any():
        _check_gaps(index, step_file, gaps, blanks, tail, pread)


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
    ranged GET): reads, checks (see the module doc) and parses its line only.

    Reads one byte before the line too, to check that the bytes are exactly one line.
    """
    offset, size = int(index.offsets[i]), int(index.sizes[i])
    line_number = int(index.lines[i])
    if size > MAX_LINE_BYTES:
        raise line_too_long(size, file=file, line=line_number)
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
            f"step file: {_REBUILD}",
            file=file,
            line=line_number,
        )
    line = data[lead:]
    got = crc(line)
    if got != index.crc32c[i]:
        raise StepFileError(
            f"the line's bytes [{offset}, {end}) have CRC-32C {got}, the step index says "
            f"{int(index.crc32c[i])}: the line was rewritten (in place, or the index is stale); "
            "a written step file must not change (write the step under a new number), else "
            "rebuild the index with build_step_index",
            file=file,
            line=line_number,
        )
    sample = parse_sample(line, file=file, line_number=line_number)
    if len(sample) != index.lengths[i]:
        raise StepFileError(
            f"step index says {int(index.lengths[i])} tokens, the line's sample has {len(sample)}: "
            f"{_REBUILD}",
            file=file,
            line=line_number,
        )
    images = np.array([(im.start, im.end) for im in sample.images], np.int64).reshape(-1, 2)
    indexed = np.zeros((0, 2), np.int64) if index.images is None else index.images.of(i)
    if not np.array_equal(images, indexed):
        raise StepFileError(
            f"the line's sample {i} has image runs {images.tolist()}, the step index says "
            f"{indexed.tolist()}: the index does not describe this line's images; rebuild it "
            "with build_step_index",
            file=file,
            line=line_number,
        )
    runs = mask_runs(sample.loss_mask)
    if not np.array_equal(runs, index.runs.of(i)):
        raise StepFileError(
            f"the line's sample {i} has loss runs {runs.tolist()}, the step index says "
            f"{index.runs.of(i).tolist()}: the index does not describe this line's loss_mask; "
            "rebuild it with build_step_index",
            file=file,
            line=line_number,
        )
    return sample
