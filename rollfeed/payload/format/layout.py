"""Byte layouts of payload files.

A payload file is a file header followed by regions, each a region header, a body and (version 2)
a checksum table. Readers go straight to a body through the segment record (``offset`` is the
body's byte offset) and check the region header right before it, read in the same batch, against
the record; the region headers also make a file self-describing for ``verify`` and ``inspect``.

Format version 3 (written; versions 1 and 2 stay readable):

- file header ``<8sHHIQ`` (24 bytes): magic ``b"RFPAYLD\\0"``, version 3, flags (0), reserved (0),
  file id (random, ``1 <= id < 2**63``; every region header and every record repeats it, so a
  reader holding a descriptor of a replaced file notices from the bytes it reads anyway);
- region header ``<4sBBBBIQQQQBBBx4I`` (64 bytes): magic ``b"RGN3"``, kind (0 fixed, 1 ragged),
  count bytes, dtype code, field name length, block rows, rows, values, body bytes, file id, row
  ndim (at most 4), checksum kind (1: CRC-32C), row flags (bit 0: each row omits its sampled
  token, see below; 0 for fixed-width regions), one zero byte, row dims (u32, unused ones 0);
  then the field name (UTF-8), then the body, then the checksum table
  (:mod:`rollfeed.payload.format.checksum`): one little-endian u32 CRC-32C of the header and name,
  then one per block of the body.

Version 2: the same file header (version 2) and region header with magic ``b"RGN2"`` and a zero
row-flags byte; its ragged values are always 4 bytes (int32 / float32) and its rows whole.
Version 1: file header ``<8sHHI`` (16 bytes, no id); region header ``<4sBBBBIQQQ4x`` (40 bytes,
magic ``b"RGN1"``, no file id, no row shape, no checksums), then the name, then the body.

Fixed-width body: C-contiguous ``[rows, *shape]`` at the stored dtype (little endian). Its blocks
are ``block_rows = max(1, 65536 // row_bytes)`` rows (the last one shorter), so a checking read of
a window reads at most one block beyond each end of it.

Ragged (CSR) body, everything relative to the body start, so no file-size cap::

    index:  ceil(rows / B) blocks; block k = u64 offset of its first value, then the B row lengths
            (``count_bytes`` each: 1 when every row has < 256 values, else 2, else 4)
    pad to 4 bytes
    values: row after row, at the region's value dtype (the header's dtype code): float32 for a
            float fill; for an int fill the narrowest of uint8, uint16, uint24 (3 bytes, little
            endian) and int32 that holds every value of the region (int32 when one is negative)

Rows of a field declared ``label="omitted"`` (the sampling mask; row flags bit 0) hold a kept set
without its sampled token, which is the token at the row's own position: the other ids
ascending (a singleton is an empty row). A direct reader rebuilds row ``p`` as
``[token_ids[p], *stored_row]``. Rows of a ``label="first"`` field (the mask logprobs) are whole,
the sampled token's value first, then the others' in ascending id order
(:mod:`rollfeed.payload.format.label_rows`).

Its checksum blocks follow the index blocks: per block k of B rows, one CRC of index block k (the
last one with the padding) and one of the values of its rows, so a window checks the index and
values blocks of the rows it reads and nothing else.

With B = 128 and 1-byte lengths the index costs 1 + 8/128 = 1.06 bytes per row and its checksums
8/128 = 0.06, so a mask with a mean of 1.7 kept ids per token (ids < 2**24: 3 bytes) costs about
1.13 + 0.7 * 3 = 3.2 bytes per token (version 2: 1.13 + 1.7 * 4 = 7.9; a padded ``[T, 32]`` int32
layout: 128); routing ``[T, 48, 8]`` uint8 costs 384 + 4/170 bytes per token. Reading rows
``[a, b)`` of a region takes one read of the index blocks covering them and one read of their
values; no second pass over values for widths.

Worked example (B = 2, counts [2, 0, 1], values [7, 9, 4]: uint8)::

    block 0: offset=0, lengths [2, 0]      block 1: offset=2, lengths [1]
    index bytes = 2 * 8 + 3 * 1 = 19 -> values start at 20 -> body is 20 + 3 * 1 = 23 bytes
    checksum table (5 u32): crc(header + name), crc(body[0:10]), crc(body[20:22]),
                            crc(body[10:20]) (index block 1 and the padding), crc(body[22:23])
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from rollfeed.payload.errors import PayloadHeaderError, PayloadIndexError, PayloadInputError
from rollfeed.payload.format.values import encode_values

MAGIC = b"RFPAYLD\0"
VERSION = 3
VERSIONS = (1, 2, 3)  # the versions this reader reads
FILE_HEADER = struct.Struct("<8sHHIQ")
FILE_HEADER_V1 = struct.Struct("<8sHHI")
REGION_MAGIC = b"RGN3"
REGION_MAGIC_V2 = b"RGN2"
REGION_MAGIC_V1 = b"RGN1"
REGION_HEADER = struct.Struct("<4sBBBBIQQQQBBBx4I")
REGION_HEADER_V1 = struct.Struct("<4sBBBBIQQQ4x")
MAX_NDIM = 4  # row dims a version-2 region header holds
CHECKSUM_CRC32C = 1  # the checksum kind of every version-2 and -3 region
LABEL_OMITTED = 1  # row flags bit 0: each row omits its sampled token
FLAGS_AT = 46  # byte of the row flags in a version-3 region header
KIND_FIXED, KIND_RAGGED = 0, 1
DTYPE_CODES = (
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "uint24",  # ragged values only
)
# Bytes of one stored value, by dtype name (uint24 has no NumPy dtype: 3 bytes, little endian).
DTYPE_SIZES = {name: 3 if name == "uint24" else np.dtype(name).itemsize for name in DTYPE_CODES}
RAGGED_INT_DTYPES = ("uint8", "uint16", "uint24", "int32")  # narrowest first
BLOCK_ROWS = 128
_OFFSET = np.dtype("<u8")
Rows = TypeVar("Rows", int, np.ndarray)

# The region headers as NumPy records, for checking many of them at once (see checks.py).
REGION_RECORD = np.dtype(
    [
        ("magic", "S4"),
        ("kind", "u1"),
        ("count_bytes", "u1"),
        ("dtype", "u1"),
        ("name_len", "u1"),
        ("block_rows", "<u4"),
        ("rows", "<u8"),
        ("values", "<u8"),
        ("body_bytes", "<u8"),
        ("file_id", "<u8"),
        ("ndim", "u1"),
        ("checksum", "u1"),
        ("flags", "u1"),
        ("pad", "V1"),
        ("dims", "<u4", (MAX_NDIM,)),
    ]
)
REGION_RECORD_V1 = np.dtype(
    [
        ("magic", "S4"),
        ("kind", "u1"),
        ("count_bytes", "u1"),
        ("dtype", "u1"),
        ("name_len", "u1"),
        ("block_rows", "<u4"),
        ("rows", "<u8"),
        ("values", "<u8"),
        ("body_bytes", "<u8"),
        ("pad", "V4"),
    ]
)
assert REGION_RECORD.itemsize == REGION_HEADER.size
assert REGION_RECORD_V1.itemsize == REGION_HEADER_V1.size


def new_file_id() -> int:
    """A random file id in ``[1, 2**63)`` (fits a signed int64 column; 0 means "no id")."""
    return secrets.randbits(63) or 1


def file_header(file_id: int) -> bytes:
    """The version-3 file header of a file with id ``file_id``."""
    return FILE_HEADER.pack(MAGIC, VERSION, 0, 0, file_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class FileHeader:
    """A parsed file header: ``size`` bytes long; ``file_id`` is ``None`` in version 1."""

    version: int
    file_id: int | None
    size: int


def parse_file_header(raw: bytes) -> FileHeader:
    """Parse the first bytes of a file (pass up to ``FILE_HEADER.size`` of them; fewer when the
    file is shorter). Raises :class:`PayloadHeaderError` (no place: the caller adds the file)
    for a bad magic, an unknown version or a header cut short."""
    if len(raw) < FILE_HEADER_V1.size or raw[:8] != MAGIC:
        raise PayloadHeaderError("not a payload file (bad magic)", offset=0)
    version = FILE_HEADER_V1.unpack_from(raw)[1]
    if version == 1:
        return FileHeader(version=1, file_id=None, size=FILE_HEADER_V1.size)
    if version not in VERSIONS:
        raise PayloadHeaderError(
            f"payload format version {version}; this reader reads versions {VERSIONS}",
            offset=0,
        )
    if len(raw) < FILE_HEADER.size:
        raise PayloadHeaderError(
            f"file header cut short: {len(raw)} of {FILE_HEADER.size} bytes", offset=0
        )
    _, _, flags, reserved, file_id = FILE_HEADER.unpack_from(raw)
    if flags or reserved:
        raise PayloadHeaderError(
            f"file header flags {flags} / reserved {reserved}: version {version} writes 0 (a "
            "damaged header, or a newer writer's flags this reader does not know)",
            offset=4,
        )
    if not 0 < file_id < 1 << 63:
        raise PayloadHeaderError(f"file id {file_id} is outside [1, 2**63)", offset=0)
    return FileHeader(version=version, file_id=file_id, size=FILE_HEADER.size)


def region_struct(version: int) -> struct.Struct:
    """The fixed part of a region header in format ``version`` (the field name follows it)."""
    return REGION_HEADER_V1 if version == 1 else REGION_HEADER


def region_magic(version: int) -> bytes:
    return {1: REGION_MAGIC_V1, 2: REGION_MAGIC_V2}.get(version, REGION_MAGIC)


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionHeader:
    """One region header. ``file_id``, ``shape`` (a fixed-width row's dims; ``()`` for ragged
    regions) and ``checksum`` (the checksum kind) are ``None`` in version 1, which does not record
    them; ``flags`` (row flags, :data:`LABEL_OMITTED`) is 0 before version 3."""

    field: str
    kind: int
    count_bytes: int
    dtype: str
    block_rows: int
    rows: int
    values: int
    body_bytes: int
    file_id: int | None = None
    shape: tuple[int, ...] | None = None
    checksum: int | None = CHECKSUM_CRC32C
    flags: int = 0
    version: int = VERSION

    @property
    def size(self) -> int:
        """Bytes from the region's start to its body."""
        return region_struct(self.version).size + len(self.field.encode())

    def pack(self) -> bytes:
        """The version-3 bytes of this header (writers only write version 3)."""
        assert self.version == VERSION and self.file_id is not None and self.shape is not None
        name = self.field.encode()
        dims = [*self.shape, *[0] * (MAX_NDIM - len(self.shape))]
        return (
            REGION_HEADER.pack(
                REGION_MAGIC,
                self.kind,
                self.count_bytes,
                DTYPE_CODES.index(self.dtype),
                len(name),
                self.block_rows,
                self.rows,
                self.values,
                self.body_bytes,
                self.file_id,
                len(self.shape),
                self.checksum,
                self.flags,
                *dims,
            )
            + name
        )

    @classmethod
    def unpack(cls, raw: bytes, name: bytes, version: int = VERSION) -> RegionHeader | None:
        """The header from its fixed part (``region_struct(version).size`` bytes) and its name,
        or ``None`` when it is not well formed. The name length is byte 7 of the fixed part."""
        st = region_struct(version)
        if len(raw) != st.size:
            return None
        magic, kind, cb, code, name_len, block, rows, values, body, *rest = st.unpack(raw)
        if magic != region_magic(version) or kind not in (0, 1) or code >= len(DTYPE_CODES):
            return None
        if len(name) != name_len:
            return None
        try:
            field = name.decode()
        except UnicodeDecodeError:
            return None
        file_id = shape = checksum = None
        flags = 0
        if version != 1:
            file_id, ndim, checksum, flags, *dims = rest
            if ndim > MAX_NDIM or any(dims[ndim:]) or (kind == KIND_RAGGED and ndim):
                return None
            if checksum != CHECKSUM_CRC32C or flags & ~LABEL_OMITTED:
                return None
            if flags and (version != VERSION or kind != KIND_RAGGED):
                return None
            shape = tuple(dims[:ndim])
        return cls(
            field=field,
            kind=kind,
            count_bytes=cb,
            dtype=DTYPE_CODES[code],
            block_rows=block,
            rows=rows,
            values=values,
            body_bytes=body,
            file_id=file_id,
            shape=shape,
            checksum=checksum,
            flags=flags,
            version=version,
        )


def count_dtype(count_bytes: int) -> np.dtype:
    return np.dtype({1: "u1", 2: "<u2", 4: "<u4"}[count_bytes])


def index_bytes(rows: Rows, count_bytes: int, block_rows: int) -> Rows:
    """Bytes of a region's row index; ``rows`` an int or an int64 array of regions."""
    return -(-rows // block_rows) * _OFFSET.itemsize + rows * count_bytes


def values_start(rows: Rows, count_bytes: int, block_rows: int) -> Rows:
    """Offset of the values inside a region body (the index padded to 4 bytes)."""
    return -(-index_bytes(rows, count_bytes, block_rows) // 4) * 4


def check_ragged(counts, values, is_int: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, values)`` as arrays, once they are CSR rows a region can hold: counts a 1-D
    integer array >= 0, values 1-D with ``sum(counts)`` entries (int ones fitting int32);
    else :class:`PayloadInputError`."""
    counts = np.asarray(counts)
    values = np.asarray(values)
    if counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise PayloadInputError(
            f"ragged counts must be a 1-D integer array, got {counts.dtype} {counts.shape}"
        )
    if counts.size and counts.min() < 0:
        bad = int(np.flatnonzero(counts < 0)[0])
        raise PayloadInputError(f"ragged counts must be >= 0; row {bad} has {counts[bad]}")
    total = int(counts.sum())
    if values.ndim != 1 or values.size != total:
        raise PayloadInputError(
            f"ragged values must be 1-D with sum(counts)={total} entries, got shape {values.shape}"
        )
    wide = values.size and (values.min() < -(1 << 31) or values.max() >= 1 << 31)
    if is_int and wide:
        raise PayloadInputError(
            f"ragged int values must fit int32, got [{values.min()}, {values.max()}]"
        )
    return counts, values


def ragged_bytes(
    counts: np.ndarray, values: np.ndarray, *, dtype: str, block_rows: int = BLOCK_ROWS
) -> tuple[bytes, int]:
    """Encode a ragged region body. Returns ``(body, count_bytes)``.

    counts ``[rows]`` (>= 0), values ``[sum(counts)]`` stored as ``dtype`` (a ragged value dtype
    name, :mod:`rollfeed.payload.format.values`).
    """
    counts, values = check_ragged(counts, values, dtype != "float32")
    widest = int(counts.max()) if counts.size else 0
    count_bytes = 1 if widest < 1 << 8 else 2 if widest < 1 << 16 else 4
    rows, per_block = counts.size, _OFFSET.itemsize + block_rows * count_bytes
    index = np.zeros(-(-rows // block_rows) * per_block, np.uint8)
    if rows:
        padded = np.zeros(-(-rows // block_rows) * block_rows, count_dtype(count_bytes))
        padded[:rows] = counts
        blocks = padded.reshape(-1, block_rows)
        offsets = np.concatenate([[0], np.cumsum(blocks.sum(axis=1, dtype=np.int64))[:-1]]).astype(
            _OFFSET
        )
        table = index.reshape(-1, per_block)
        table[:, : _OFFSET.itemsize] = offsets.view(np.uint8).reshape(-1, _OFFSET.itemsize)
        table[:, _OFFSET.itemsize :] = blocks.view(np.uint8).reshape(len(blocks), -1)
    # The last block holds only its own rows: trim the zero tail of lengths past `rows`.
    index = index[: index_bytes(rows, count_bytes, block_rows)]
    pad = values_start(rows, count_bytes, block_rows) - index.size
    body = b"".join([index.tobytes(), bytes(pad), encode_values(values, dtype).tobytes()])
    return body, count_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexTable:
    """Room for the index blocks that cover rows ``[lo[i], hi[i])`` (``hi > lo``) of regions ``i``.

    All arrays are ``[R]`` int64 over the R requests (regions of one ``(count_bytes, block_rows)``
    kind holding ``rows[i]`` rows and ``values[i]`` values). ``table`` is zeroed bytes, so lengths
    past a region's last row read as 0; request ``i`` reads ``span_len[i]`` bytes at body offset
    ``span_start[i]`` into ``table[slot[i]:]``.
    """

    lo: np.ndarray
    hi: np.ndarray
    rows: np.ndarray
    values: np.ndarray
    count_bytes: int
    block_rows: int
    table: np.ndarray
    span_start: np.ndarray
    span_len: np.ndarray
    slot: np.ndarray
    block_base: np.ndarray  # [R + 1] first table block of each request


def index_table(
    lo: np.ndarray,
    hi: np.ndarray,
    rows: np.ndarray,
    values: np.ndarray,
    *,
    count_bytes: int,
    block_rows: int,
) -> IndexTable:
    """Raises :class:`PayloadIndexError` (``.request`` set) for a block larger than both
    :data:`BLOCK_ROWS` and its region's rows: the table holds whole blocks, so such a claim would
    allocate far more than the region's index (a writer never uses one)."""
    big = (block_rows > BLOCK_ROWS) & (block_rows > rows)
    if big.any():
        err = PayloadIndexError(
            f"CSR block of {block_rows} rows is larger than both {BLOCK_ROWS} and the region's "
            f"{int(rows[np.argmax(big)])} rows"
        )
        err.request = int(np.argmax(big))
        raise err
    per_block = _OFFSET.itemsize + block_rows * count_bytes
    k0, k1 = lo // block_rows, (hi - 1) // block_rows
    region_index = index_bytes(rows, count_bytes, block_rows)
    span_start = k0 * per_block
    span_len = np.minimum((k1 + 1) * per_block, region_index) - span_start
    block_base = np.concatenate([[0], np.cumsum(k1 - k0 + 1)])
    return IndexTable(
        lo=lo,
        hi=hi,
        rows=rows,
        values=values,
        count_bytes=count_bytes,
        block_rows=block_rows,
        table=np.zeros(int(block_base[-1]) * per_block, np.uint8),
        span_start=span_start,
        span_len=span_len,
        slot=block_base[:-1] * per_block,
        block_base=block_base,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RowIndex:
    """Lengths and value starts of every requested row, requests one after another.

    counts ``[sum(hi - lo)]``, starts ``[sum(hi - lo)]`` (value index relative to the region's
    values); request ``i``'s rows begin at ``row_base[i]`` (``row_base`` is ``[R + 1]``).
    ``block_start`` / ``block_end`` ``[table blocks]``: the values of each index block read
    (requests one after another, as in :class:`IndexTable`), ``[start, end)`` in value units.
    """

    counts: np.ndarray
    starts: np.ndarray
    row_base: np.ndarray
    block_start: np.ndarray
    block_end: np.ndarray


def decode_index(t: IndexTable) -> RowIndex:
    """Decode a filled :class:`IndexTable` in one vectorised pass.

    Raises :class:`PayloadIndexError` with ``.request`` set to the offending request's index when
    block offsets disagree with the lengths or point outside the region's values.
    """
    per_block, bs = _OFFSET.itemsize + t.block_rows * t.count_bytes, t.block_rows
    blocks = t.table.reshape(-1, per_block)
    offsets = blocks[:, : _OFFSET.itemsize].copy().view(_OFFSET).reshape(-1).astype(np.int64)
    lengths = blocks[:, _OFFSET.itemsize :].copy().view(count_dtype(t.count_bytes)).astype(np.int64)
    nb = np.diff(t.block_base)
    values = np.repeat(t.values, nb)
    ends = offsets + lengths.sum(axis=1)
    bad = (offsets < 0) | (ends > values)
    chained = np.ones(len(offsets), bool)
    chained[t.block_base[:-1]] = False  # a request's first block has no predecessor to chain to
    bad[1:] |= chained[1:] & (offsets[1:] != ends[:-1])
    last = t.block_base[1:] - 1
    final = -(-t.rows // bs) == (t.hi - 1) // bs + 1  # the request reaches the region's end
    bad[last[final]] |= ends[last[final]] != values[last[final]]
    if bad.any():
        block = int(np.flatnonzero(bad)[0])
        i = int(np.searchsorted(t.block_base, block, side="right") - 1)
        k = int(t.lo[i]) // bs + block - int(t.block_base[i])
        err = PayloadIndexError(
            f"CSR row index of block {k} (rows {k * bs}..) is not monotonic or points outside "
            f"the region's {int(t.values[i])} values"
        )
        err.request = i
        raise err
    starts = offsets[:, None] + np.cumsum(lengths, axis=1) - lengths
    n = t.hi - t.lo
    row_base = np.concatenate([[0], np.cumsum(n)])
    first = t.block_base[:-1] * bs + t.lo % bs
    idx = np.repeat(first - row_base[:-1], n) + np.arange(row_base[-1])
    return RowIndex(
        counts=lengths.reshape(-1)[idx],
        starts=starts.reshape(-1)[idx],
        row_base=row_base,
        block_start=offsets,
        block_end=ends,
    )
