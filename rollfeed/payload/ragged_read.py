"""Reading a ragged (CSR) field: the row index of every record, then the window's values.

Pass 1 reads each record's index (all its rows: the width ``W`` depends on them, not only on the
window) together with its region header; a record spanning its whole region (the common case)
reads header, index, padding and values in one ``preadv`` with no copy. Pass 2 places the
window's values into ``[n, W]``, reading values of clipped regions now.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollfeed.payload.checks import RecordTable
from rollfeed.payload.errors import PayloadIndexError, PayloadWidthError
from rollfeed.payload.layout import REGION_HEADER, RowIndex, decode_index, index_table, values_start
from rollfeed.payload.lease import Lease
from rollfeed.payload.read_plan import fit, header_ranges, overlaps, slots, spread
from rollfeed.payload.regions import check_file_ids, check_regions


def read_ragged(t: RecordTable, ranges, n, name, spec, root, width) -> torch.Tensor:
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
        for at, lo, _, seg, a, b in overlaps(t, ranges):
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
        out.reshape(-1)[spread(np.arange(0, n * W, W), row_counts)] = values
    return out


def _copy_runs(dst: np.ndarray, d0: np.ndarray, src: np.ndarray, s0: np.ndarray, n: np.ndarray):
    """``dst[d0[i] : d0[i] + n[i]] = src[s0[i] : s0[i] + n[i]]`` for every ``i`` (``[k]``
    arrays); one slice copy when the runs follow each other on both sides (a window over whole
    requests in order), else one gather and scatter."""
    if (d0[1:] == d0[:-1] + n[:-1]).all() and (s0[1:] == s0[:-1] + n[:-1]).all():
        a, b, total = int(d0[0]), int(s0[0]), int(n.sum())
        dst[a : a + total] = src[b : b + total]
    else:
        dst[spread(d0, n)] = src[spread(s0, n)]


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
    version, hsize, hstart = header_ranges(t, lease, key)
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

    size = fit(t, lease, fits, needs)  # the whole region lies inside the file: bounded below
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
        (t.file_idx, hstart, hsize, 0, slots(hbuf)),
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
