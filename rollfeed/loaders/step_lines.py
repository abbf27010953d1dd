"""The lines of a step file: split, bounded, hashed and parsed as samples.

A line is the bytes up to and including its ``"\\n"`` (the last may have none); only ``"\\n"``
ends a line, as in the step index's offsets. Reading is streamed in chunks through a
``pread(n, offset)`` (a local descriptor, or a store's ranged GETs) and bounded: never past the
``size`` the file had when opened, no line above :data:`MAX_LINE_BYTES` (a sample's payload goes
by handle; the line holds records), and a NUL byte, which no JSON line holds (a sparse file's
hole, a binary file), is refused where it is found. Each sample line's content hash is its
CRC-32C, the value the step index keeps (:mod:`rollfeed.loaders.step_index`).

Example (a file ``b'{...}\\n\\n{...}\\n'`` of two samples, a blank line between)::

    list(step_lines(pread, size, file=f))  -> [(1, 0, b'{...}\\n'), (2, 40, b'\\n'), (3, 41, ...)]
    parsed = parse_step(pread, size, file=f)
    parsed.samples, parsed.lengths, parsed.crcs  -> [Sample, Sample], [3, 5], [crc1, crc2]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from rollfeed.collate import Sample
from rollfeed.collate.errors import CollateError
from rollfeed.loaders.errors import StepFileError
from rollfeed.loaders.step_open import Pread
from rollfeed.payload import PayloadError
from rollfeed.payload.format.checksum import crc

MAX_LINE_BYTES = 1 << 28  # 256 MiB: one sample's record, its payload by handle
CHUNK = 1 << 20  # bytes per read while streaming a step file


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


def line_too_long(size: int, *, file: str, line: int) -> StepFileError:
    return StepFileError(
        f"a line of {size} bytes, more than a step line may hold ({MAX_LINE_BYTES}): a sample's "
        "payload goes by handle (PayloadWriter), not inline",
        file=file,
        line=line,
    )


def step_lines(pread: Pread, size: int, *, file: str) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, offset, bytes)`` of each line of the file's first ``size`` bytes (see the
    module doc for the bounds)."""
    number, offset, at = 1, 0, 0
    parts: list[bytes] = []
    held = 0
    while at < size:
        data = pread(min(CHUNK, size - at), at)
        if not data:
            raise StepFileError(
                f"the step file ended at byte {at} of the {size} it had when opened: it shrank "
                "or was rewritten while read; a written step file must not change",
                file=file,
            )
        nul = data.find(b"\0")
        if nul >= 0:
            raise StepFileError(
                f"a NUL byte at byte {at + nul}: a step file is JSON lines, which hold none (a "
                "sparse or binary file under a step file's name)",
                file=file,
                line=number + data.count(b"\n", 0, nul),
            )
        at += len(data)
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if held + end + 1 - start > MAX_LINE_BYTES:
                raise line_too_long(held + end + 1 - start, file=file, line=number)
            line = b"".join([*parts, data[start : end + 1]])
            parts, held = [], 0
            yield number, offset, line
            number, offset, start = number + 1, offset + len(line), end + 1
        if start < len(data):
            parts.append(data[start:])
            held += len(data) - start
            if held > MAX_LINE_BYTES:
                raise line_too_long(held, file=file, line=number)
    if parts:
        yield number, offset, b"".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ParsedStep:
    """A step file parsed whole: its samples, and per sample ``lengths [n]`` (tokens) and
    ``crcs [n]`` (CRC-32C of its line), int64."""

    samples: list[Sample]
    lengths: np.ndarray
    crcs: np.ndarray


def parse_step(pread: Pread, size: int, *, file: str) -> ParsedStep:
    """Every sample of a step file's first ``size`` bytes, in line order (blank lines skipped)."""
    samples, crcs = [], []
    for number, _, line in step_lines(pread, size, file=file):
        if line.strip():
            samples.append(parse_sample(line, file=file, line_number=number))
            crcs.append(crc(line))
    lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
    return ParsedStep(samples=samples, lengths=lengths, crcs=np.asarray(crcs, np.int64))
