"""Segment records: small, JSON-serialisable handles to rows of a field inside a payload file.

A segment says "rows ``[pos, pos + rows)`` of ``field`` (token positions relative to the owning
sequence) are the region rows ``[first, first + rows)`` of the region whose body starts at byte
``offset`` of ``file``" (``file`` relative to the payload root). Every stage after inference moves
only these records: truncation clips them, packing shifts them, a trainer rank reads its window.

Worked example (a mask region of 6 rows written for completion tokens 4..9)::

    s = PayloadSegment(field="sampling_mask", file="step_000001/w0.rfp", offset=64,
                       pos=4, rows=6, dtype="int32", ragged=RaggedLayout(rows=6, values=11, ...))
    clip_segments([s], 0, 8)    -> pos=4, rows=4, first=0   (truncated at 8)
    clip_segments([s], 6, 20)   -> pos=6, rows=4, first=2   (head cut mid-request)
    clip_segments([s], 12, 20)  -> pos=12, rows=0           (placeholder: the field stays present)
    shift_segments([s], 100)    -> pos=104                  (packed at micro-batch offset 100)

Clipping a ragged segment only moves ``first``/``rows``: it needs neither row widths nor I/O.

A record is validated however it is made: parsed, constructed, or copied with
``model_copy(update=...)`` (which pydantic itself does not check), so ``pos=1.5`` or
``rows=True`` is a :class:`PayloadSegmentError` at once and never reaches a reader.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from rollfeed.payload.errors import PayloadSegmentError

# Stored dtype name -> itemsize; the integer ones are the kinds an int fill accepts.
ITEMSIZE = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "int64": 8}
INTEGER_DTYPES = frozenset(ITEMSIZE)
FLOAT_DTYPES = frozenset(["float16", "float32", "float64"])
ITEMSIZE.update(float16=2, float32=4, float64=8)
STORED_DTYPES = frozenset(ITEMSIZE)


class _Record(BaseModel):
    """A frozen record whose copies are validated like the record itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update`` applied, validated as a new record (pydantic's own copy
        checks nothing): a value of the wrong type is a :class:`PayloadSegmentError`."""
        if not update:
            return super().model_copy(deep=deep)
        try:
            return self.model_validate({**self.__dict__, **update})
        except ValidationError as err:
            raise PayloadSegmentError(f"malformed payload segment record: {err}") from None


class RaggedLayout(_Record):
    """Where a CSR region keeps its row index; see :mod:`rollfeed.payload.format.layout`."""

    rows: StrictInt  # rows in the whole region (not only this segment)
    values: StrictInt  # values in the whole region
    count_bytes: StrictInt  # width of one stored row length: 1, 2 or 4
    block_rows: StrictInt  # rows per index block (one absolute value offset per block)


class PayloadSegment(_Record):
    """A handle to ``rows`` consecutive token rows of one field. Frozen; JSON round-trips.

    Integers are strict (JSON ``true`` or ``1.0`` is not an offset). ``file_id`` is the id of the
    file the record was written into (format versions 2 and 3); ``None`` only in records of
    version-1 files (a reader refuses a record without one for a file that has one).
    """

    field: str
    file: str
    offset: StrictInt
    pos: StrictInt
    rows: StrictInt
    dtype: str
    shape: tuple[StrictInt, ...] = ()
    first: StrictInt = 0
    ragged: RaggedLayout | None = None
    file_id: StrictInt | None = None

    @property
    def end(self) -> int:
        return self.pos + self.rows

    @property
    def row_bytes(self) -> int:
        """Bytes of one fixed-width row (``prod(shape) * itemsize``)."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @classmethod
    def from_json(cls, text: str | bytes) -> PayloadSegment:
        """Parse one record; a malformed record is a :class:`PayloadSegmentError`."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            raise PayloadSegmentError(f"malformed payload segment record: {err}") from None


def clip_segments(segments: Iterable[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    """Keep only rows at positions ``[lo, hi)``; pure metadata, no I/O.

    A segment clipped to nothing stays as a zero-row placeholder with ``pos`` clamped into
    ``[lo, hi]``, so the field is still known to be present.
    """
    lo, hi = _position(lo, "clip_segments lo"), _position(hi, "clip_segments hi")
    if hi < lo:
        raise PayloadSegmentError(f"clip_segments needs lo <= hi, got lo={lo}, hi={hi}")
    out = []
    for s in segments:
        a, b = max(s.pos, lo), min(s.end, hi)
        if b <= a:
            out.append(s.model_copy(update={"pos": min(max(s.pos, lo), hi), "rows": 0}))
        elif a == s.pos and b == s.end:
            out.append(s)
        else:
            out.append(s.model_copy(update={"pos": a, "rows": b - a, "first": s.first + a - s.pos}))
    return out


def shift_segments(segments: Iterable[PayloadSegment], delta: int) -> list[PayloadSegment]:
    """Move every segment by ``delta`` token positions (e.g. to micro-batch coordinates)."""
    delta = _position(delta, "shift_segments delta")
    return [s if delta == 0 else s.model_copy(update={"pos": s.pos + delta}) for s in segments]


def _position(value: object, what: str) -> int:
    """``value`` as an ``int`` when it is an integer (a NumPy one too), else a typed error: a
    float or a bool would make records of non-integer positions."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        pass
    raise PayloadSegmentError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
