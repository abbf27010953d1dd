"""Where a step file's parts lie, and how tests rewrite them: a record in place, the index, the
footer (:mod:`rollfeed.payload.format.step_layout`)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import numpy as np

from rollfeed.payload import PayloadRoot, StepRecordFile, StepRecordIndex
from rollfeed.payload.format.step_layout import FOOTER, INDEX_ROW


def index_of(path: Path) -> StepRecordIndex:
    with StepRecordFile(PayloadRoot(path.parent), path.name) as f:
        return f.index()


def record_span(path: Path, i: int) -> tuple[int, int]:
    """``(offset, size)`` of record ``i`` of the step file ``path``."""
    index = index_of(path)
    return int(index.offsets[i]), int(index.sizes[i])


def write_at(path: Path, offset: int, data: bytes) -> None:
    """``data`` over the bytes of ``path`` at ``offset`` (the same inode, the same size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: Path, offset: int) -> None:
    """The byte of ``path`` at ``offset`` with every bit flipped, in place."""
    with open(path, "r+b") as f:
        byte = os.pread(f.fileno(), 1, offset)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0xFF]), offset)


def footer_fields(path: Path) -> tuple:
    """``(index offset, index bytes, records, file id, index crc, own crc, magic)``."""
    data = path.read_bytes()[-FOOTER.size :]
    return FOOTER.unpack(data)


def rewrite_index(path: Path, index: bytes, n: int | None = None) -> None:
    """The index bytes of ``path`` replaced by ``index`` (of ``n`` records, default as many as
    before), the footer made to match it (its size and CRC-32C): only the index's own checks
    stand between it and a reader."""
    offset, _, records, file_id, _, _, magic = footer_fields(path)
    n = records if n is None else n
    head = struct.pack("<QQQQI", offset, len(index), n, file_id, crc32c.crc32c(index))
    body = path.read_bytes()[:offset]
    path.write_bytes(body + index + head + struct.pack("<I8s", crc32c.crc32c(head), magic))


def index_with_runs(path: Path, counts: list[int], spans: list[int]) -> bytes:
    """The index of ``path`` with each record's run count ``counts`` and the runs ``spans``
    (flat, each wrapped to ``<u4`` as the bytes would hold it)."""
    n = footer_fields(path)[2]
    rows = np.frombuffer(index_bytes(path), INDEX_ROW, n).copy()
    rows["runs"] = np.asarray([c & 0xFFFFFFFF for c in counts], np.uint64).astype("<u4")
    return (
        rows.tobytes()
        + np.asarray([v & 0xFFFFFFFF for v in spans], np.uint64).astype("<u4").tobytes()
    )


def index_bytes(path: Path) -> bytes:
    offset, size, *_ = footer_fields(path)
    with open(path, "rb") as f:
        return os.pread(f.fileno(), size, offset)


def reseal(path: Path) -> None:
    """Every record's CRC-32C in the index, the index's in the footer and the footer's own made
    to match the bytes (records changed in place): only the structural checks stand."""
    data = path.read_bytes()
    n = footer_fields(path)[2]
    rows = np.frombuffer(index_bytes(path), INDEX_ROW, n).copy()
    for row in rows:
        start, size = int(row["offset"]), int(row["size"])
        row["crc32c"] = crc32c.crc32c(data[start : start + size])
    rewrite_index(path, rows.tobytes() + index_bytes(path)[rows.nbytes :])
