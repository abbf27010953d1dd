"""Step 1 of a ragged (CSR) read: every record's row index, with its region header.

Each record's index is read whole (all its rows: the width ``W`` depends on them, not only on the
window). A record that spans its whole region and whose every row the window reads (the common
case) reads header, index, padding and values in one ``preadv`` with no copy. A checking read
adds the record's checksum table entries and checks the header and the index blocks before
decoding the index, and the values of whole regions after. Step 2 is
:mod:`rollfeed.payload.read.ragged_read`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollfeed.payload.errors import PayloadIndexError
from rollfeed.payload.format.checksum import Entries, check_blocks, table_entries
from rollfeed.payload.format.layout import (
    DTYPE_CODES,
    DTYPE_SIZES,
    REGION_HEADER,
    RowIndex,
    decode_index,
    index_bytes,
    index_table,
    values_start,
)
from rollfeed.payload.format.values import decode_into, spare
from rollfeed.payload.read.checks import RecordTable
from rollfeed.payload.read.read_plan import fit, header_ranges, slots
from rollfeed.payload.read.regions import check_regions
from rollfeed.payload.stores.lease import Reads


@dataclass(frozen=True, kw_only=True, slots=True)
class Decoded:
    """The row index of one kind's records, and the values of the regions read whole."""

    table: RecordTable
    index: RowIndex
    block_rows: int
    dtype: str  # the stored value dtype (a name of DTYPE_CODES)
    size: int  # bytes of one stored value
    index_base: np.ndarray  # [S + 1] first decoded index block of each record
    values_at: np.ndarray  # [S] byte offset of the values inside each region body
    held_at: np.ndarray  # [S] first element of the region's values in ``held``, or -1
    held: np.ndarray  # values of the regions read whole, back to back, decoded (``ragged_dtype``)
    entries: Entries | None  # a checking read's table entries


class IndexStep:
    """Step 1 for the records of one ``(count_bytes, block_rows, dtype code)`` kind: the reads of
    every record's index (all its rows: W depends on them, not the window) and its region header.

    A record that spans its whole region and whose every row the window reads (``read_all``;
    the common case: one request, one region) is read in one go, index and values together;
    another one reads only the index blocks covering it (its values are read in step 2).
    """

    def __init__(self, t: RecordTable, kind, name, spec, files, check: bool, read_all):
        cb, block, code = kind
        self.t, self.cb, self.block, self.name, self.check = t, cb, block, name, check
        self.spec, self.dtype = spec, DTYPE_CODES[code]
        self.vsize = size = DTYPE_SIZES[self.dtype]
        self.key = name.encode()
        self.version, self.hsize, self.hstart = header_ranges(t, files, self.key)
        self.files = files
        lay_rows, lay_values = t.lay_rows, t.lay_values

        def body(rows, values):  # a checking read needs the checksum table too
            tail = 4 * table_entries(True, rows, block) if check else 0
            return values_start(rows, cb, block) + size * values + tail

        def fits(file_size: np.ndarray) -> np.ndarray:
            room = file_size - t.offset
            ok = (room >= 0) & (lay_rows <= room) & (lay_values <= room // size)  # no wrap below
            return ok & (body(np.where(ok, lay_rows, 0), np.where(ok, lay_values, 0)) <= room)

        def needs(i: int) -> str:
            rows, values = int(lay_rows[i]), int(lay_values[i])
            what = " and its checksum table" if check else ""
            end = int(t.offset[i]) + body(rows, values)
            return f"a region of {rows} rows and {values} values{what} ends at byte {end}"

        self.size = fit(t, files, fits, needs)  # the whole region lies inside the file
        table = self.table = index_table(
            t.first, t.first + t.rows, lay_rows, lay_values, count_bytes=cb, block_rows=block
        )
        self.values_at = values_at = values_start(lay_rows, cb, block)
        self.whole = whole = (t.first == 0) & (t.rows == lay_rows) & read_all
        held_len = np.where(whole, lay_values, 0)
        self.held_at = held_at = np.where(whole, np.cumsum(held_len) - held_len, -1)
        self.raw = np.zeros(size * int(held_len.sum()) + spare(self.dtype), np.uint8)
        self.hbuf = np.zeros((len(t.segs), REGION_HEADER.size + len(self.key)), np.uint8)
        self.pad = np.zeros((len(t.segs), 4), np.uint8)  # the index's padding to 4 bytes
        w = np.flatnonzero(whole)
        # A whole region: header, index (into the table), padding, values (and a checking
        # read's table entries), adjacent in the file, so one preadv; a clipped one: its header
        # and the index blocks covering it (and the padding when its last block is read).
        index_start = np.where(whole, 0, table.span_start)
        ib = index_bytes(lay_rows, cb, block)
        pad = w if not check else np.flatnonzero(whole | (table.span_start + table.span_len == ib))
        reads = [
            (t.file_idx, self.hstart, self.hsize, self.hbuf, slots(self.hbuf)),
            (t.file_idx, t.offset + index_start, table.span_len, table.table, table.slot),
            (t.file_idx[pad], t.offset[pad] + ib[pad], (values_at - ib)[pad], self.pad, 4 * pad),
            (
                t.file_idx[w],
                t.offset[w] + values_at[w],
                size * lay_values[w],
                self.raw,
                size * held_at[w],
            ),
        ]
        self.entries = None
        if check:  # entries 0 .. 2 + 2 * (last block read): the header, index and values CRCs
            last = (t.first + t.rows - 1) // block
            at = t.offset + values_at + size * lay_values
            self.entries = Entries.plan(at, 3 + 2 * last)
            reads.append(
                (
                    t.file_idx,
                    at,
                    4 * self.entries.count,
                    self.entries.buf,
                    4 * self.entries.base[:-1],
                )
            )
        self.reads = Reads.concat([files.reads(fi, s, n, [d], 0, o) for fi, s, n, d, o in reads])

    def decode(self) -> Decoded:
        """After step 1's reads: every record held to its header (and a checking read's CRCs),
        then the index decoded."""
        t, table, block = self.t, self.table, self.block
        file_id = self.files.file_id[t.file_idx]
        check_regions(
            t,
            self.hbuf,
            self.version,
            name=self.key,
            size=self.size,
            file_id=file_id,
            shape=None,
            ragged=(self.cb, block),
            omitted=self.spec.label == "omitted",
        )
        if self.check:
            self._check_index()
        try:
            index = decode_index(table)
        except PayloadIndexError as err:
            s = t.segs[err.request]
            raise err.with_place(file=s.file, field=self.name, offset=s.offset, pos=s.pos) from None
        if self.check:
            self._check_held(index)
        held = np.empty((self.raw.size - spare(self.dtype)) // self.vsize, self.spec.ragged_dtype)
        decode_into(held, self.raw, self.dtype)
        return Decoded(
            table=t,
            index=index,
            block_rows=block,
            dtype=self.dtype,
            size=self.vsize,
            index_base=table.block_base,
            values_at=self.values_at,
            held_at=self.held_at,
            held=held,
            entries=self.entries,
        )

    def _check_index(self) -> None:
        """The headers and every index block read (the region's last one with its padding)."""
        t, table, block, S = self.t, self.table, self.block, len(self.t.segs)
        per = 8 + block * self.cb
        nb = np.diff(table.block_base)
        rec = np.repeat(np.arange(S), nb)
        k = np.repeat(t.first // block - table.block_base[:-1], nb) + np.arange(len(rec))
        ib = index_bytes(t.lay_rows, self.cb, block)[rec]
        length = np.minimum(per, ib - k * per)
        last = np.flatnonzero((k + 1) * per >= ib)  # these blocks end with the padding
        J = len(rec)
        every = np.arange(S)
        check_blocks(
            t.segs,
            self.name,
            [
                memoryview(self.hbuf.reshape(-1)),
                memoryview(table.table),
                memoryview(self.pad.reshape(-1)),
            ],
            (
                np.repeat([0, 1, 2], [S, J, len(last)]),
                np.concatenate([slots(self.hbuf), np.arange(J) * per, 4 * rec[last]]),
                np.concatenate([self.hsize, length, (self.values_at[rec] - ib)[last]]),
                np.concatenate([every, S + np.arange(J), S + last]),
            ),
            (
                np.concatenate([every, rec]),
                np.repeat([0, 2], [S, J]),
                np.concatenate([np.zeros(S, np.int64), k]),
                np.concatenate([self.hstart, t.offset[rec] + k * per]),
                np.concatenate(
                    [self.entries.stored(every, 0), self.entries.stored(rec, 1 + 2 * k)]
                ),
            ),
        )

    def _check_held(self, index: RowIndex) -> None:
        """The values blocks of every region read whole."""
        t, table = self.t, self.table
        nb = np.diff(table.block_base)
        rec = np.repeat(np.arange(len(t.segs)), nb)
        j = np.flatnonzero(self.whole[rec])
        rec = rec[j]
        k = j - table.block_base[rec]  # a whole region's table starts at its block 0
        bs, be = index.block_start[j], index.block_end[j]
        J, size = len(j), self.vsize
        check_blocks(
            t.segs,
            self.name,
            [memoryview(self.raw)],
            (
                np.zeros(J, np.int64),
                size * (self.held_at[rec] + bs),
                size * (be - bs),
                np.arange(J),
            ),
            (
                rec,
                np.full(J, 3),
                k,
                t.offset[rec] + self.values_at[rec] + size * bs,
                self.entries.stored(rec, 2 + 2 * k),
            ),
        )
