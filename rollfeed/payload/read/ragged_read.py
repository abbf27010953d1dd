"""Reading a ragged (CSR) field: the row index of every record, then the window's values.

Planned once (:class:`RaggedJob`), then run as steps that hand their reads to the caller
(:mod:`rollfeed.payload.read.reader` batches every field of one read together):

1. each record's index (all its rows: the width ``W`` depends on them, not only on the window)
   with its region header, and the values of the regions the window reads whole
   (:mod:`rollfeed.payload.read.ragged_index`);
2. the window's values of clipped regions; a checking read reads the whole values blocks of the
   window's rows, checks them, then copies the window's values out.

The result is the window's rows as CSR, ``offsets [n + 1]`` int64 and ``values [nnz]``: a covered
row holds its stored values, after the label's slot for a ``label="omitted"`` field (the given
label of the row, or the fill); an uncovered row is empty. With ``width`` (checked here against
every row of the records, and against the output bound) the reader pads it to ``[n, width]``.
Example (``label="omitted"``, window of
3 rows, the record covering rows 0 and 1 with stored rows ``[3, 9]`` and ``[]``, labels
``[40, 41, 42]``)::

    offsets [0, 3, 4, 4]   values [40, 3, 9, 41]       (width=3: [[40, 3, 9], [41, -1, -1],
                                                                  [-1, -1, -1]])
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from rollfeed.payload.errors import PayloadInputError, PayloadWidthError
from rollfeed.payload.fields import PayloadField
from rollfeed.payload.format.checksum import check_blocks, unique_blocks
from rollfeed.payload.format.values import decode_into, spare
from rollfeed.payload.read.checks import RecordTable
from rollfeed.payload.read.ragged_index import IndexStep
from rollfeed.payload.read.read_plan import (
    FieldFiles,
    check_output,
    check_rows_output,
    coverage,
    inside,
    overlaps,
    spread,
)
from rollfeed.payload.read.regions import check_file_ids
from rollfeed.payload.stores.store import Reads


class RaggedJob:
    """One ragged field over one window, planned (no I/O): :meth:`steps` runs it."""

    def __init__(
        self,
        t: RecordTable,
        ranges,
        n: int,
        name: str,
        spec: PayloadField,
        width: int | None,
        bound: int,
        labels: np.ndarray | None = None,
    ) -> None:
        self.ranges, self.n, self.name, self.spec, self.width = ranges, n, name, spec, width
        self.bound, self.itemsize, self.labels = bound, spec.ragged_dtype.itemsize, labels
        # refused here already when even the offsets, or [n, width], are past the bound
        if width is None:
            check_rows_output(t, name, n, 0, self.itemsize, bound)
        else:
            check_output(t, 0, name, n, width, self.itemsize, bound, int(t.pos[0]))
        live = t.rows > 0
        self.empty = not live.any()  # placeholders only: nothing is read, nothing they claim used
        if not live.all():  # placeholders are not read: their files need not be opened
            t = RecordTable([s for s in t.segs if s.rows])
        self.t, self.file_list = t, t.files
        self.coverage = coverage(t, ranges, n)
        opened = np.bincount(t.file_idx, minlength=len(t.files))
        self.files = np.flatnonzero(opened)  # the files opened (indexes into file_list)
        if self.empty:
            self.kinds = []
        elif (
            (t.count_bytes == t.count_bytes[0]).all()
            and (t.block_rows == t.block_rows[0]).all()
            and (t.dtype == t.dtype[0]).all()
        ):  # the common case
            self.kinds = [(int(t.count_bytes[0]), int(t.block_rows[0]), int(t.dtype[0]))]
        else:
            cols = (t.count_bytes.tolist(), t.block_rows.tolist(), t.dtype.tolist())
            self.kinds = sorted(set(zip(*cols, strict=True)))

    def steps(self, files: FieldFiles, check: bool) -> Generator[Reads, None, np.ndarray]:
        """Yield the batches to read, one at a time; return ``(offsets, values)`` and the widest
        row of the records, label included (module doc; the reader pads them for ``width``)."""
        spec, t = self.spec, self.t
        if self.empty:
            offsets, values = np.zeros(self.n + 1, np.int64), np.zeros(0, spec.ragged_dtype)
            return (offsets, values), 0
        check_file_ids(t, files.file_id[t.file_idx])
        indexes = []
        for cb, block, code in self.kinds:
            idx = np.flatnonzero(
                (t.count_bytes == cb) & (t.block_rows == block) & (t.dtype == code)
            )
            kind = t if len(self.kinds) == 1 else t.take(idx)
            read_all = inside(kind, self.ranges)  # the window reads every row of these
            step = IndexStep(kind, (cb, block, code), self.name, spec, files, check, read_all)
            indexes.append(step)
        yield Reads.concat([x.reads for x in indexes])
        decoded = [x.decode() for x in indexes]
        return (yield from self._gather(decoded, files, check))

    def _gather(self, decoded, files: FieldFiles, check: bool):
        """Step 2: the rows from the decoded indexes; values of clipped regions read now."""
        n, spec, width = self.n, self.spec, self.width
        lead = int(spec.label == "omitted")  # each covered row's first slot is its label's
        widest = max(int(d.index.counts.max()) for d in decoded) + lead
        d = next(d for d in decoded if int(d.index.counts.max()) + lead == widest)
        row = int(np.argmax(d.index.counts))
        i = int(np.searchsorted(d.index.row_base, row, side="right") - 1)
        pos = int(d.table.pos[i]) + row - int(d.index.row_base[i])  # the widest row
        if width is not None and widest > width:
            s = d.table.segs[i]
            what = f"{widest} values (its sampled token included)" if lead else f"{widest} values"
            raise PayloadWidthError(
                f"a row holds {what}, wider than width={width}; raise width or pass None",
                file=s.file,
                field=self.name,
                offset=s.offset,
                pos=pos,
            )
        if width is not None:
            check_output(d.table, i, self.name, n, width, self.itemsize, self.bound, pos)
        # The window's values in window-row order, so that one scatter places them all. Values
        # of whole regions are already in memory; the others take one read per intersection.
        row_counts = np.zeros(n, np.int64)
        pieces = []
        for d in decoded:
            t, idx = d.table, d.index
            for at, lo, _, seg, a, b in overlaps(t, self.ranges):
                if not len(seg):
                    continue
                r0 = idx.row_base[seg] + a - t.pos[seg]
                length = b - a
                _copy_runs(row_counts, at + a - lo, idx.counts, r0, length)
                v0 = idx.starts[r0]
                v1 = idx.starts[r0 + length - 1] + idx.counts[r0 + length - 1]
                pieces.append(
                    (d, seg, at + a - lo, v0, v1 - v0, t.first[seg] + a - t.pos[seg], b - a)
                )
        value_base = np.concatenate([[0], np.cumsum(row_counts)])
        nnz = int(value_base[-1]) + lead * int(self.coverage.sum())  # before anything that size
        check_rows_output(self.t, self.name, n, nnz, self.itemsize, self.bound)
        values = _held_run(pieces, value_base)  # the common case: one run of held values
        clipped = []
        for d, seg, first_row, v0, count, row, rows in pieces if values is None else []:
            if values is None:
                values = np.empty(int(value_base[-1]), spec.ragged_dtype)
            dst = value_base[first_row]
            held = d.held_at[seg] >= 0
            if held.any():
                src = d.held_at[seg][held] + v0[held]
                _copy_runs(values, dst[held], d.held, src, count[held])
            if not held.all():
                rest = ~held
                clipped.append(
                    (d, seg[rest], dst[rest], v0[rest], count[rest], row[rest], rows[rest])
                )
        if clipped and not check:
            yield from _clipped_values(clipped, values, files)
        elif clipped:
            yield from _checked_values(clipped, values, files, self.name)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(row_counts + lead * self.coverage, out=offsets[1:])
        nnz = int(offsets[-1])
        if not lead:  # the window's values are the rows' values, in order
            # a copy: a run of held values is a view into every value of their regions
            out = values.copy() if values is not None else np.zeros(0, spec.ragged_dtype)
            return (offsets, out), widest
        out = np.empty(nnz, spec.ragged_dtype)
        out[offsets[:-1][self.coverage]] = self._labels()
        if values is not None and values.size:
            # value k of row r lands at offsets[r] + 1 + (k - value_base[r])
            first = offsets[:-1] + 1 - value_base[:-1]
            out[np.repeat(first, row_counts) + np.arange(values.size)] = values
        return (offsets, out), widest

    def _labels(self):
        """The label of each covered row (the fill when none were given); a label an int32 id
        cannot hold is a :class:`~rollfeed.payload.PayloadInputError` naming its position."""
        if self.labels is None:
            return self.spec.fill
        labels = self.labels[self.coverage]
        bad = labels != labels.astype(np.int32)
        if bad.any():
            k = int(np.flatnonzero(self.coverage)[np.argmax(bad)])
            raise PayloadInputError(
                f"label {int(labels[np.argmax(bad)])} of window row {k} does not fit the ids' "
                "int32",
                field=self.name,
                pos=int(np.concatenate([np.arange(lo, hi) for lo, hi in self.ranges])[k]),
            )
        return labels


def _held_run(pieces, value_base: np.ndarray) -> np.ndarray | None:
    """The window's values as one slice of a kind's held values, when one piece holds them all
    in order (regions read whole, window rows in record order), else ``None``."""
    if len(pieces) != 1:
        return None
    d, seg, first_row, v0, count, _, _ = pieces[0]
    src, dst = d.held_at[seg] + v0, value_base[first_row]
    if (d.held_at[seg] < 0).any() or int(dst[0]) != 0 or int(count.sum()) != int(value_base[-1]):
        return None
    if not ((dst[1:] == dst[:-1] + count[:-1]).all() and (src[1:] == src[:-1] + count[:-1]).all()):
        return None
    return d.held[int(src[0]) : int(src[0]) + int(value_base[-1])]


def _clipped_values(clipped, values: np.ndarray, files: FieldFiles):
    """Step 2 for clipped regions: each piece's window values, read as stored bytes into a
    buffer of its own values only (back to back), then decoded into their places in ``values``
    (a window that lists a record many times costs its output, not that many windows)."""
    plans = []
    for d, seg, dst, v0, count, _, _ in clipped:
        local = np.cumsum(count) - count  # each run's place in this piece's buffer
        raw = np.zeros(d.size * int(count.sum()) + spare(d.dtype), np.uint8)
        plans.append((d, seg, dst, v0, count, local, raw))
    yield Reads.concat(
        [
            files.reads(
                d.table.file_idx[seg],
                d.table.offset[seg] + d.values_at[seg] + d.size * v0,
                d.size * count,
                [raw],
                0,
                d.size * local,
            )
            for d, seg, dst, v0, count, local, raw in plans
        ]
    )
    for d, _, dst, _, count, local, raw in plans:
        got = np.empty(int(count.sum()), values.dtype)
        decode_into(got, raw, d.dtype)
        _copy_runs(values, dst, got, local, count)


def _checked_values(clipped, values: np.ndarray, files: FieldFiles, name: str):
    """Step 2 of a checking read for clipped regions: the whole values blocks of the window's
    rows, checked against the table entries step 1 read, then the window's values copied."""
    plans = []
    for d, seg, dst, v0, count, row, rows in clipped:
        t, block = d.table, d.block_rows
        ur, uk, first = unique_blocks(seg, row // block, (row + rows - 1) // block)
        j = d.index_base[ur] + uk - t.first[ur] // block  # table block of each pair
        bs, be = d.index.block_start[j], d.index.block_end[j]
        slot = np.cumsum(be - bs) - (be - bs)
        total = int((be - bs).sum())
        scratch = np.zeros(d.size * total + spare(d.dtype), np.uint8)
        src = t.offset[ur] + d.values_at[ur] + d.size * bs
        plans.append((d, seg, dst, v0, count, ur, uk, first, bs, be, slot, scratch, src))
    yield Reads.concat(
        [
            files.reads(
                p[0].table.file_idx[p[5]],
                p[12],
                p[0].size * (p[9] - p[8]),
                [p[11]],
                0,
                p[0].size * p[10],
            )
            for p in plans
        ]
    )
    for d, _, dst, v0, count, ur, uk, first, bs, be, slot, scratch, src in plans:
        J = len(ur)
        check_blocks(
            d.table.segs,
            name,
            [memoryview(scratch)],
            (np.zeros(J, np.int64), d.size * slot, d.size * (be - bs), np.arange(J)),
            (ur, np.full(J, 3), uk, src, d.entries.stored(ur, 2 + 2 * uk)),
        )
        got = np.empty(int((be - bs).sum()), values.dtype)
        decode_into(got, scratch, d.dtype)
        _copy_runs(values, dst, got, slot[first] + v0 - bs[first], count)


def _copy_runs(dst: np.ndarray, d0: np.ndarray, src: np.ndarray, s0: np.ndarray, n: np.ndarray):
    """``dst[d0[i] : d0[i] + n[i]] = src[s0[i] : s0[i] + n[i]]`` for every ``i`` (``[k]``
    arrays); one slice copy when the runs follow each other on both sides (a window over whole
    requests in order), else one gather and scatter."""
    if (d0[1:] == d0[:-1] + n[:-1]).all() and (s0[1:] == s0[:-1] + n[:-1]).all():
        a, b, total = int(d0[0]), int(s0[0]), int(n.sum())
        dst[a : a + total] = src[b : b + total]
    else:
        dst[spread(d0, n)] = src[spread(s0, n)]
