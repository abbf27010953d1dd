"""The cursor log's record frame, and a scan that tells a torn tail from damage (pure).

Each record is a 24-byte header and its payload (the record's JSON)::

    magic  b"RFC1"   4 bytes
    size   u4        payload bytes (at most MAX_RECORD)
    seq    u8        the record's number: 0, 1, 2, ... in log order
    crc    u4        CRC-32C of the payload
    hcrc   u4        CRC-32C of the 20 header bytes before it

all little-endian. A log is records back to back (a local file) or one record per object (an
object store; :mod:`rollfeed.orchestrator.cursor_log`).

**Torn tail or damage.** An append interrupted by a crash leaves a prefix of its record at the
end of the file (a machine crash may leave zeros after it): never a whole record. :func:`scan`
reads records from the start; at the first spot that is not the next whole record (short header,
bad header checksum, payload past the end, bad payload checksum, a number other than the next) it
looks for any whole record from there on: if there is one, the log was damaged in the middle (a
record changed, removed, repeated or inserted:
:class:`~rollfeed.orchestrator.errors.CursorCorruptError` naming the offset and the record's
number); if there is none, the bytes from there on are the torn tail of the last append, which is
ignored (``Scan.torn``: their count). A record is only ever lost
this way if it was never completely written, which is the record whose append the crash
interrupted.

Example: records 0 and 1 whole, then 10 bytes of record 2::

    scan(frame(0, b'{"a":1}') + frame(1, b'{}') + frame(2, b'{"b":2}')[:10])
    -> Scan(payloads=[b'{"a":1}', b'{}'], end=57, torn=10)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

from rollfeed.orchestrator.errors import CursorCorruptError

MAGIC = b"RFC1"
HEADER = struct.Struct("<4sIQII")  # magic, size, seq, payload crc, header crc
MAX_RECORD = 64 << 20  # a payload's bound (a turn's records are kilobytes)


def frame(seq: int, payload: bytes) -> bytes:
    """Record ``seq`` holding ``payload``, header and all."""
    if len(payload) > MAX_RECORD:
        raise CursorCorruptError(
            f"a cursor record of {len(payload)} bytes is over the bound of {MAX_RECORD}",
            record=seq,
        )
    head = struct.pack("<4sIQI", MAGIC, len(payload), seq, crc32c.crc32c(payload))
    return head + struct.pack("<I", crc32c.crc32c(head)) + payload


@dataclass(frozen=True, kw_only=True, slots=True)
class Scan:
    """What :func:`scan` found: the whole records' ``payloads`` in order, the offset ``end``
    where they end and the ``torn`` bytes after it (0: none)."""

    payloads: list[bytes]
    end: int
    torn: int


def _whole_at(data: bytes | memoryview, at: int) -> tuple[int, bytes] | None:
    """``(number, payload)`` of a whole record at offset ``at``, or ``None``."""
    if len(data) - at < HEADER.size:
        return None
    magic, size, seq, crc, hcrc = HEADER.unpack_from(data, at)
    head = bytes(data[at : at + HEADER.size - 4])
    if magic != MAGIC or hcrc != crc32c.crc32c(head) or size > MAX_RECORD:
        return None
    body = bytes(data[at + HEADER.size : at + HEADER.size + size])
    if len(body) != size or crc32c.crc32c(body) != crc:
        return None
    return seq, body


def _record_at(data: bytes | memoryview, at: int, seq: int) -> bytes | None:
    """The payload of a whole record numbered ``seq`` at offset ``at``, or ``None``."""
    found = _whole_at(data, at)
    return found[1] if found is not None and found[0] == seq else None


def scan(data: bytes | memoryview, *, name: str = "", first: int = 0) -> Scan:
    """The records of a log's bytes (see the module doc); ``first``: the first record's number,
    ``name``: the log's name for errors."""
    payloads: list[bytes] = []
    at = 0
    while at < len(data):
        body = _record_at(data, at, first + len(payloads))
        if body is None:
            break
        payloads.append(body)
        at += HEADER.size + len(body)
    if at < len(data):
        seq = first + len(payloads)
        raw = bytes(data)
        nxt = at if raw.startswith(MAGIC, at) else raw.find(MAGIC, at + 1)
        while nxt >= 0:
            found = _whole_at(raw, nxt)
            if found is not None:
                raise CursorCorruptError(
                    f"cursor record {seq} is missing or does not check out (header, size, "
                    f"number or checksum), and a whole record numbered {found[0]} lies at "
                    f"offset {nxt}: the log was damaged, not cut short by a crash (an "
                    "interrupted append leaves part of one record at the end); restore it from "
                    "a copy",
                    file=name,
                    offset=at,
                    record=seq,
                )
            nxt = raw.find(MAGIC, nxt + 1)
    return Scan(payloads=payloads, end=at, torn=len(data) - at)


def one_record(data: bytes, *, seq: int, name: str) -> bytes:
    """The payload of an object holding exactly record ``seq`` (the object-store form)."""
    body = _record_at(data, 0, seq)
    if body is None or HEADER.size + len(body) != len(data):
        raise CursorCorruptError(
            f"cursor object {name} is not exactly record {seq} (header, size, number or "
            "checksum): objects are put whole, so it was changed after it was written",
            file=name,
            record=seq,
        )
    return body
