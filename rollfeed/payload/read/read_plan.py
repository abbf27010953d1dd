"""Planning a read as NumPy columns: which rows of which records a window takes, which window
rows hold data, where region headers lie, and whether every byte range a record claims fits its
file.

Shared by the fixed-width reader (:mod:`rollfeed.payload.read.fixed_read`) and the ragged one
(:mod:`rollfeed.payload.read.ragged_read`); no function here reads a byte.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rollfeed.payload.errors import PayloadOutputBoundError, PayloadTruncatedError
from rollfeed.payload.format.layout import REGION_HEADER
from rollfeed.payload.read.checks import RecordTable
from rollfeed.payload.read.regions import check_room
from rollfeed.payload.stores.store import Reads, StoreLease


class FieldFiles:
    """One field's files inside a lease that several fields share: the lease's columns, and
    batches of ranges, indexed by the field's own file numbers (``fmap [F]``: lease index of
    each; the field's records never point at an unmapped one)."""

    def __init__(self, lease: StoreLease | None, fmap: np.ndarray) -> None:
        self.lease, self.fmap = lease, fmap
        same = lease is not None and len(fmap) == len(lease.files)
        self._same = same and bool((fmap == np.arange(len(fmap))).all())  # no mapping needed

    def _column(self, name: str) -> np.ndarray:
        col = getattr(self.lease, name)
        return col if self._same else col[self.fmap]

    size = property(lambda self: self._column("size"))
    file_id = property(lambda self: self._column("file_id"))

    def refresh(self, idx: np.ndarray) -> None:
        self.lease.refresh(self.fmap[idx])  # type: ignore[union-attr]

    def reads(
        self,
        file_idx: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        dests: list[np.ndarray],
        dest_idx: np.ndarray | int,
        dest_offsets: np.ndarray,
    ) -> Reads:
        """A batch of this field's ranges (``file_idx`` in its own numbering; ``[K]`` columns)."""
        return Reads(
            file_idx=file_idx if self._same else self.fmap[file_idx],
            offsets=offsets,
            lengths=lengths,
            dests=dests,
            dest_idx=np.full(offsets.shape, dest_idx, np.int64),
            dest_offsets=dest_offsets,
        )


def overlaps(t: RecordTable, ranges: list[tuple[int, int]]):
    """Per window range: (at, lo, hi, seg [k], a [k], b [k]) where rows [a, b) of record seg fall
    inside [lo, hi) and ``at`` is the range's first output row (``t``: live records by position)."""
    at = 0
    for lo, hi in ranges:
        i0 = int(np.searchsorted(t.end, lo, side="right"))
        i1 = int(np.searchsorted(t.pos, hi, side="left"))
        seg = np.arange(i0, max(i0, i1))
        yield at, lo, hi, seg, np.maximum(t.pos[seg], lo), np.minimum(t.end[seg], hi)
        at += hi - lo


def coverage(t: RecordTable, ranges: list[tuple[int, int]], n: int) -> np.ndarray:
    """``[n]`` bool: the window rows some record's rows cover (``t``: live records by position);
    every other row reads as the field's fill.

    Example: records at positions [2, 5) and [7, 8), window [(0, 4), (6, 9)] -> rows of
    positions 0 1 2 3 6 7 8 -> ``[F, F, T, T, F, T, F]``.
    """
    out = np.zeros(n, bool)
    for at, lo, _, _, a, b in overlaps(t, ranges):
        if not len(a):
            continue
        # runs that touch (records side by side: the common case) merge into one slice
        start = np.flatnonzero(np.concatenate([[True], a[1:] != b[:-1]]))
        stop = np.concatenate([start[1:], [len(a)]]) - 1
        for r0, r1 in zip((at + a[start] - lo).tolist(), (at + b[stop] - lo).tolist(), strict=True):
            out[r0:r1] = True  # a few runs of many rows: slices beat an index array
    return out


def inside(t: RecordTable, ranges: list[tuple[int, int]]) -> np.ndarray:
    """``[S]`` bool: records whose every row the window reads (``[pos, end)`` within the union
    of ``ranges``)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if not merged:
        return t.rows == 0
    lo, hi = np.array(merged, np.int64).T
    k = np.maximum(np.searchsorted(lo, t.pos, side="right") - 1, 0)
    return (lo[k] <= t.pos) & (t.end <= hi[k])


def header_ranges(t: RecordTable, lease: FieldFiles, key: bytes):
    """Region header size ``[S]`` and start ``[S]`` of each record's region."""
    hsize = np.full(len(t.offset), REGION_HEADER.size + len(key), np.int64)
    check_room(t, hsize)
    return hsize, t.offset - hsize


def fit(
    t: RecordTable,
    lease: FieldFiles,
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


def check_output(
    t: RecordTable, i: int, name: str, n: int, width: int, itemsize: int, bound: int, pos: int
) -> None:
    """Refuse a field's output of ``n`` rows of ``width`` values of ``itemsize`` bytes past
    ``bound`` bytes (the root's ``max_output_bytes``), before it is allocated; record ``i`` (at
    position ``pos``) is the one that sets the width."""
    total = n * width * itemsize
    if total <= bound:
        return
    s = t.segs[i]
    raise PayloadOutputBoundError(
        f"{n} rows of {width} values ({itemsize} bytes each) would take {total} bytes, more than "
        f"max_output_bytes={bound}; read fewer rows, pass width= (wider rows are then refused), "
        "or raise the root's max_output_bytes",
        file=s.file,
        field=name,
        offset=s.offset,
        pos=pos,
        rows=n,
        width=width,
    )


def check_rows_output(
    t: RecordTable, name: str, n: int, nnz: int, itemsize: int, bound: int
) -> None:
    """Refuse a ragged field's output of ``n`` rows (``n + 1`` int64 offsets) and ``nnz``
    values of ``itemsize`` bytes past ``bound`` bytes, before it is allocated (a window that
    lists the same rows many times)."""
    total = 8 * (n + 1) + nnz * itemsize
    if total <= bound:
        return
    s = t.segs[0]
    raise PayloadOutputBoundError(
        f"{n} rows holding {nnz} values would take {total} bytes (offsets and values), more "
        f"than max_output_bytes={bound}; read fewer rows, or raise the root's max_output_bytes",
        file=s.file,
        field=name,
        offset=s.offset,
        pos=int(t.pos[0]),
        rows=n,
    )


def slots(buf: np.ndarray) -> np.ndarray:
    """Byte offset of each row of a 2-D buffer: ``[len(buf)]``."""
    return np.arange(len(buf), dtype=np.int64) * buf.shape[1]


def spread(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])``: ``[sum(lengths)]``."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
