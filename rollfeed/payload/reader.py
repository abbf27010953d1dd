"""The reader: a trainer rank reads back only its window of a field.

``read_field(segments, field, window, root=...)`` turns the segments of one micro batch into one
tensor over the window's positions. It checks every record before touching a byte, reads with at
most two small reads per ragged segment (row index, then the window's values) and one per fixed
segment, coalesced per file and issued concurrently (:class:`~rollfeed.payload.root.PayloadRoot`).

Worked example (routing ids, rows ``[T, 2]``; a segment covers positions 2..5)::

    read_field(segs, "routed_experts", (0, 4), root=r)       -> uint8 [4, 2]:
        [[0, 0], [0, 0], [a2, b2], [a3, b3]]                  (positions 0, 1 read as fill 0)
    read_field(segs, "routed_experts", [(0, 1), (4, 6)], root=r) -> rows of positions 0, 4, 5

Ragged fields come back as ``[n, W]`` padded with the fill, where ``W = max(1, widest row among
all rows of the given segments)`` (not only the window), so every CP rank passing the same
micro batch's segments gets the same ``W``; or ``width`` for static shapes.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from rollfeed.payload.errors import (
    PayloadDtypeError,
    PayloadError,
    PayloadSegmentError,
    PayloadWidthError,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.layout import decode_index, index_span, values_start
from rollfeed.payload.root import PayloadRoot, ReadOp, as_root
from rollfeed.payload.segment import STORED_DTYPES, PayloadSegment

Window = tuple[int, int] | Sequence[tuple[int, int]]
_MAX_EXTENT = 1 << 62


def _ranges(window: Window) -> list[tuple[int, int]]:
    ranges = (
        [window]
        if len(window) == 2 and all(isinstance(x, int | np.integer) for x in window)
        else window
    )
    out = [(int(lo), int(hi)) for lo, hi in ranges]  # type: ignore[misc]
    for lo, hi in out:
        if lo < 0 or hi < lo:
            raise ValueError(f"read_field window ranges need 0 <= lo <= hi, got ({lo}, {hi})")
    return out


def _check(seg: PayloadSegment, name: str, field: PayloadField) -> None:
    """Refuse an inconsistent record before any I/O (every message names file, field, position)."""

    def fail(cls: type[PayloadError], msg: str) -> None:
        raise cls(msg, file=seg.file, field=name, offset=seg.offset, pos=seg.pos)

    if min(seg.rows, seg.offset, seg.pos, seg.first) < 0 or any(d < 0 for d in seg.shape):
        fail(PayloadSegmentError, "negative rows, offset, position or shape in segment")
    if max(seg.rows, seg.offset, seg.pos, seg.first, *seg.shape, 0) >= _MAX_EXTENT:
        fail(PayloadSegmentError, "segment extent is beyond any file")
    if seg.dtype not in STORED_DTYPES:
        fail(PayloadDtypeError, f"unknown stored dtype {seg.dtype!r}")
    if field.is_int != (np.dtype(seg.dtype).kind in "iu"):
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
        if seg.dtype != field.ragged_dtype.name or seg.shape:
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


def _field_segments(
    segments: Sequence[PayloadSegment], name: str, field: PayloadField
) -> list[PayloadSegment]:
    mine = sorted((s for s in segments if s.field == name), key=lambda s: (s.pos, s.rows))
    for s in mine:
        _check(s, name, field)
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


def _common_dtype(segs: list[PayloadSegment], name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """Stored dtype and row shape shared by the segments; integer ids widen losslessly."""
    dtype, shape = np.dtype(segs[0].dtype), segs[0].shape
    for s in segs[1:]:
        other = np.dtype(s.dtype)
        if s.shape != shape:
            raise PayloadDtypeError(
                f"segments disagree on row shape: {shape} vs {s.shape}",
                file=s.file,
                field=name,
                pos=s.pos,
            )
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


def _overlaps(segs: list[PayloadSegment], starts: list[int], lo: int, hi: int):
    """(segment, a, b) for each segment row range [a, b) inside [lo, hi), in position order."""
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    for s in segs[i:]:
        if s.pos >= hi:
            break
        a, b = max(s.pos, lo), min(s.end, hi)
        if a < b:
            yield s, a, b


def read_field(
    segments: Sequence[PayloadSegment],
    field: str,
    window: Window,
    *,
    root: PayloadRoot | str | os.PathLike[str],
    width: int | None = None,
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Read ``field`` over ``window`` from ``segments``.

    window: ``(lo, hi)`` or a list of ``(lo, hi)`` ranges, read in order (n = total length).
    Returns fixed width ``[n, *shape]`` at the stored dtype (or ``dtype``); ragged ``[n, W]`` int32
    / float32 padded with fill; ``None`` when no segment carries the field.
    """
    spec = lookup_field(field, fields)
    segs = _field_segments(segments, field, spec)
    if not segs:
        return None
    ranges = _ranges(window)
    n = sum(hi - lo for lo, hi in ranges)
    live = [s for s in segs if s.rows]
    starts = [s.pos for s in live]
    proot = as_root(root)
    if spec.ragged:
        out = _read_ragged(live, starts, ranges, n, field, spec, proot, width)
    else:
        out = _read_fixed(segs, live, starts, ranges, n, field, spec, proot)
    return out if dtype is None else out.to(dtype)


def _read_fixed(segs, live, starts, ranges, n, name, spec, root) -> torch.Tensor:
    dtype, shape = _common_dtype(segs, name)
    widen = any(np.dtype(s.dtype) != dtype for s in live)
    out = torch.from_numpy(np.empty((n, *shape), dtype=dtype))
    flat = out.numpy().reshape(n, math.prod(shape))
    ops, widened, gaps, at = [], [], [], 0
    for lo, hi in ranges:
        cursor = lo
        for s, a, b in _overlaps(live, starts, lo, hi):
            if a > cursor:
                gaps.append((at + cursor - lo, at + a - lo))
            rb, dst = s.row_bytes, flat[at + a - lo : at + b - lo]
            src = s.offset + (s.first + a - s.pos) * rb
            if np.dtype(s.dtype) == dtype:
                ops.append(ReadOp(s.file, src, memoryview(dst).cast("B")))
            else:  # a narrower integer segment: read it as stored, widen after
                tmp = np.empty((b - a, *shape), np.dtype(s.dtype))
                ops.append(ReadOp(s.file, src, memoryview(tmp).cast("B")))
                widened.append((dst, tmp))
            cursor = b
        if cursor < hi:
            gaps.append((at + cursor - lo, at + hi - lo))
        at += hi - lo
    for g0, g1 in gaps:
        flat[g0:g1] = spec.fill
    _read(root, ops, name)
    for dst, tmp in widened if widen else ():
        dst[...] = tmp.reshape(len(tmp), math.prod(shape))
    return out


def _read(root: PayloadRoot, ops: list[ReadOp], name: str) -> None:
    try:
        root.read(ops)
    except PayloadError as err:
        raise err.with_place(field=name) from None  # the I/O layer knows files, not fields


def _read_ragged(live, starts, ranges, n, name, spec, root, width) -> torch.Tensor:
    # Pass 1: the row index of every segment (all its rows: W depends on them, not on the window).
    spans, bufs = [], []
    for s in live:
        lay = s.ragged
        b0, b1 = index_span(
            s.first,
            s.first + s.rows,
            rows=lay.rows,
            count_bytes=lay.count_bytes,
            block_rows=lay.block_rows,
        )
        buf = np.empty(b1 - b0, np.uint8)
        spans.append(ReadOp(s.file, s.offset + b0, memoryview(buf)))
        bufs.append(buf)
    _read(root, spans, name)
    index = {}
    for s, buf in zip(live, bufs, strict=True):
        lay = s.ragged
        try:
            index[id(s)] = decode_index(
                buf,
                s.first,
                s.first + s.rows,
                rows=lay.rows,
                values=lay.values,
                count_bytes=lay.count_bytes,
                block_rows=lay.block_rows,
            )
        except PayloadError as err:
            raise err.with_place(file=s.file, field=name, offset=s.offset, pos=s.pos) from None
    widest, wide_seg = 0, None
    for s in live:
        c = index[id(s)].counts
        if c.size and int(c.max()) > widest:
            widest, wide_seg = int(c.max()), s
    if width is not None:
        if width < 1:
            raise ValueError(f"read_field width must be >= 1, got {width}")
        if widest > width:
            row = int(np.argmax(index[id(wide_seg)].counts))
            raise PayloadWidthError(
                f"a row holds {widest} values, wider than width={width}; raise width or pass None",
                file=wide_seg.file,
                field=name,
                offset=wide_seg.offset,
                pos=wide_seg.pos + row,
            )
    W = width if width is not None else max(1, widest)
    # Pass 2: the window's values, one read per (segment, range) intersection, in window order.
    row_counts = np.zeros(n, np.int64)
    pieces = []  # (segment, value start, value count)
    at = 0
    for lo, hi in ranges:
        for s, a, b in _overlaps(live, starts, lo, hi):
            idx = index[id(s)]
            c = idx.counts[a - s.pos : b - s.pos]
            row_counts[at + a - lo : at + b - lo] = c
            pieces.append((s, int(idx.starts[a - s.pos]), int(c.sum())))
        at += hi - lo
    total = int(row_counts.sum())
    values = np.empty(total, spec.ragged_dtype)
    raw = memoryview(values).cast("B")
    ops, v = [], 0
    for s, start, count in pieces:
        if count:
            vs = values_start(s.ragged.rows, s.ragged.count_bytes, s.ragged.block_rows)
            ops.append(ReadOp(s.file, s.offset + vs + 4 * start, raw[4 * v : 4 * (v + count)]))
            v += count
    _read(root, ops, name)
    out = np.full((n, W), spec.fill, spec.ragged_dtype)
    if total:
        rows = np.repeat(np.arange(n), row_counts)
        row_start = np.cumsum(row_counts) - row_counts
        cols = np.arange(total) - np.repeat(row_start, row_counts)
        out[rows, cols] = values
    return torch.from_numpy(out)
