"""What a region header claims, checked before ``verify`` and ``inspect`` read anything more.

Used by :mod:`rollfeed.payload.scan.scan`: which part of a header is not well formed, and every size
a well-formed header claims (body bytes, rows, values, count bytes, block rows), bounded in Python
ints by the file's real size, so nothing is allocated or read for a claim the file cannot hold.
Every problem is a typed :class:`~rollfeed.payload.errors.PayloadError` naming the file, the
region number, its byte offset, its field and the header field at fault.
"""

from __future__ import annotations

import math

import numpy as np

from rollfeed.payload.errors import PayloadError, PayloadRegionError, PayloadTruncatedError
from rollfeed.payload.format.checksum import fixed_block_rows
from rollfeed.payload.format.layout import (
    BLOCK_ROWS,
    CHECKSUM_CRC32C,
    DTYPE_CODES,
    DTYPE_SIZES,
    KIND_FIXED,
    KIND_RAGGED,
    LABEL_OMITTED,
    MAX_NDIM,
    RAGGED_INT_DTYPES,
    REGION_RECORD,
    REGION_RECORD_V1,
    VERSION,
    FileHeader,
    RegionHeader,
    region_magic,
    values_start,
)


def malformed(
    head: FileHeader, fixed: bytes, name: bytes, rel: str, at: int, k: int
) -> PayloadRegionError:
    """Which part of a region header ``RegionHeader.unpack`` refused."""
    v2 = head.version != 1
    rec = np.frombuffer(fixed, REGION_RECORD if v2 else REGION_RECORD_V1)[0]
    magic = region_magic(head.version)
    if rec["magic"] != magic:
        what = f"magic {bytes(rec['magic'])!r}, expected {magic!r}"
    elif rec["kind"] not in (KIND_FIXED, KIND_RAGGED):
        what = f"header field kind = {rec['kind']}, expected {KIND_FIXED} or {KIND_RAGGED}"
    elif rec["dtype"] >= len(DTYPE_CODES):
        what = f"header field dtype code = {rec['dtype']}, expected < {len(DTYPE_CODES)}"
    elif v2 and (rec["ndim"] > MAX_NDIM or (rec["kind"] == KIND_RAGGED and rec["ndim"])):
        what = f"header field ndim = {rec['ndim']} (a ragged region has 0, a fixed one <= 4)"
    elif v2 and rec["dims"][rec["ndim"] :].any():
        what = f"header field dims = {rec['dims'].tolist()} has dims past ndim = {rec['ndim']}"
    elif v2 and rec["checksum"] != CHECKSUM_CRC32C:
        what = f"header field checksum = {rec['checksum']}, expected {CHECKSUM_CRC32C} (CRC-32C)"
    elif (
        v2
        and rec["flags"]
        and (rec["flags"] != LABEL_OMITTED or head.version != VERSION or rec["kind"] != KIND_RAGGED)
    ):
        what = (
            f"header field flags = {rec['flags']}, expected 0 or {LABEL_OMITTED} (rows omit their "
            f"sampled token) in a ragged region of version {VERSION}"
        )
    else:
        what = f"field name {name!r} is not UTF-8"
    return PayloadRegionError(
        f"region {k} is not a well-formed region header: {what}", file=rel, offset=at
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
        # version 2: blocks of the checksum table; version 1 has none
        block = 0 if h.shape is None else fixed_block_rows(itemsize * math.prod(h.shape))
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
        if h.shape is not None and h.rows * math.prod(h.shape) != h.values:
            raise bad(
                f"header field rows = {h.rows} x row shape {list(h.shape)} disagrees with "
                f"values = {h.values}"
            )
        if h.shape is None and h.values and (h.rows == 0 or h.values % h.rows):  # version 1
            raise bad(f"header field rows = {h.rows} does not divide values = {h.values}")
        return
    kinds = ("int32", "float32") if h.version != VERSION else (*RAGGED_INT_DTYPES, "float32")
    if h.dtype not in kinds or h.count_bytes not in (1, 2, 4):
        raise bad(
            f"header fields dtype = {h.dtype}, count_bytes = {h.count_bytes}: a ragged region of "
            f"version {h.version} stores values as one of {kinds} and 1, 2 or 4-byte row lengths"
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
