"""Reading a step record file through a root's store: one version of it, its index, its records.

:class:`StepRecordFile` opens ``rel`` through ``root.store.open_file`` (the payload's open rule: a
local file beneath the root, no symlink followed, a FIFO or directory refused at once; an object
pinned to the ETag of its first GET), so every read of one :class:`StepRecordFile` reads the same
version of the file (``stamp``), and a file replaced since is either never seen or, on an object
store, a :class:`~rollfeed.payload.errors.PayloadStaleFileError`. Reads are bounded by the size the
file had when opened; a file that shrank while read is a
:class:`~rollfeed.payload.errors.StepRecordError`.

:meth:`StepRecordFile.index` reads the footer, the file header and the index (three ranges; one
GET for a file of a few hundred KiB on an object store) and checks them
(:mod:`~rollfeed.payload.format.step_layout`); :meth:`StepRecordFile.read` reads one record's bytes
only, holds them to the index row's size and CRC-32C, and decodes them
(:mod:`~rollfeed.payload.format.step_record_codec`). Errors name the file (relative to the root),
the byte offset and the record.

Example::

    with StepRecordFile(PayloadRoot("/run/steps"), "step_000003.rfs") as f:
        index = f.index()                 # planning: tokens, runs, crc32c, ... per record
        record = f.read(index, 2)         # a worker: record 2's bytes only
"""

from __future__ import annotations

from rollfeed.payload.errors import StepRecordError
from rollfeed.payload.format.checksum import crc
from rollfeed.payload.format.step_layout import (
    FILE_HEADER,
    FOOTER,
    NO_POLICY_VERSION,
    group_hash,
    parse_file_header,
    parse_footer,
    parse_index,
)
from rollfeed.payload.format.step_record_codec import decode_record
from rollfeed.payload.root import PayloadRoot
from rollfeed.payload.step_record import StepRecord, StepRecordIndex


class StepRecordFile:
    """One version of step record file ``rel`` of ``root`` (see the module doc); raises
    :class:`~rollfeed.payload.errors.PayloadMissingFileError` when there is none and
    :class:`~rollfeed.payload.errors.PayloadPathError` for anything but a regular file."""

    def __init__(self, root: PayloadRoot, rel: str) -> None:
        self.rel, self.where = rel, root.store.where(rel)
        self._file = root.store.open_file(rel)
        self.size: int = self._file.size
        self.stamp: str = self._file.stamp

    def __enter__(self) -> StepRecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def _read(self, at: int, n: int, what: str) -> bytes:
        parts, got = [], 0
        while got < n:
            data = self._file.read(at + got, n - got)
            if not data:
                raise StepRecordError(
                    f"the file ended at byte {at + got} while {what} [{at}, {at + n}) was read: it "
                    f"shrank or was rewritten while read (it had {self.size} bytes when opened); "
                    "a written step file must not change",
                    file=self.rel,
                    offset=at + got,
                )
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    def index(self) -> StepRecordIndex:
        """The file's index, checked against the file (footer, file header, rows and runs)."""
        size = self.size
        tail = (
            self._read(size - FOOTER.size, FOOTER.size, "the footer")
            if size >= FOOTER.size
            else b""
        )
        foot = parse_footer(tail, size, file=self.rel)
        parse_file_header(self._read(0, FILE_HEADER.size, "the file header"), foot, file=self.rel)
        rows, spans, marked = parse_index(
            self._read(foot.offset, foot.size, "the index"), foot, file=self.rel
        )
        return StepRecordIndex.of_rows(rows, spans, marked)

    def read(self, index: StepRecordIndex, i: int) -> StepRecord:
        """Record ``i`` of ``index`` (this file's): its bytes, held to the row's size and CRC-32C,
        decoded."""
        offset, size = int(index.offsets[i]), int(index.sizes[i])
        if offset + size > self.size:
            raise StepRecordError(
                f"record {i} at [{offset}, {offset + size}) lies past the file's {self.size} "
                "bytes: the index is not this file's",
                file=self.rel,
                offset=offset,
                record=i,
            )
        data = self._read(offset, size, f"record {i}")
        got = crc(data)
        if got != index.crc32c[i]:
            raise StepRecordError(
                f"record {i}'s bytes have CRC-32C {got}, the index says {int(index.crc32c[i])}: "
                "the file was rewritten in place after it was written (or is not the index's); a "
                "written step file must not change: write the step under a new number",
                file=self.rel,
                offset=offset,
                record=i,
            )
        try:
            record = decode_record(data, int(index.tokens[i]), index.runs_of(i), index.marked_of(i))
        except ValueError as err:
            raise StepRecordError(
                f"record {i} is not one: {err}", file=self.rel, offset=offset, record=i
            ) from None
        if group_hash(record.group) != int(index.group[i]) & (1 << 64) - 1:
            raise StepRecordError(
                f"record {i}'s group id {record.group!r} is not the one its index row hashes",
                file=self.rel,
                offset=offset,
                record=i,
            )
        version = int(index.policy_version[i])
        return StepRecord(
            ids=record.ids,
            mask=record.mask,
            columns=record.columns,
            texts=record.texts,
            segments=record.segments,
            spans=record.spans,
            policy_version=None if version == NO_POLICY_VERSION else version,
            group=record.group,
            shared_prefix=int(index.shared[i]),
        )


def read_records(root: PayloadRoot, rel: str) -> tuple[StepRecordIndex, list[StepRecord]]:
    """The index and every record of ``rel``, in file order."""
    with StepRecordFile(root, rel) as f:
        index = f.index()
        return index, [f.read(index, i) for i in range(len(index))]
