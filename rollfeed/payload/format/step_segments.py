"""A step record's payload segment records and its string table, as bytes.

Each :class:`~rollfeed.payload.PayloadSegment` of a record is one ``SEGMENT`` descriptor of 128
bytes (:mod:`rollfeed.payload.format.step_record_codec` places them): ``field``, ``file`` and
``dtype`` as ``(offset, length)`` into the record's string table, the shape's dims n (0..4),
flags (bit 0: ``ragged`` given, bit 1: ``file_id`` given), then int64 ``offset``, ``pos``,
``rows``, ``first``, ``file_id``, the ragged layout's ``rows``, ``values``, ``count_bytes``,
``block_rows`` and the shape (4 x int64); a field the flags or the dims leave unused is 0. The
string table holds each distinct string of the record once, UTF-8.

A descriptor read back is validated as :class:`~rollfeed.payload.PayloadSegment` is; a place in
the table is summed in Python integers (two ``<u4`` could wrap); what fails is a ``ValueError``
naming it.

Example (a segment of ``routed_experts`` rows ``[0, 4)`` in ``g/a.rfp`` at byte 64)::

    strings = Strings(); encode_segments([segment], strings)[0]["ndim"]  -> 2   (shape (2, 3))
    decode_segment(view_of(strings), descriptor) == segment                   -> True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import ValidationError

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.segment import PayloadSegment

_INTS = ("offset", "pos", "rows", "first", "file_id", "r_rows", "r_values", "r_count", "r_block")
SEGMENT = np.dtype(
    [
        ("field_off", "<u4"),
        ("file_off", "<u4"),
        ("dtype_off", "<u4"),
        ("field_len", "<u2"),
        ("file_len", "<u2"),
        ("dtype_len", "<u2"),
        ("ndim", "u1"),
        ("flags", "u1"),
        ("pad", "V4"),
        *[(k, "<i8") for k in _INTS],
        ("shape", "<i8", (4,)),
    ]
)
assert SEGMENT.itemsize == 128
_RAGGED, _FILE_ID = 1, 2


class Strings:
    """The record's string table: each distinct string once, as ``(offset, length)``."""

    def __init__(self) -> None:
        self.at: dict[str, tuple[int, int]] = {}
        self.parts: list[bytes] = []
        self.size = 0

    def __call__(self, text: str) -> tuple[int, int]:
        got = self.at.get(text)
        if got is None:
            data = text.encode()
            got = self.at[text] = (self.size, len(data))
            self.parts.append(data)
            self.size += len(data)
        return got


def encode_segments(segments: Sequence[PayloadSegment], strings: Strings) -> np.ndarray:
    out = np.zeros(len(segments), SEGMENT)
    for j, s in enumerate(segments):
        if not isinstance(s, PayloadSegment) or len(s.shape) > 4:
            raise PayloadInputError(f"segment {j} is not a PayloadSegment of at most 4 row dims")
        r = s.ragged
        layout = (r.rows, r.values, r.count_bytes, r.block_rows) if r else (0, 0, 0, 0)
        values = (s.offset, s.pos, s.rows, s.first, s.file_id or 0, *layout)
        if not all(-(1 << 63) <= v < 1 << 63 for v in (*values, *s.shape)):
            raise PayloadInputError(f"segment {j} holds an integer beyond int64")
        for key, text in (("field", s.field), ("file", s.file), ("dtype", s.dtype)):
            out[f"{key}_off"][j], out[f"{key}_len"][j] = strings(text)
        out["ndim"][j] = len(s.shape)
        out["flags"][j] = (_RAGGED if r else 0) | (_FILE_ID if s.file_id is not None else 0)
        for k, v in zip(_INTS, values, strict=True):
            out[k][j] = v
        out["shape"][j, : len(s.shape)] = s.shape
    return out


def text(strings: memoryview, off: int, length: int) -> str:
    off, length = int(off), int(length)  # u4 fields: their sum must not wrap
    if off + length > len(strings):
        raise ValueError(
            f"a string at [{off}, {off + length}) past the {len(strings)} string bytes"
        )
    return bytes(strings[off : off + length]).decode()


def decode_segment(strings: memoryview, s: np.void) -> PayloadSegment:
    ints = {k: int(s[k]) for k in _INTS}
    unused = [*s["shape"][int(s["ndim"]) :].tolist(), *s["pad"].tobytes()]
    if not s["flags"] & _RAGGED:
        unused += [ints[k] for k in ("r_rows", "r_values", "r_count", "r_block")]
    if not s["flags"] & _FILE_ID:
        unused.append(ints["file_id"])
    if s["ndim"] > 4 or s["flags"] > (_RAGGED | _FILE_ID) or any(unused):
        raise ValueError(
            f"a segment record of {int(s['ndim'])} dims, flags {int(s['flags'])}, or a field it "
            "does not use that is not 0"
        )
    record = {
        "field": text(strings, s["field_off"], s["field_len"]),
        "file": text(strings, s["file_off"], s["file_len"]),
        "dtype": text(strings, s["dtype_off"], s["dtype_len"]),
        **{k: ints[k] for k in ("offset", "pos", "rows", "first")},
        "shape": tuple(int(v) for v in s["shape"][: int(s["ndim"])]),
        "file_id": ints["file_id"] if s["flags"] & _FILE_ID else None,
    }
    if s["flags"] & _RAGGED:
        record["ragged"] = {
            "rows": ints["r_rows"],
            "values": ints["r_values"],
            "count_bytes": ints["r_count"],
            "block_rows": ints["r_block"],
        }
    try:
        return PayloadSegment.model_validate(record)
    except ValidationError as err:
        raise ValueError(f"a segment record that is not one: {err}") from None
