"""Checks on segment records before any byte is read.

Every record passes one cheap predicate; only a record that fails it gets the detailed check,
whose typed error names the file, field, offset and position.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

import numpy as np

from rollfeed.payload.errors import PayloadDtypeError, PayloadError, PayloadSegmentError
from rollfeed.payload.fields import PayloadField
from rollfeed.payload.segment import FLOAT_DTYPES, INTEGER_DTYPES, STORED_DTYPES, PayloadSegment

_MAX_EXTENT = 1 << 62
_MAX_ROW = 1 << 24  # elements in one fixed-width row


def explain(seg: PayloadSegment, name: str, field: PayloadField) -> None:
    """Raise the typed error saying what is wrong with a record :func:`plausible` refused.

    Every message names file, field, offset and position. It checks the same rules as
    :func:`plausible`, one by one (a test holds the two to the same verdict on random records).
    """

    def fail(cls: type[PayloadError], msg: str) -> None:
        raise cls(msg, file=seg.file, field=name, offset=seg.offset, pos=seg.pos)

    if min(seg.rows, seg.offset, seg.pos, seg.first) < 0 or any(d < 1 for d in seg.shape):
        fail(PayloadSegmentError, "negative rows, offset or position, or a shape dimension < 1")
    if max(seg.rows, seg.offset, seg.pos, seg.first) >= _MAX_EXTENT:
        fail(PayloadSegmentError, "segment extent is beyond any file")
    if seg.shape and math.prod(seg.shape) >= _MAX_ROW:
        fail(PayloadSegmentError, f"row shape {seg.shape} exceeds {_MAX_ROW} elements")
    if seg.dtype not in STORED_DTYPES:
        fail(PayloadDtypeError, f"unknown stored dtype {seg.dtype!r}")
    if field.is_int != (seg.dtype in INTEGER_DTYPES):
        fail(
            PayloadDtypeError,
            f"stored dtype {seg.dtype} disagrees with the field's {type(field.fill).__name__} fill",
        )
    if field.ragged != (seg.ragged is not None):
        fail(
            PayloadSegmentError,
            f"field is {'ragged' if field.ragged else 'fixed-width'} but the segment is not",
        )
    if seg.ragged is not None:
        lay = seg.ragged
        if seg.dtype != ("int32" if field.is_int else "float32") or seg.shape:
            fail(
                PayloadDtypeError,
                f"ragged values are stored as {field.ragged_dtype.name}, segment says {seg.dtype}",
            )
        if lay.count_bytes not in (1, 2, 4) or lay.block_rows < 1 or lay.rows < 0 or lay.values < 0:
            fail(PayloadSegmentError, f"bad ragged layout {lay}")
        if (
            max(lay.rows, lay.values, lay.block_rows) >= _MAX_EXTENT
            or seg.first + seg.rows > lay.rows
        ):
            fail(
                PayloadSegmentError,
                f"rows [{seg.first}, {seg.first + seg.rows}) are outside the region's {lay.rows}",
            )


_by_position = operator.attrgetter("pos", "rows")


def _plausible_shape(shape: tuple[int, ...]) -> bool:
    return not shape or (min(shape) > 0 and math.prod(shape) < _MAX_ROW)


def stored_kinds(field: PayloadField) -> frozenset[str]:
    """The stored dtypes a field's segments may have."""
    if field.ragged:
        return frozenset([field.ragged_dtype.name])
    return INTEGER_DTYPES if field.is_int else FLOAT_DTYPES


def plausible(s: PayloadSegment, field: PayloadField, kinds: frozenset[str]) -> bool:
    """Whether a record is consistent, as one short-circuiting expression: the reader asks this
    of every record, so it costs a fraction of :func:`explain`, which only runs on a refusal."""
    r = s.ragged
    return (
        s.dtype in kinds
        and 0 <= s.rows < _MAX_EXTENT
        and 0 <= s.offset < _MAX_EXTENT
        and 0 <= s.pos < _MAX_EXTENT
        and 0 <= s.first < _MAX_EXTENT
        and (
            (r is None and not field.ragged and _plausible_shape(s.shape))
            or (
                r is not None
                and field.ragged
                and not s.shape
                and s.first + s.rows <= r.rows < _MAX_EXTENT
                and 0 <= r.values < _MAX_EXTENT
                and r.count_bytes in (1, 2, 4)
                and 0 < r.block_rows < _MAX_EXTENT
            )
        )
    )


def field_segments(
    segments: Sequence[PayloadSegment], name: str, field: PayloadField
) -> list[PayloadSegment]:
    """The segments of ``name``, checked and sorted by position; overlaps are refused."""
    mine = sorted((s for s in segments if s.field == name), key=_by_position)
    kinds = stored_kinds(field)
    for s in mine:
        if not plausible(s, field, kinds):
            explain(s, name, field)
            raise AssertionError(f"explain() accepted a record plausible() refused: {s}")
    real = [s for s in mine if s.rows]
    for a, b in itertools.pairwise(real):
        if b.pos < a.end:
            raise PayloadSegmentError(
                f"segments overlap at [{b.pos}, {min(a.end, b.end)}) ({a.file} and {b.file})",
                file=b.file,
                field=name,
                offset=b.offset,
                pos=b.pos,
            )
    return mine


def common_dtype(segs: list[PayloadSegment], name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """Stored dtype and row shape shared by the segments; integer ids widen losslessly."""
    dtype, shape = np.dtype(segs[0].dtype), segs[0].shape
    for s in segs[1:]:
        if s.shape != shape:
            raise PayloadDtypeError(
                f"segments disagree on row shape: {shape} vs {s.shape}",
                file=s.file,
                field=name,
                pos=s.pos,
            )
        other = np.dtype(s.dtype)
        if other != dtype:
            if (
                dtype.kind in "iu"
                and other.kind in "iu"
                and np.promote_types(dtype, other).kind in "iu"
            ):
                dtype = np.promote_types(dtype, other)
            else:
                raise PayloadDtypeError(
                    f"segments disagree on dtype: {dtype} vs {other}",
                    file=s.file,
                    field=name,
                    pos=s.pos,
                )
    return dtype, shape
