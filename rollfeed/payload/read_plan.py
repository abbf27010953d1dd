"""Planning a read as NumPy columns: which rows of which records a window takes, where region
headers lie, and whether every byte range a record claims fits its file.

Shared by the fixed-width reader (:mod:`rollfeed.payload.reader`) and the ragged one
(:mod:`rollfeed.payload.ragged_read`); no function here reads a byte.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rollfeed.payload.checks import RecordTable
from rollfeed.payload.errors import PayloadTruncatedError
from rollfeed.payload.layout import REGION_HEADER, REGION_HEADER_V1, VERSION
from rollfeed.payload.lease import Lease
from rollfeed.payload.regions import check_room


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


def header_ranges(t: RecordTable, lease: Lease, key: bytes):
    """Version ``[S]``, region header size ``[S]`` and start ``[S]`` of each record's region."""
    version = lease.version[t.file_idx]
    hsize = np.where(version == VERSION, REGION_HEADER.size, REGION_HEADER_V1.size) + len(key)
    check_room(t, lease.header_size[t.file_idx], hsize)
    return version, hsize, t.offset - hsize


def fit(
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


def slots(buf: np.ndarray) -> np.ndarray:
    """Byte offset of each row of a 2-D buffer: ``[len(buf)]``."""
    return np.arange(len(buf), dtype=np.int64) * buf.shape[1]


def spread(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])``: ``[sum(lengths)]``."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
