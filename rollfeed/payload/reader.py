"""The reader: a trainer rank reads back only its window of a field.

``read_field(segments, field, window, root=...)`` turns the segments of one micro batch into one
tensor over the window's positions. It checks every record before touching a byte
(:mod:`rollfeed.payload.checks`), then reads one range per fixed-width segment, one per ragged
segment that spans its whole region (index and values together: the common case), and two small
ones per clipped ragged segment (its index blocks, then the window's values), planned as NumPy
columns, coalesced per file and issued concurrently (:class:`~rollfeed.payload.root.PayloadRoot`).

Worked example (routing ids, rows ``[T, 2]``; a segment covers positions 2..5)::

    read_field(segs, "routed_experts", (0, 4), root=r)       -> uint8 [4, 2]:
        [[0, 0], [0, 0], [a2, b2], [a3, b3]]                  (positions 0, 1 read as fill 0)
    read_field(segs, "routed_experts", [(0, 1), (4, 6)], root=r) -> rows of positions 0, 4, 5

Ragged fields come back as ``[n, W]`` padded with the fill, where ``W = max(1, widest row among
all rows of the given segments)`` (not only the window), so every CP rank passing the same
micro batch's segments gets the same ``W``; or ``width`` for static shapes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollfeed.payload.checks import common_dtype, field_segments
from rollfeed.payload.errors import (
    PayloadError,
    PayloadIndexError,
    PayloadWidthError,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.layout import RowIndex, decode_index, index_table, values_start
from rollfeed.payload.root import PayloadRoot, as_root
from rollfeed.payload.segment import (
    PayloadSegment,
)

Window = tuple[int, int] | Sequence[tuple[int, int]]


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


class _Table:
    """The live (non-empty) segments of one field as ``[S]`` int64 columns, sorted by position."""

    def __init__(self, segs: list[PayloadSegment]) -> None:
        self.segs = segs
        self.files = list(dict.fromkeys(s.file for s in segs))
        where = {f: i for i, f in enumerate(self.files)}
        self.file_idx = np.fromiter((where[s.file] for s in segs), np.int64, len(segs))
        self.pos = np.fromiter((s.pos for s in segs), np.int64, len(segs))
        self.rows = np.fromiter((s.rows for s in segs), np.int64, len(segs))
        self.offset = np.fromiter((s.offset for s in segs), np.int64, len(segs))
        self.first = np.fromiter((s.first for s in segs), np.int64, len(segs))
        self.end = self.pos + self.rows

    def overlaps(self, ranges: list[tuple[int, int]]):
        """Per window range: (at, lo, hi, seg [k], a [k], b [k]) where rows [a, b) of segment
        seg fall inside [lo, hi) and ``at`` is the range's first output row."""
        at = 0
        for lo, hi in ranges:
            i0 = int(np.searchsorted(self.end, lo, side="right"))
            i1 = int(np.searchsorted(self.pos, hi, side="left"))
            seg = np.arange(i0, max(i0, i1))
            yield at, lo, hi, seg, np.maximum(self.pos[seg], lo), np.minimum(self.end[seg], hi)
            at += hi - lo


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
    segs = field_segments(segments, field, spec)
    if not segs:
        return None
    ranges = _ranges(window)
    n = sum(hi - lo for lo, hi in ranges)
    live = [s for s in segs if s.rows]
    proot = as_root(root)
    try:
        if spec.ragged:
            out = _read_ragged(live, ranges, n, field, spec, proot, width)
        else:
            out = _read_fixed(segs, live, ranges, n, field, spec, proot)
    except PayloadError as err:
        raise err.with_place(field=field) from None  # the I/O layer knows files, not fields
    return out if dtype is None else out.to(dtype)


def _read_fixed(segs, live, ranges, n, name, spec, root) -> torch.Tensor:
    dtype, shape = common_dtype(segs, name)
    out = np.empty((n, math.prod(shape)), dtype)
    groups = {}  # stored dtype -> its segments; more than one only when integer ids widen
    for s in live:
        groups.setdefault(s.dtype, []).append(s)
    covered = np.zeros(n, bool) if len(groups) > 1 else None
    if not groups:
        out[:] = spec.fill
    for stored, members in groups.items():
        target = out if covered is None else np.empty((n, out.shape[1]), stored)
        rows_written = _read_fixed_group(members, ranges, target, spec.fill, root)
        if covered is not None:
            mask = np.zeros(n, bool)
            for r0, r1 in rows_written:
                mask[r0:r1] = True
            out[mask] = target[mask]
            covered |= mask
    if covered is not None:
        out[~covered] = spec.fill
    return torch.from_numpy(out.reshape(n, *shape))


def _read_fixed_group(segs, ranges, out: np.ndarray, fill, root) -> list[tuple[int, int]]:
    """Read same-dtype segments into ``out`` ``[n, row]``; fill the gaps; return written rows."""
    t = _Table(segs)
    row_bytes = np.int64(out.shape[1] * out.itemsize)
    parts, written = [], []
    for at, lo, hi, seg, a, b in t.overlaps(ranges):
        prev = np.concatenate([[lo], b[:-1]])
        for g0, g1 in zip((prev[a > prev]).tolist(), (a[a > prev]).tolist(), strict=True):
            out[at + g0 - lo : at + g1 - lo] = fill
        tail = int(b[-1]) if len(b) else lo
        out[at + tail - lo : at + hi - lo] = fill
        src = t.offset[seg] + (t.first[seg] + a - t.pos[seg]) * row_bytes
        parts.append((t.file_idx[seg], src, (b - a) * row_bytes, (at + a - lo) * row_bytes))
        written += zip((at + a - lo).tolist(), (at + b - lo).tolist(), strict=True)
    if parts:
        fi, src, ln, dst = (np.concatenate(c) for c in zip(*parts, strict=True))
        root.read_into(t.files, fi, src, ln, out, dst)
    return written


def _read_ragged(live, ranges, n, name, spec, root, width) -> torch.Tensor:
    kinds: dict[tuple[int, int], list[PayloadSegment]] = {}
    for s in live:
        kinds.setdefault((s.ragged.count_bytes, s.ragged.block_rows), []).append(s)
    decoded = [_read_index(segs, cb, block, name, root) for (cb, block), segs in kinds.items()]
    widest = max((int(d.index.counts.max()) for d in decoded), default=0)
    if width is not None:
        if width < 1:
            raise ValueError(f"read_field width must be >= 1, got {width}")
        if widest > width:
            d = next(d for d in decoded if int(d.index.counts.max()) == widest)
            row = int(np.argmax(d.index.counts))
            i = int(np.searchsorted(d.index.row_base, row, side="right") - 1)
            s = d.table.segs[i]
            raise PayloadWidthError(
                f"a row holds {widest} values, wider than width={width}; raise width or pass None",
                file=s.file,
                field=name,
                offset=s.offset,
                pos=s.pos + row - int(d.index.row_base[i]),
            )
    # Pass 2: the window's values in window-row order, so that one scatter places them all.
    # Values of whole regions are already in memory; the others take one read per intersection.
    row_counts = np.zeros(n, np.int64)
    pieces = []
    for d in decoded:
        t, idx = d.table, d.index
        for at, lo, _, seg, a, b in t.overlaps(ranges):
            if not len(seg):
                continue
            r0 = idx.row_base[seg] + a - t.pos[seg]
            length = b - a
            row_counts[_spread(at + a - lo, length)] = idx.counts[_spread(r0, length)]
            v0 = idx.starts[r0]
            v1 = idx.starts[r0 + length - 1] + idx.counts[r0 + length - 1]
            pieces.append((d, seg, at + a - lo, v0, v1 - v0))
    value_base = np.concatenate([[0], np.cumsum(row_counts)])
    values = np.empty(int(value_base[-1]), spec.ragged_dtype)
    for d, seg, first_row, v0, count in pieces:
        dst = value_base[first_row]
        held = d.body_at[seg] >= 0
        if held.any():
            src = (d.body_at[seg] + d.values_at[seg])[held] // 4 + v0[held]
            values[_spread(dst[held], count[held])] = d.bodies[_spread(src, count[held])]
        if not held.all():
            t, rest = d.table, seg[~held]
            src = t.offset[rest] + d.values_at[rest] + 4 * v0[~held]
            root.read_into(t.files, t.file_idx[rest], src, 4 * count[~held], values, 4 * dst[~held])
    W = width if width is not None else max(1, widest)
    out = np.full((n, W), spec.fill, spec.ragged_dtype)
    if values.size:  # value k of row r lands at flat index r * W + (k - value_base[r])
        out.reshape(-1)[_spread(np.arange(0, n * W, W), row_counts)] = values
    return torch.from_numpy(out)


def _spread(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])``: ``[sum(lengths)]``."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())


@dataclass(frozen=True, kw_only=True, slots=True)
class _Decoded:
    """The row index of one kind's segments, and the region bodies read whole."""

    table: _Table
    index: RowIndex
    values_at: np.ndarray  # [S] byte offset of the values inside each region body
    body_at: np.ndarray  # [S] byte offset of the body in ``bodies``, or -1 (not read whole)
    bodies: np.ndarray  # values of whole regions as ``ragged_dtype`` elements, bodies back to back


def _read_index(segs, cb, block, name, root) -> _Decoded:
    """Pass 1: the row index of every segment (all its rows: W depends on them, not the window).

    A segment that spans its whole region (the common case: one request, one region) is read in
    one go, index and values together; a clipped one reads only the index blocks covering it.
    """
    t = _Table(segs)
    lay_rows = np.fromiter((s.ragged.rows for s in segs), np.int64, len(segs))
    lay_values = np.fromiter((s.ragged.values for s in segs), np.int64, len(segs))
    table = index_table(
        t.first, t.first + t.rows, lay_rows, lay_values, count_bytes=cb, block_rows=block
    )
    values_at = values_start(lay_rows, cb, block)
    whole = (t.first == 0) & (t.rows == lay_rows)
    body_len = np.where(whole, values_at + 4 * lay_values, 0)  # multiples of 4: values stay aligned
    body_at = np.where(whole, np.cumsum(body_len) - body_len, -1)
    bodies = np.empty(int(body_len.sum()) // 4, segs[0].dtype)
    root.read_into(
        t.files, t.file_idx[whole], t.offset[whole], body_len[whole], bodies, body_at[whole]
    )
    part = ~whole
    root.read_into(
        t.files,
        t.file_idx[part],
        t.offset[part] + table.span_start[part],
        table.span_len[part],
        table.table,
        table.slot[part],
    )
    if whole.any():  # whole bodies hold their index blocks at offset 0
        size = table.span_len[whole]
        table.table[_spread(table.slot[whole], size)] = bodies.view(np.uint8)[
            _spread(body_at[whole], size)
        ]
    try:
        index = decode_index(table)
    except PayloadIndexError as err:
        s = segs[err.request]
        raise err.with_place(file=s.file, field=name, offset=s.offset, pos=s.pos) from None
    return _Decoded(table=t, index=index, values_at=values_at, body_at=body_at, bodies=bodies)
