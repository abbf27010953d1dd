"""Checks on segment records before any byte is read.

Every record passes one cheap predicate, vectorised over all records of a read
(:class:`RecordTable` columns); only a record that fails it gets the detailed check, whose typed
error names the file, field, offset and position. What a record claims about the bytes
(that they fit the file, that they are the region it says) is checked per read, vectorised, in
:mod:`rollfeed.payload.read.regions`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
from pydantic import ValidationError

from rollfeed.payload.errors import PayloadDtypeError, PayloadError, PayloadSegmentError
from rollfeed.payload.fields import PayloadField
from rollfeed.payload.format.layout import BLOCK_ROWS, DTYPE_CODES, DTYPE_SIZES, RAGGED_INT_DTYPES
from rollfeed.payload.segment import (
    FLOAT_DTYPES,
    INTEGER_DTYPES,
    STORED_DTYPES,
    PayloadSegment,
    RaggedLayout,
)

_MAX_EXTENT = 1 << 62
_MAX_ID = 1 << 63
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
    if seg.file_id is not None and not 0 < seg.file_id < _MAX_ID:
        fail(PayloadSegmentError, f"file id {seg.file_id} is outside [1, 2**63)")
    if seg.shape and math.prod(seg.shape) >= _MAX_ROW:
        fail(PayloadSegmentError, f"row shape {seg.shape} exceeds {_MAX_ROW} elements")
    if seg.dtype not in STORED_DTYPES | {"uint24"}:
        fail(PayloadDtypeError, f"unknown stored dtype {seg.dtype!r}")
    if field.is_int != (seg.dtype in INTEGER_DTYPES | {"uint24"}):
        fail(
            PayloadDtypeError,
            f"stored dtype {seg.dtype} disagrees with the field's {type(field.fill).__name__} fill",
        )
    if not field.ragged and seg.dtype not in stored_kinds(field):
        fail(PayloadDtypeError, f"{seg.dtype} stores ragged values only, not fixed-width rows")
    if field.ragged != (seg.ragged is not None):
        fail(
            PayloadSegmentError,
            f"field is {'ragged' if field.ragged else 'fixed-width'} but the segment is not",
        )
    if seg.ragged is not None:
        lay = seg.ragged
        if seg.dtype not in stored_kinds(field) or seg.shape:
            fail(
                PayloadDtypeError,
                f"ragged values are stored as one of {sorted(stored_kinds(field))}, segment says "
                f"{seg.dtype}",
            )
        if lay.count_bytes not in (1, 2, 4) or lay.block_rows < 1 or lay.rows < 0 or lay.values < 0:
            fail(PayloadSegmentError, f"bad ragged layout {lay}")
        if lay.block_rows > max(BLOCK_ROWS, lay.rows):
            fail(
                PayloadSegmentError,
                f"ragged block of {lay.block_rows} rows is larger than both {BLOCK_ROWS} and the "
                f"region's {lay.rows} rows (a writer never makes one)",
            )
        if (
            max(lay.rows, lay.values, lay.block_rows) >= _MAX_EXTENT
            or seg.first + seg.rows > lay.rows
        ):
            fail(
                PayloadSegmentError,
                f"rows [{seg.first}, {seg.first + seg.rows}) are outside the region's {lay.rows}",
            )


def _plausible_shape(shape: tuple[int, ...]) -> bool:
    return not shape or (min(shape) > 0 and math.prod(shape) < _MAX_ROW)


def stored_kinds(field: PayloadField) -> frozenset[str]:
    """The stored dtypes a field's segments may have."""
    if field.ragged:
        return frozenset(RAGGED_INT_DTYPES if field.is_int else ["float32"])
    return INTEGER_DTYPES if field.is_int else FLOAT_DTYPES


_COLUMNS = (
    "file_idx",
    "pos",
    "rows",
    "offset",
    "first",
    "file_id",
    "dtype",
    "itemsize",
    "has_layout",
    "lay_rows",
    "lay_values",
    "count_bytes",
    "block_rows",
    "shape_id",
)
_record = operator.attrgetter(
    "file", "pos", "rows", "offset", "first", "file_id", "dtype", "shape", "ragged"
)
_DTYPES = {name: (code, DTYPE_SIZES[name]) for code, name in enumerate(DTYPE_CODES)}


class RecordTable:
    """Records as ``[S]`` int64 columns, built in one pass so that every check and every plan of
    a read is vectorised over its records.

    ``file_idx`` indexes ``files``, ``shape_id`` indexes ``shapes`` (the distinct row shapes);
    ``dtype`` indexes ``DTYPE_CODES`` (-1: not a stored dtype), ``itemsize`` is its size;
    ``file_id`` is 0 for a record without one (-1 for an explicit 0, which is refused);
    ``has_layout``/``lay_*``/``count_bytes``/``block_rows`` describe a ragged layout (0 without).
    An integer outside int64 raises ``OverflowError`` (:func:`field_segments` explains it).
    """

    __slots__ = ("cols", "end", "files", "segs", "shapes", *_COLUMNS)

    def __init__(self, segs: list[PayloadSegment]) -> None:
        where: dict[str, int] = {}
        shapes: dict[tuple[int, ...], int] = {}
        flat: list[int] = []
        for f, pos, rows, offset, first, fid, dtype, shape, lay in map(_record, segs):
            code, itemsize = _DTYPES.get(dtype, (-1, 0))
            fid = 0 if fid is None else fid or -1
            flat += (where.setdefault(f, len(where)), pos, rows, offset, first, fid, code, itemsize)
            if lay is None:
                flat += _NO_LAYOUT
            else:
                flat += (1, lay.rows, lay.values, lay.count_bytes, lay.block_rows)
            flat.append(shapes.setdefault(shape, len(shapes)))
        # int64 columns would truncate a float (or take a bool) silently: a record made past
        # validation (model_construct) with one is checked as if parsed (field_segments)
        types = set(map(type, flat))
        for shape in shapes:
            types.update(map(type, shape))
        if types - {int}:
            raise TypeError("a record holds a value that is not an int where one belongs")
        cols = np.fromiter(flat, np.int64, len(flat)).reshape(len(segs), len(_COLUMNS)).T
        self._set(segs, list(where), list(shapes), cols)

    def _set(self, segs, files, shapes, cols) -> None:
        self.segs, self.files, self.shapes, self.cols = segs, files, shapes, cols
        for name, col in zip(_COLUMNS, cols, strict=True):
            setattr(self, name, col)
        self.end = self.pos + self.rows

    def take(self, idx: np.ndarray) -> RecordTable:
        """The records ``idx`` (``[k]`` indices), over the same ``files`` and ``shapes``."""
        out = object.__new__(RecordTable)
        out._set([self.segs[i] for i in idx.tolist()], self.files, self.shapes, self.cols[:, idx])
        return out

    def fail(self, cls: type[PayloadError], i: int, message: str) -> PayloadError:
        s = self.segs[i]
        return cls(message, file=s.file, offset=s.offset, pos=s.pos)


_NO_LAYOUT = (0, 0, 0, 0, 0)
_INT_RANGE = {name: (int(np.iinfo(name).min), int(np.iinfo(name).max)) for name in INTEGER_DTYPES}


def plausible(t: RecordTable, field: PayloadField) -> np.ndarray:
    """Whether each record is consistent (``[S]`` bool), the rules of :func:`explain` vectorised
    over all records of a read; :func:`explain` only runs on a refusal, to say why."""
    kinds = stored_kinds(field)
    ok = np.array([name in kinds for name in DTYPE_CODES] + [False])[t.dtype]
    for col in (t.rows, t.offset, t.pos, t.first):
        ok &= (col >= 0) & (col < _MAX_EXTENT)
    ok &= t.file_id >= 0
    if field.ragged:
        flat = np.array([not shape for shape in t.shapes])[t.shape_id]
        cb = (t.count_bytes == 1) | (t.count_bytes == 2) | (t.count_bytes == 4)
        ok &= (t.has_layout == 1) & flat & cb & (t.first + t.rows <= t.lay_rows)
        for col, low in ((t.lay_rows, 0), (t.lay_values, 0), (t.block_rows, 1)):
            ok &= (col >= low) & (col < _MAX_EXTENT)
        ok &= (t.block_rows <= BLOCK_ROWS) | (t.block_rows <= t.lay_rows)
    else:
        ok &= (t.has_layout == 0) & np.array([_plausible_shape(s) for s in t.shapes])[t.shape_id]
    return ok


def field_segments(
    segments: Sequence[PayloadSegment], name: str, field: PayloadField
) -> RecordTable | None:
    """The segments of ``name`` as a table sorted by position, checked; overlaps are refused.
    ``None`` when no segment carries the field."""
    mine = [s for s in segments if s.field == name]
    if not mine:
        return None
    try:
        t = RecordTable(mine)
    except (TypeError, ValueError):  # made past validation (model_construct)
        mine = [_validated(s, name) for s in mine]
        t = _table_or_none(mine)
    except OverflowError:  # some integer is beyond int64: explain() names it
        t = None
    ok = None if t is None else plausible(t, field)
    if ok is None or not ok.all():
        bad = mine if ok is None else [s for s, g in zip(mine, ok.tolist(), strict=True) if not g]
        for s in sorted(bad, key=_by_position):
            explain(s, name, field)
        raise AssertionError(f"explain() accepted a record plausible() refused: {bad}")
    order = np.lexsort((t.rows, t.pos))
    if (order[1:] < order[:-1]).any():
        t = t.take(order)
    live = np.flatnonzero(t.rows)
    clash = t.pos[live[1:]] < t.end[live[:-1]]
    if clash.any():
        k = int(np.argmax(clash))
        a, b = t.segs[live[k]], t.segs[live[k + 1]]
        raise PayloadSegmentError(
            f"segments overlap at [{b.pos}, {min(a.end, b.end)}) ({a.file} and {b.file})",
            file=b.file,
            field=name,
            offset=b.offset,
            pos=b.pos,
        )
    return t


_by_position = operator.attrgetter("pos", "rows")


def _validated(s: PayloadSegment, name: str) -> PayloadSegment:
    """``s`` validated as if parsed from JSON; a record of wrong types is a typed error."""
    data = dict(s.__dict__)
    if isinstance(s.ragged, RaggedLayout):
        data["ragged"] = dict(s.ragged.__dict__)
    try:
        return PayloadSegment.model_validate(data)
    except ValidationError as err:
        raise PayloadSegmentError(
            f"malformed payload segment record: {err}",
            file=s.file if isinstance(s.file, str) else None,
            field=name,
        ) from None


def _table_or_none(segs: list[PayloadSegment]) -> RecordTable | None:
    try:
        return RecordTable(segs)
    except OverflowError:
        return None


def common_dtype(t: RecordTable, name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """Stored dtype and row shape shared by the records; integer ids widen losslessly."""
    shape = t.shapes[int(t.shape_id[0])]
    if len(t.shapes) > 1:
        s = t.segs[int(np.argmax(t.shape_id != t.shape_id[0]))]
        raise PayloadDtypeError(
            f"segments disagree on row shape: {shape} vs {s.shape}",
            file=s.file,
            field=name,
            pos=s.pos,
        )
    codes = [int(t.dtype[0])] if (t.dtype == t.dtype[0]).all() else np.unique(t.dtype).tolist()
    dtype = np.dtype(DTYPE_CODES[codes[0]])
    for code in codes[1:]:
        other = np.dtype(DTYPE_CODES[code])
        wider = np.promote_types(dtype, other)
        if dtype.kind in "iu" and other.kind in "iu" and wider.kind in "iu":
            dtype = wider
        else:
            s = t.segs[int(np.argmax(t.dtype == code))]
            raise PayloadDtypeError(
                f"segments disagree on dtype: {dtype} vs {other}",
                file=s.file,
                field=name,
                pos=s.pos,
            )
    return dtype, shape


def check_fill(dtype: np.dtype, fill: int | float, seg: PayloadSegment, name: str) -> None:
    """An integer output dtype must hold the field's fill (uncovered positions read as it)."""
    if dtype.kind in "iu" and not _INT_RANGE[dtype.name][0] <= fill <= _INT_RANGE[dtype.name][1]:
        raise PayloadDtypeError(
            f"stored dtype {dtype} cannot hold the field's fill {fill}; write the field with a "
            "dtype that does (the writer's compact choice always does)",
            file=seg.file,
            field=name,
            offset=seg.offset,
            pos=seg.pos,
        )
