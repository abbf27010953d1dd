"""The reader: a trainer rank reads back only its window of a field.

``read_field(segments, field, window, root=...)`` turns the segments of one micro batch into one
tensor over the window's positions. It checks every record before touching a byte
(:mod:`rollfeed.payload.checks`) and every byte range a record claims against the real file size
before allocating anything (:mod:`rollfeed.payload.regions`), then reads one range per fixed-width
segment, one per ragged segment that spans its whole region (index and values together: the
common case), and two small ones per clipped ragged segment (its index blocks, then the window's
values), planned as NumPy columns, coalesced per file and issued concurrently
(:class:`~rollfeed.payload.root.PayloadRoot`). The region header right before each body is read in
the same batch (adjacent to the body, so in the same ``preadv``) and every record is held to it
before any byte is handed out.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollfeed.payload.checks import check_fill, common_dtype, field_segments
from rollfeed.payload.errors import (
    PayloadError,
    PayloadIndexError,
    PayloadTruncatedError,
    PayloadWidthError,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field
from rollfeed.payload.layout import (
    DTYPE_CODES,
    REGION_HEADER,
    REGION_HEADER_V1,
    VERSION,
    RowIndex,
    decode_index,
    index_table,
    values_start,
)
from rollfeed.payload.regions import (
    RecordTable,
    check_file_ids,
    check_regions,
    check_room,
)
from rollfeed.payload.root import Lease, PayloadRoot, as_root
from rollfeed.payload.segment import ITEMSIZE, PayloadSegment

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


def _overlaps(t: RecordTable, ranges: list[tuple[int, int]]):
    """Per window range: (at, lo, hi, seg [k], a [k], b [k]) where rows [a, b) of record seg fall
    inside [lo, hi) and ``at`` is the range's first output row (``t``: live records by position)."""
    at = 0
    for lo, hi in ranges:
        i0 = int(np.searchsorted(t.end, lo, side="right"))
        i1 = int(np.searchsorted(t.pos, hi, side="left"))
        seg = np.arange(i0, max(i0, i1))
        yield at, lo, hi, seg, np.maximum(t.pos[seg], lo), np.minimum(t.end[seg], hi)
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
    t = field_segments(segments, field, spec)
    if t is None:
        return None
    ranges = _ranges(window)
    n = sum(hi - lo for lo, hi in ranges)
    if width is not None and width < 1:
        raise ValueError(f"read_field width must be >= 1, got {width}")
    proot = as_root(root)
    try:
        if spec.ragged:
            out = _read_ragged(t, ranges, n, field, spec, proot, width)
        else:
            out = _read_fixed(t, ranges, n, field, spec, proot)
    except PayloadError as err:
        raise err.with_place(field=field) from None  # the I/O layer knows files, not fields
    return out if dtype is None else out.to(dtype)


def _headers(t: RecordTable, lease: Lease, key: bytes):
    """Version ``[S]``, region header size ``[S]`` and start ``[S]`` of each record's region."""
    version = lease.version[t.file_idx]
    hsize = np.where(version == VERSION, REGION_HEADER.size, REGION_HEADER_V1.size) + len(key)
    check_room(t, lease.header_size[t.file_idx], hsize)
    return version, hsize, t.offset - hsize


def _fit(
    t: RecordTable,
    lease: Lease,
    fits: Callable[[np.ndarray], np.ndarray],
    needs: Callable[[int], str],
) -> np.ndarray:
    """The records' file sizes ``[S]``, once ``fits(size)`` holds for every record; a file that
    looks too short is ``fstat``-ed again first (it may have grown since it was opened)."""
    size = lease.size[t.file_idx]
    bad = ~fits(size)
    if bad.any():
        lease.refresh(t.file_idx[bad])
        size = lease.size[t.file_idx]
        bad = ~fits(size)
        if bad.any():
            i = int(np.argmax(bad))
            raise t.fail(
                PayloadTruncatedError, i, f"{needs(i)}, but the file has {int(size[i])} bytes"
            )
    return size


def _read_fixed(t: RecordTable, ranges, n, name, spec, root) -> torch.Tensor:
    dtype, shape = common_dtype(t, name)
    check_fill(dtype, spec.fill, t.segs[0], name)
    elems, key = math.prod(shape), name.encode()
    live = t.rows > 0
    plans, read = [], []  # per stored dtype (more than one only when integer ids widen)
    for code in sorted(set(t.dtype[live].tolist())):
        idx = np.flatnonzero(live & (t.dtype == code))
        g = t if len(idx) == len(t.segs) else t.take(idx)
        plan = _plan_fixed(g, ranges, ITEMSIZE[DTYPE_CODES[code]] * elems)
        plans.append((DTYPE_CODES[code], plan))
        read.append(idx[plan.segs])
    # Only records whose bytes are read are held to their headers (a rank's window skips most);
    # when none is, the first one's header still pins the row shape of the fill.
    checked = read[0] if len(read) == 1 else np.unique(np.concatenate(read or [np.zeros(0, int)]))
    c = t if len(checked) == len(t.segs) else t.take(checked if len(checked) else np.zeros(1, int))
    row_bytes = c.itemsize * elems
    reading = len(checked) > 0

    def fits(size: np.ndarray) -> np.ndarray:
        room = size - c.offset
        return (room >= 0) & (c.first + c.rows <= room // row_bytes)

    def needs(i: int) -> str:
        s, rb = c.segs[i], int(row_bytes[i])
        end = s.offset + (s.first + s.rows) * rb
        return f"rows [{s.first}, {s.first + s.rows}) of {rb}-byte rows end at byte {end}"

    def attempt(lease: Lease) -> np.ndarray:
        check_file_ids(c, lease.file_id[c.file_idx])
        version, hsize, hstart = _headers(c, lease, key)
        size = _fit(c, lease, fits, needs)  # every record read lies inside its file
        hbuf = np.zeros((len(c.segs), REGION_HEADER.size + len(key)), np.uint8)
        dests = [hbuf]
        parts = [(c.file_idx, hstart, hsize, np.zeros(len(c.segs), np.int64), _slots(hbuf))]
        out = np.empty((n, elems), dtype) if reading else None
        for stored, plan in plans if reading else ():
            target = out if len(plans) == 1 else np.empty((n, elems), stored)
            for r0, r1 in plan.gaps:
                target[r0:r1] = spec.fill
            parts.append((plan.fi, plan.src, plan.ln, np.full(len(plan.fi), len(dests)), plan.dst))
            dests.append(target)
        fi, src, ln, di, dst = (np.concatenate(p) for p in zip(*parts, strict=True))
        lease.read(fi, src, ln, dests, di, dst)
        check_regions(
            c,
            hbuf,
            version,
            name=key,
            size=size,
            file_id=lease.file_id[c.file_idx],
            shape=shape,
            ragged=None,
        )
        if out is None:  # no record read: the shape is now the header's own
            return np.full((n, elems), spec.fill, dtype)
        if len(plans) > 1:
            covered = np.zeros(n, bool)
            for target, (_, plan) in zip(dests[1:], plans, strict=True):
                mask = np.zeros(n, bool)
                for r0, r1 in plan.written:
                    mask[r0:r1] = True
                out[mask] = target[mask]
                covered |= mask
            out[~covered] = spec.fill
        return out

    out = root.run(c.files, attempt)
    return torch.from_numpy(out.reshape(n, *shape))


def _slots(buf: np.ndarray) -> np.ndarray:
    """Byte offset of each row of a 2-D buffer: ``[len(buf)]``."""
    return np.arange(len(buf), dtype=np.int64) * buf.shape[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class _FixedPlan:
    """The reads of same-dtype live records into an ``[n, row]`` output: ``[k]`` file index,
    source offset, length and destination offset; ``segs`` the records read (sorted, unique);
    ``written`` / ``gaps`` the output row ranges they fill / that take the fill."""

    fi: np.ndarray
    src: np.ndarray
    ln: np.ndarray
    dst: np.ndarray
    segs: np.ndarray
    written: list[tuple[int, int]]
    gaps: list[tuple[int, int]]


def _plan_fixed(t: RecordTable, ranges, row_bytes: int) -> _FixedPlan:
    parts, written, gaps = [], [], []
    for at, lo, hi, seg, a, b in _overlaps(t, ranges):
        prev = np.concatenate([[lo], b[:-1]])
        gaps += zip(
            (at + prev[a > prev] - lo).tolist(), (at + a[a > prev] - lo).tolist(), strict=True
        )
        gaps.append((at + (int(b[-1]) if len(b) else lo) - lo, at + hi - lo))
        src = t.offset[seg] + (t.first[seg] + a - t.pos[seg]) * row_bytes
        parts.append((t.file_idx[seg], src, (b - a) * row_bytes, (at + a - lo) * row_bytes, seg))
        written += zip((at + a - lo).tolist(), (at + b - lo).tolist(), strict=True)
    if not parts:
        empty = np.zeros(0, np.int64)
        return _FixedPlan(
            fi=empty, src=empty, ln=empty, dst=empty, segs=empty, written=written, gaps=gaps
        )
    fi, src, ln, dst, segs = (np.concatenate(p) for p in zip(*parts, strict=True))
    if len(parts) > 1:  # one window range gives increasing records already
        segs = np.unique(segs)
    return _FixedPlan(fi=fi, src=src, ln=ln, dst=dst, segs=segs, written=written, gaps=gaps)


def _read_ragged(t: RecordTable, ranges, n, name, spec, root, width) -> torch.Tensor:
    live = t.rows > 0
    if not live.any():  # placeholders only: nothing is read, nothing they claim is used
        return torch.from_numpy(np.full((n, width or 1), spec.fill, spec.ragged_dtype))
    if not live.all():  # placeholders are not read: their files need not be opened
        t = RecordTable([s for s in t.segs if s.rows])
    if (t.count_bytes == t.count_bytes[0]).all() and (t.block_rows == t.block_rows[0]).all():
        kinds = [(int(t.count_bytes[0]), int(t.block_rows[0]))]  # the common case: one kind
    else:
        pairs = zip(t.count_bytes.tolist(), t.block_rows.tolist(), strict=True)
        kinds = sorted(set(pairs))

    def attempt(lease: Lease) -> np.ndarray:
        check_file_ids(t, lease.file_id[t.file_idx])
        decoded = []
        for cb, block in kinds:
            idx = np.flatnonzero((t.count_bytes == cb) & (t.block_rows == block))
            kind = t if len(kinds) == 1 else t.take(idx)
            decoded.append(_read_index(kind, cb, block, name, spec, lease))
        return _gather_ragged(decoded, ranges, n, name, spec, lease, width)

    return torch.from_numpy(root.run(t.files, attempt))


def _gather_ragged(decoded, ranges, n, name, spec, lease, width) -> np.ndarray:
    """Pass 2: ``[n, W]`` from the decoded indexes; values of clipped regions read now."""
    widest = max(int(d.index.counts.max()) for d in decoded)
    if width is not None and widest > width:
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
    # The window's values in window-row order, so that one scatter places them all. Values of
    # whole regions are already in memory; the others take one read per intersection.
    row_counts = np.zeros(n, np.int64)
    pieces = []
    for d in decoded:
        t, idx = d.table, d.index
        for at, lo, _, seg, a, b in _overlaps(t, ranges):
            if not len(seg):
                continue
            r0 = idx.row_base[seg] + a - t.pos[seg]
            length = b - a
            _copy_runs(row_counts, at + a - lo, idx.counts, r0, length)
            v0 = idx.starts[r0]
            v1 = idx.starts[r0 + length - 1] + idx.counts[r0 + length - 1]
            pieces.append((d, seg, at + a - lo, v0, v1 - v0))
    value_base = np.concatenate([[0], np.cumsum(row_counts)])
    values = np.empty(int(value_base[-1]), spec.ragged_dtype)
    for d, seg, first_row, v0, count in pieces:
        dst = value_base[first_row]
        held = d.held_at[seg] >= 0
        if held.any():
            src = d.held_at[seg][held] + v0[held]
            _copy_runs(values, dst[held], d.held, src, count[held])
        if not held.all():
            t, rest = d.table, seg[~held]
            src = t.offset[rest] + d.values_at[rest] + 4 * v0[~held]
            lease.read(t.file_idx[rest], src, 4 * count[~held], [values], 0, 4 * dst[~held])
    W = width if width is not None else max(1, widest)
    out = np.full((n, W), spec.fill, spec.ragged_dtype)
    if values.size:  # value k of row r lands at flat index r * W + (k - value_base[r])
        out.reshape(-1)[_spread(np.arange(0, n * W, W), row_counts)] = values
    return out


def _copy_runs(dst: np.ndarray, d0: np.ndarray, src: np.ndarray, s0: np.ndarray, n: np.ndarray):
    """``dst[d0[i] : d0[i] + n[i]] = src[s0[i] : s0[i] + n[i]]`` for every ``i`` (``[k]``
    arrays); one slice copy when the runs follow each other on both sides (a window over whole
    requests in order), else one gather and scatter."""
    if (d0[1:] == d0[:-1] + n[:-1]).all() and (s0[1:] == s0[:-1] + n[:-1]).all():
        a, b, total = int(d0[0]), int(s0[0]), int(n.sum())
        dst[a : a + total] = src[b : b + total]
    else:
        dst[_spread(d0, n)] = src[_spread(s0, n)]


def _spread(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])``: ``[sum(lengths)]``."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())


@dataclass(frozen=True, kw_only=True, slots=True)
class _Decoded:
    """The row index of one kind's records, and the values of the regions read whole."""

    table: RecordTable
    index: RowIndex
    values_at: np.ndarray  # [S] byte offset of the values inside each region body
    held_at: np.ndarray  # [S] first element of the region's values in ``held``, or -1
    held: np.ndarray  # values of the regions read whole, back to back (``ragged_dtype``)


def _read_index(t: RecordTable, cb, block, name, spec, lease: Lease) -> _Decoded:
    """Pass 1: the row index of every record (all its rows: W depends on them, not the window).

    A record that spans its whole region (the common case: one request, one region) is read in
    one go, index and values together; a clipped one reads only the index blocks covering it.
    Every region's header comes in the same batch and is checked before the index is decoded.
    """
    key = name.encode()
    version, hsize, hstart = _headers(t, lease, key)
    lay_rows, lay_values = t.lay_rows, t.lay_values

    def body(room: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = (room >= 0) & (lay_rows <= room) & (lay_values <= room // 4)  # no wrap below
        rows, values = np.where(ok, lay_rows, 0), np.where(ok, lay_values, 0)
        return ok, values_start(rows, cb, block) + 4 * values

    def fits(size: np.ndarray) -> np.ndarray:
        ok, need = body(size - t.offset)
        return ok & (need <= size - t.offset)

    def needs(i: int) -> str:
        rows, values = int(lay_rows[i]), int(lay_values[i])
        end = int(t.offset[i]) + values_start(rows, cb, block) + 4 * values
        return f"a region of {rows} rows and {values} values ends at byte {end}"

    size = _fit(t, lease, fits, needs)  # the whole region lies inside the file: bounded below
    table = index_table(
        t.first, t.first + t.rows, lay_rows, lay_values, count_bytes=cb, block_rows=block
    )
    values_at = values_start(lay_rows, cb, block)
    whole = (t.first == 0) & (t.rows == lay_rows)
    held_len = np.where(whole, lay_values, 0)
    held_at = np.where(whole, np.cumsum(held_len) - held_len, -1)
    held = np.empty(int(held_len.sum()), spec.ragged_dtype)
    hbuf = np.zeros((len(t.segs), REGION_HEADER.size + len(key)), np.uint8)
    pad = np.zeros((len(t.segs), 4), np.uint8)  # the index's padding to 4 bytes
    w = np.flatnonzero(whole)
    # A whole region: header, index (into the table), padding and values, adjacent in the
    # file, so one preadv; a clipped one: its header and the index blocks covering it.
    index_start = np.where(whole, 0, table.span_start)
    reads = [
        (t.file_idx, hstart, hsize, 0, _slots(hbuf)),
        (t.file_idx, t.offset + index_start, table.span_len, 1, table.slot),
        (t.file_idx[w], t.offset[w] + table.span_len[w], (values_at - table.span_len)[w], 2, 4 * w),
        (t.file_idx[w], t.offset[w] + values_at[w], 4 * lay_values[w], 3, 4 * held_at[w]),
    ]
    lease.read(
        *(np.concatenate([r[k] for r in reads]) for k in (0, 1, 2)),
        [hbuf, table.table, pad, held],
        np.repeat([r[3] for r in reads], [len(r[0]) for r in reads]),
        np.concatenate([r[4] for r in reads]),
    )
    check_regions(
        t,
        hbuf,
        version,
        name=key,
        size=size,
        file_id=lease.file_id[t.file_idx],
        shape=None,
        ragged=(cb, block),
    )
    try:
        index = decode_index(table)
    except PayloadIndexError as err:
        s = t.segs[err.request]
        raise err.with_place(file=s.file, field=name, offset=s.offset, pos=s.pos) from None
    return _Decoded(table=t, index=index, values_at=values_at, held_at=held_at, held=held)
