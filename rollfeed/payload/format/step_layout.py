"""Byte layout of step record files: one training step's records, written once, read by index.

A step record file holds the records of one step (one per sample: token ids, the loss mask,
per-token arrays at their own dtype, texts and payload segment records) and, at its end, the
index every rank plans from. Planning reads the footer and the index only; a reader of record
``i`` reads its bytes only, at the offset the index gives.

Format version 1, the one this library writes and reads (little endian throughout; every
section starts at a multiple of 8 bytes)::

    file header   32 bytes   <8sHHIQQ  magic b"RFSTEPS\\0", version 1, flags 0, reserved 0,
                                       file id (random, 1 <= id < 2**63), reserved 0
    record 0 .. record n-1             back to back from byte 32, each a multiple of 8 bytes
                                       (:mod:`rollfeed.payload.format.step_record_codec`)
    index         n rows of 64 bytes, then the mask runs and the marked spans of every record
    footer        48 bytes   <QQQQII8s index offset, index bytes, records n, file id,
                                       CRC-32C of the index bytes, CRC-32C of the footer's first
                                       36 bytes, magic b"RFSTEND\\0"

An index row (``INDEX_ROW``, 64 bytes ``<QQQIIIIqQQ``): the record's ``offset`` and ``size`` in
bytes, its ``tokens``, the ``crc32c`` (CRC-32C) of its bytes, its mask's ``runs`` (the maximal
ranges of mask 1 tokens), its marked ``spans`` (token ranges a planner must not cut: a sample's
image placeholder runs), 0, its ``policy_version`` (the oldest policy version among its tokens; -1:
none recorded), its ``group`` (the 64-bit hash of its group id, the first 8 bytes of BLAKE2b of
the id's UTF-8, little endian, 1 when that is 0; 0: no group) and ``shared`` (the tokens of the
prefix it shares with its group; 0 without a group). After the rows, each record's runs in record
order, each run two ``<u4`` (``start, end``): the record's mask is 1 exactly on
``[start, end)`` of each; runs are non-empty, in token order, apart and inside the record. Then
each record's marked spans, the same way (they may touch: two images back to back).

Worked example (two records of token ids ``[5, 6, 7]`` and ``[8, 9, 1, 2, 3]``, masks
``[0, 1, 1]`` and ``[1, 1, 0, 1, 1]``, no column: records of 48 and 56 bytes)::

    offset   0: file header (32 bytes)
    offset  32: record 0 (48 bytes);  offset 80: record 1 (56 bytes)
    offset 136: index = rows [(32, 48, 3, c0, 1, 0, 0, -1, 0, 0),
                              (80, 56, 5, c1, 2, 0, 0, -1, 0, 0)]
                + runs [1, 3], [0, 2], [3, 5]            -> 2 * 64 + 3 * 8 = 152 bytes
    offset 288: footer (136, 152, 2, file id, crc(index), crc(footer[:36]), b"RFSTEND\\0")
    file size 336

Why a file of its own rather than the payload's regions, with the per-token arrays as fields
read by handle (so that a ``cp`` rank would read only its window): a sample's record is read
whole in one ranged read, and a loader pass from a step file of 128 samples x 8,192 tokens
measured 1.2x the same pass over the samples in memory (``python -m rollfeed.bench steps``):
what a window read could save is at most that 0.2x, and the token ids, which every rank's
micro batch needs whole, would still be read whole. One file per step also keeps a step atomic
(one rename, one PUT) with its index inside it.

Reading checks (:func:`parse_footer`, :func:`parse_index`; each failure a
:class:`~rollfeed.payload.errors.StepRecordError` naming the file and offset): the footer's magic
and CRC-32C; the index lies between the file header and the footer, exactly; the index bytes'
CRC-32C; the file header's magic, version (another is refused naming it) and file id (the
footer's); the records lie back to back from byte 32 to the index, each a multiple of 8 bytes,
holding at least one token and at most one token per byte (its token ids are stored whole); the
runs as above; ``policy_version >= -1``; ``shared <= tokens``, and 0 without a group. An index is
at most :data:`MAX_INDEX_BYTES`: a footer claiming more is refused unread.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass

import numpy as np

from rollfeed.payload.errors import StepRecordError
from rollfeed.payload.format.checksum import crc

MAGIC = b"RFSTEPS\0"
END_MAGIC = b"RFSTEND\0"
VERSION = 1
FILE_HEADER = struct.Struct("<8sHHIQQ")
FOOTER = struct.Struct("<QQQQII8s")
INDEX_ROW = np.dtype(
    [
        ("offset", "<u8"),
        ("size", "<u8"),
        ("tokens", "<u8"),
        ("crc32c", "<u4"),
        ("runs", "<u4"),
        ("spans", "<u4"),
        ("reserved", "<u4"),
        ("policy_version", "<i8"),
        ("group", "<u8"),
        ("shared", "<u8"),
    ]
)
SPAN = np.dtype("<u4")
MAX_INDEX_BYTES = 32 << 20  # about 600,000 records of a few runs each: a footer claiming more lies
NO_POLICY_VERSION = -1
assert FILE_HEADER.size == 32 and FOOTER.size == 48 and INDEX_ROW.itemsize == 64


def new_file_id() -> int:
    """A random file id in ``[1, 2**63)``."""
    return secrets.randbits(63) or 1


def group_hash(group: str | None) -> int:
    """The index's ``group`` of a group id: 0 for none, else a 64-bit hash (never 0)."""
    if group is None:
        return 0
    value = int.from_bytes(hashlib.blake2b(group.encode(), digest_size=8).digest(), "little")
    return value or 1


def file_header(file_id: int) -> bytes:
    return FILE_HEADER.pack(MAGIC, VERSION, 0, 0, file_id, 0)


def index_bytes(rows: np.ndarray, spans: np.ndarray, marked: np.ndarray) -> bytes:
    """The index of ``rows [n]`` (``INDEX_ROW``), ``spans [R, 2]`` (every record's runs) and
    ``marked [K, 2]`` (every record's marked spans)."""
    out = rows.astype(INDEX_ROW).tobytes() + np.asarray(spans, SPAN).tobytes()
    return out + np.asarray(marked, SPAN).tobytes()


def footer(index_offset: int, index: bytes, n: int, file_id: int) -> bytes:
    head = FOOTER.pack(index_offset, len(index), n, file_id, crc(index), 0, END_MAGIC)[:36]
    return head + struct.pack("<I8s", crc(head), END_MAGIC)


@dataclass(frozen=True, kw_only=True, slots=True)
class Footer:
    """Where a file's index lies (``offset``, ``size`` bytes), its records ``n``, its file id and
    the CRC-32C its index bytes must have."""

    offset: int
    size: int
    n: int
    file_id: int
    index_crc: int


def parse_footer(data: bytes, file_size: int, *, file: str) -> Footer:
    """The footer ``data`` (the file's last :data:`FOOTER` bytes) checked against the file's size;
    see the module doc."""
    at = file_size - FOOTER.size
    if file_size < FILE_HEADER.size + FOOTER.size or len(data) != FOOTER.size:
        raise StepRecordError(
            f"a step record file of {file_size} bytes is shorter than its file header and footer "
            f"({FILE_HEADER.size + FOOTER.size} bytes): it is cut short or not a step record file",
            file=file,
            offset=0,
        )
    offset, size, n, file_id, index_crc, own_crc, magic = FOOTER.unpack(data)
    if magic != END_MAGIC or own_crc != crc(data[:36]):
        what = "magic" if magic != END_MAGIC else "CRC-32C"
        raise StepRecordError(
            f"the footer's {what} is wrong: the file is cut short, was written by another "
            "program, or its last bytes changed; write the step again",
            file=file,
            offset=at,
        )
    if size > MAX_INDEX_BYTES:
        raise StepRecordError(
            f"the footer claims an index of {size} bytes, more than an index may hold "
            f"({MAX_INDEX_BYTES}); nothing of it was read",
            file=file,
            offset=at,
        )
    if offset < FILE_HEADER.size or offset % 8 or offset + size != at:
        raise StepRecordError(
            f"the footer places the index at [{offset}, {offset + size}), which is not the bytes "
            f"between the records and the footer at {at}",
            file=file,
            offset=at,
        )
    return Footer(offset=offset, size=size, n=n, file_id=file_id, index_crc=index_crc)


def parse_file_header(data: bytes, foot: Footer, *, file: str) -> None:
    """The file header ``data`` (the first 32 bytes) against the footer."""
    magic, version, *_, file_id, _ = FILE_HEADER.unpack(data[: FILE_HEADER.size].ljust(32, b"\0"))
    if magic != MAGIC:
        raise StepRecordError(
            f"not a step record file: it begins {magic!r}, not {MAGIC!r}", file=file, offset=0
        )
    if version != VERSION:
        raise StepRecordError(
            f"step record file of format version {version}; this reader reads version {VERSION}: "
            "read it with the rollfeed that wrote it, or write the step again",
            file=file,
            offset=0,
        )
    if file_id != foot.file_id:
        raise StepRecordError(
            f"the file header's file id {file_id} is not the footer's {foot.file_id}: the file "
            "was stitched from two files",
            file=file,
            offset=0,
        )


def parse_index(
    data: bytes, foot: Footer, *, file: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows [n] INDEX_ROW, runs [R, 2], marked spans [K, 2])`` of the index bytes ``data``
    (int64 pairs), checked (see the module doc)."""
    if crc(data) != foot.index_crc:
        raise StepRecordError(
            "the index bytes' CRC-32C is not the footer's: the index changed after it was "
            "written; write the step again",
            file=file,
            offset=foot.offset,
        )
    n = foot.n
    if n * INDEX_ROW.itemsize > len(data):
        raise _bad(f"{n} rows of {INDEX_ROW.itemsize} bytes do not fit its {len(data)}", foot, file)
    rows = np.frombuffer(data, INDEX_ROW, n)
    runs, marks = (rows[k].astype(np.int64) for k in ("runs", "spans"))
    left = (len(data) - n * INDEX_ROW.itemsize) // SPAN.itemsize
    R, K = int(runs.sum()), int(marks.sum())
    if left != 2 * (R + K) or (len(data) - n * INDEX_ROW.itemsize) % SPAN.itemsize:
        why = f"its runs ({R}) and marked spans ({K}) do not fill its last {left * 4} bytes"
        raise _bad(why, foot, file)
    pairs = np.frombuffer(data, SPAN, offset=n * INDEX_ROW.itemsize).astype(np.int64)
    spans, marked = pairs[: 2 * R].reshape(-1, 2), pairs[2 * R :].reshape(-1, 2)
    _check_rows(rows, foot, file)
    _check_runs(rows, runs, spans, foot, file)
    owner = np.repeat(np.arange(n), marks)
    bad = marked_misplaced(marked, rows["tokens"].astype(np.int64), owner)
    if bad is not None:
        i = int(owner[bad])
        raise StepRecordError(
            f"record {i}'s marked spans are not [start, end) ranges in token order, non-empty, "
            f"not overlapping and inside its {int(rows['tokens'][i])} tokens",
            file=file,
            offset=foot.offset,
            record=i,
        )
    return rows, spans, marked


def _check_rows(rows: np.ndarray, foot: Footer, file: str) -> None:
    off, size, tokens = (rows[k].astype(np.uint64) for k in ("offset", "size", "tokens"))
    start = np.concatenate([[FILE_HEADER.size], (off + size)[:-1]]).astype(np.uint64)
    bad = (off != start) | (size % 8 != 0) | (size < 32) | (tokens < 1) | (tokens > size)
    bad |= (rows["policy_version"] < NO_POLICY_VERSION) | (rows["shared"] > tokens)
    bad |= ((rows["group"] == 0) & (rows["shared"] != 0)) | (rows["reserved"] != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise StepRecordError(
            f"index row {i} ({_row(rows[i])}) is not a record: records lie back to back from "
            f"byte {FILE_HEADER.size}, each a multiple of 8 bytes of 1 to size tokens, with a "
            "policy version >= -1 and a shared prefix within its tokens (none without a group)",
            file=file,
            offset=foot.offset + i * INDEX_ROW.itemsize,
            record=i,
        )
    end = int(off[-1] + size[-1]) if len(rows) else FILE_HEADER.size
    if end != foot.offset:
        raise _bad(f"its records end at {end}, not at the index", foot, file)


def _check_runs(
    rows: np.ndarray, runs: np.ndarray, spans: np.ndarray, foot: Footer, file: str
) -> None:
    owner = np.repeat(np.arange(len(rows)), runs)
    first = np.concatenate([[0], np.cumsum(runs)[:-1]]).astype(np.int64)
    starts, ends = spans[:, 0], spans[:, 1]
    prev = np.concatenate([[-1], ends[:-1]])
    prev[first[runs > 0]] = -1
    tokens = rows["tokens"].astype(np.int64)
    bad = (starts >= ends) | (ends > tokens[owner]) | (starts <= prev)
    if bad.any():
        i = int(owner[np.argmax(bad)])
        raise StepRecordError(
            f"record {i}'s mask runs {spans[first[i] : first[i] + runs[i]].tolist()} are not "
            f"[start, end) ranges in token order, non-empty, apart and inside its "
            f"{int(tokens[i])} tokens",
            file=file,
            offset=foot.offset,
            record=i,
        )


def marked_misplaced(
    spans: np.ndarray, tokens: np.ndarray | int, owner: np.ndarray | None = None
) -> int | None:
    """The first span (of ``spans [K, 2]``, each of record ``owner[k]`` of ``tokens``: an int, or
    one per record) that is empty, out of token order, overlapping the span before it in its
    record, or past its record's tokens; ``None`` when all hold. Spans may touch."""
    owner = np.zeros(len(spans), np.int64) if owner is None else owner
    limit = np.asarray(tokens, np.int64)
    limit = np.full(int(owner.max(initial=0)) + 1, int(limit)) if limit.ndim == 0 else limit
    starts, ends = spans[:, 0], spans[:, 1]
    prev = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    prev[np.concatenate([[True], owner[1:] != owner[:-1]])[: len(prev)]] = 0
    bad = (starts < 0) | (starts >= ends) | (ends > limit[owner]) | (starts < prev)
    return int(np.argmax(bad)) if bad.any() else None


def _row(row: np.void) -> str:
    return ", ".join(f"{k}={int(row[k])}" for k in ("offset", "size", "tokens", "shared"))


def _bad(why: str, foot: Footer, file: str) -> StepRecordError:
    return StepRecordError(
        f"the index does not describe the file: {why}", file=file, offset=foot.offset
    )
