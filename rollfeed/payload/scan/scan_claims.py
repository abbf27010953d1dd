"""What a region header claims, checked before ``verify`` and ``inspect`` read anything more.

Used by :mod:`rollfeed.payload.scan.scan` (which part of a header is not well formed is
:meth:`~rollfeed.payload.format.layout.RegionHeader.unpack`'s to say): every size a header claims
(body bytes, rows, values, count bytes, block rows), bounded in Python ints by the file's real
size, so nothing is allocated or read for a claim the file cannot hold.
Every problem is a typed :class:`~rollfeed.payload.errors.PayloadError` naming the file, the
region number, its byte offset, its field and the header field at fault.
"""

from __future__ import annotations

import math

from rollfeed.payload.errors import PayloadError, PayloadRegionError, PayloadTruncatedError
from rollfeed.payload.format.checksum import fixed_block_rows
from rollfeed.payload.format.layout import (
    BLOCK_ROWS,
    DTYPE_SIZES,
    KIND_FIXED,
    RAGGED_INT_DTYPES,
    RegionHeader,
    values_start,
)


def check_claims(rel: str, size: int, h: RegionHeader, at: int, body_at: int, k: int) -> None:
    """Every size ``h`` claims, bounded by the file before anything is allocated for it."""

    def bad(what: str, kind: type[PayloadError] = PayloadRegionError) -> PayloadError:
        return kind(f"region {k}: {what}", file=rel, field=h.field, offset=at)

    extent = size - body_at
    if h.body_bytes > extent:
        raise bad(
            f"header field body_bytes = {h.body_bytes} runs past the end of the file "
            f"(only {extent} bytes follow the header; cut short, or a damaged header)",
            PayloadTruncatedError,
        )
    itemsize = DTYPE_SIZES[h.dtype]
    if h.kind == KIND_FIXED:
        block = fixed_block_rows(itemsize * math.prod(h.shape))  # blocks of the checksum table
        if h.count_bytes or h.block_rows != block:
            raise bad(
                f"header fields count_bytes = {h.count_bytes}, block_rows = {h.block_rows}: a "
                f"fixed-width region has 0 and {block}"
            )
        if h.values * itemsize != h.body_bytes:
            raise bad(
                f"header field values = {h.values} x {itemsize}-byte {h.dtype} disagrees with "
                f"body_bytes = {h.body_bytes}"
            )
        if h.rows * math.prod(h.shape) != h.values:
            raise bad(
                f"header field rows = {h.rows} x row shape {list(h.shape)} disagrees with "
                f"values = {h.values}"
            )
        return
    kinds = (*RAGGED_INT_DTYPES, "float32")
    if h.dtype not in kinds or h.count_bytes not in (1, 2, 4):
        raise bad(
            f"header fields dtype = {h.dtype}, count_bytes = {h.count_bytes}: a ragged region "
            f"stores values as one of {kinds} and 1, 2 or 4-byte row lengths"
        )
    if not 1 <= h.block_rows <= max(h.rows, BLOCK_ROWS):
        # Bounds the index table below: ceil(rows / B) blocks of 8 + B * count_bytes bytes.
        raise bad(
            f"header field block_rows = {h.block_rows}, expected 1..max(rows = {h.rows}, "
            f"{BLOCK_ROWS})"
        )
    expected = values_start(h.rows, h.count_bytes, h.block_rows) + itemsize * h.values
    if h.body_bytes != expected:
        raise bad(
            f"header field body_bytes = {h.body_bytes}, but rows = {h.rows} and values = "
            f"{h.values} make {expected}"
        )
    if h.rows == 0 and h.values:
        raise bad(f"header field values = {h.values} in a region of 0 rows")
