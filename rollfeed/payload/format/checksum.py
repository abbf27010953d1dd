"""Checksums per block of each region: what they cover, where they lie, how they are checked.

Every version-2 region ends with a checksum table right after its body: little-endian u32
CRC-32C values, entry 0 for the region header and field name, then one per block of the body
(:mod:`rollfeed.payload.format.layout` has the byte layout and a worked example):

- fixed width: block k = rows ``[k * B, (k + 1) * B)`` with ``B = max(1, 65536 // row_bytes)``
  (the header's ``block_rows``); entry ``1 + k``;
- ragged (CSR): per index block k of ``B`` rows, entry ``1 + 2k`` for the index block's bytes
  (the last one also covers the padding before the values) and ``2 + 2k`` for the values of its
  rows.

A checking read therefore reads and checks whole blocks around the rows it hands out, and no
other: at most one block beyond each end of a window (about 64 KiB of fixed-width rows, or 128
CSR rows). ``verify`` checks every block of every region.

CRC-32C through the ``crc32c`` package: on these machines (2 cores, SSE4.2) it ran at ~10 GB/s
on 64 KiB blocks against ~2 GB/s for ``zlib.crc32`` (CRC-32), ~6.5 GB/s for ``google-crc32c``
(the same CRC-32C values) and ~8.6 GB/s for 64-bit xxh3, which would also double the table. It is
the checksum object stores compute (S3's and GCS's CRC-32C), and a small C extension with wheels
and a software fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.payload.errors import PayloadChecksumError
from rollfeed.payload.format.layout import Rows, index_bytes, values_start

BLOCK_BYTES = 1 << 16  # a fixed-width block's target size
ENTRY = np.dtype("<u4")


def crc(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``value`` (the CRC of the bytes before it)."""
    # Imported on first use (then a sys.modules lookup, ~0.1 us against ~6 us per 64 KiB block):
    # reading or writing checksums needs the package, importing rollfeed (e.g. the models on a
    # machine that only scores) does not.
    import crc32c

    return crc32c.crc32c(data, value)


def fixed_block_rows(row_bytes: Rows) -> Rows:
    """Rows per checksum block of a fixed-width region of ``row_bytes``-byte rows (int or
    int64 array)."""
    if isinstance(row_bytes, np.ndarray):
        return np.maximum(1, BLOCK_BYTES // np.maximum(row_bytes, 1))
    return max(1, BLOCK_BYTES // max(row_bytes, 1))


def table_entries(ragged: bool, rows: Rows, block_rows: Rows) -> Rows:
    """Entries of a region's checksum table (the header's one included)."""
    return 1 + (2 if ragged else 1) * -(-rows // block_rows)


def fixed_table(head: bytes, body: memoryview, rows: int, row_bytes: int) -> bytes:
    """The checksum table of a fixed-width region: ``head`` its header and name, ``body`` its
    ``rows * row_bytes`` body bytes."""
    size = fixed_block_rows(row_bytes) * row_bytes
    out = [crc(head)] + [crc(body[k : k + size]) for k in range(0, rows * row_bytes, size)]
    return np.array(out, ENTRY).tobytes()


def ragged_table(
    head: bytes,
    body: memoryview,
    counts: np.ndarray,
    count_bytes: int,
    block_rows: int,
    value_bytes: int,
) -> bytes:
    """The checksum table of a CSR region: ``counts [rows]`` its row lengths, ``body`` as
    :func:`~rollfeed.payload.format.layout.ragged_bytes` made it, ``value_bytes`` per stored
    value."""
    rows = len(counts)
    out = [crc(head)]
    if rows:
        per = 8 + block_rows * count_bytes
        ib, vs = (
            index_bytes(rows, count_bytes, block_rows),
            values_start(rows, count_bytes, block_rows),
        )
        ends = np.cumsum(
            np.add.reduceat(np.asarray(counts, np.int64), np.arange(0, rows, block_rows))
        )
        starts = ends - np.diff(ends, prepend=0)
        last = len(ends) - 1
        for k, (v0, v1) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            out.append(crc(body[k * per : vs if k == last else min((k + 1) * per, ib)]))
            out.append(crc(body[vs + value_bytes * v0 : vs + value_bytes * v1]))
    return np.array(out, ENTRY).tobytes()


def first_mismatch(
    views: Sequence[memoryview],
    view: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    block: np.ndarray,
    stored: np.ndarray,
) -> tuple[int, int] | None:
    """Check blocks whose bytes lie in pieces ``[P]``: piece ``p`` is ``length[p]`` bytes of
    ``views[view[p]]`` at ``start[p]`` and belongs to block ``block[p]`` (a block's pieces in
    order). Returns ``(block, computed CRC)`` of the first block whose CRC differs from
    ``stored [J]``, or ``None``."""
    got = [0] * len(stored)
    for v, s, n, b in zip(
        view.tolist(), start.tolist(), length.tolist(), block.tolist(), strict=True
    ):
        got[b] = crc(views[v][s : s + n], got[b])
    bad = np.flatnonzero(np.array(got, np.uint64) != stored.astype(np.uint64))
    return (int(bad[0]), got[int(bad[0])]) if len(bad) else None


def mismatch_error(
    *, file: str, field: str, region: int, block: str, offset: int, stored: int, computed: int
) -> PayloadChecksumError:
    """The typed error for a block whose bytes do not match its checksum."""
    return PayloadChecksumError(
        f"checksum mismatch in {'the region header' if block == 'header' else _block(block)} "
        f"of the {field!r} region whose body starts at byte {region}: the table says CRC-32C "
        f"{stored:#010x}, the bytes read give {computed:#010x}. They changed after the writer "
        "wrote them (a disk, memory or copy fault, or an edit): rewrite the payload, or drop the "
        "records that point into it",
        file=file,
        field=field,
        region=region,
        block=block,
        offset=offset,
    )


def _block(label: str) -> str:
    kind, k = label.split()
    return f"{kind} block {k}"


def no_checksums_error(*, file: str, field: str | None, region: int) -> PayloadChecksumError:
    """A checking read of a version-1 region, which keeps no checksums."""
    return PayloadChecksumError(
        "format version 1 keeps no checksums, so this checking read cannot check the region; "
        "read it with PayloadRoot(verify_checksums=False), or rewrite it with this writer",
        file=file,
        field=field,
        region=region,
    )


# --------------------------------------------------------------------------- whole regions (verify)

_CHUNK = 1 << 20  # verify reads a block in pieces of at most this many bytes
Read = Callable[[int, int], bytes]  # (file offset, bytes) -> exactly those bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionSums:
    """The checksum table of one region as ``verify`` checks it: every block, reading through
    ``read`` (bounded by the file) in pieces of at most 1 MiB, so no block is held whole.

    ``region_at``: the header's offset; ``body_at``: the body's; ``stored``: the table ``[E]``.
    """

    file: str
    field: str
    region_at: int
    body_at: int
    stored: np.ndarray

    def _fail(self, j: int, block: str, offset: int, computed: int) -> PayloadChecksumError:
        return mismatch_error(
            file=self.file,
            field=self.field,
            region=self.body_at,
            block=block,
            offset=offset,
            stored=int(self.stored[j]),
            computed=computed,
        )

    def _span(self, read: Read, j: int, block: str, at: int, n: int) -> None:
        value = 0
        for s in range(at, at + n, _CHUNK):
            value = crc(read(s, min(_CHUNK, at + n - s)), value)
        if value != self.stored[j]:
            raise self._fail(j, block, at, value)

    def header(self, head: bytes) -> None:
        """Entry 0: the header and field name ``head``."""
        if crc(head) != self.stored[0]:
            raise self._fail(0, "header", self.region_at, crc(head))

    def fixed(self, read: Read, rows: int, row_bytes: int, block_rows: int) -> None:
        """Every block of a fixed-width body."""
        for k, r in enumerate(range(0, rows, block_rows)):
            at = self.body_at + r * row_bytes
            self._span(read, 1 + k, f"rows {k}", at, (min(r + block_rows, rows) - r) * row_bytes)

    def index(self, index: np.ndarray, pad: bytes, per_block: int) -> None:
        """Every index block of a CSR body (``index``: its bytes, ``pad``: the padding after)."""
        last = -(-len(index) // per_block) - 1
        for k in range(last + 1):
            piece = index[k * per_block : (k + 1) * per_block]
            value = crc(pad, crc(piece)) if k == last else crc(piece)
            if value != self.stored[1 + 2 * k]:
                raise self._fail(1 + 2 * k, f"index {k}", self.body_at + k * per_block, value)

    def values(
        self, read: Read, values_at: int, start: np.ndarray, end: np.ndarray, size: int
    ) -> None:
        """Every values block of a CSR body: block k holds values ``[start[k], end[k])`` of
        ``size`` bytes each."""
        for k, (a, b) in enumerate(zip(start.tolist(), end.tolist(), strict=True)):
            at = self.body_at + values_at + size * a
            self._span(read, 2 + 2 * k, f"values {k}", at, size * (b - a))


# --------------------------------------------------------------------------- checking reads

KINDS = ("header", "rows", "index", "values")  # what a checked block is, by code


@dataclass(frozen=True, kw_only=True, slots=True)
class Entries:
    """Entries ``[0, count[i])`` of the checksum table at byte ``at[i]`` of record ``i``'s file
    (``[S]`` columns), read into one buffer; entry ``e`` of record ``i`` is
    ``stored(i, e)``."""

    at: np.ndarray
    count: np.ndarray
    base: np.ndarray  # [S + 1] first slot of each record
    buf: np.ndarray  # uint8 [4 * sum(count)]

    @classmethod
    def plan(cls, at: np.ndarray, count: np.ndarray) -> Entries:
        base = np.concatenate([[0], np.cumsum(count)])
        return cls(at=at, count=count, base=base, buf=np.zeros(4 * int(base[-1]), np.uint8))

    def reads(self, files, file_idx: np.ndarray):
        """The ranges that fill :attr:`buf` (``files``: a :class:`~rollfeed.payload.stores.lease.
        FieldFiles`; ``file_idx [S]``)."""
        return files.reads(file_idx, self.at, 4 * self.count, [self.buf], 0, 4 * self.base[:-1])

    def stored(self, rec: np.ndarray, entry: np.ndarray) -> np.ndarray:
        return self.buf.view(ENTRY)[self.base[rec] + entry]


def check_blocks(
    segs: Sequence,
    name: str,
    views: Sequence[memoryview],
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    blocks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """Check blocks ``[J]`` whose bytes a checking read holds in ``views``.

    ``pieces = (view, start, length, block)`` ``[P]`` as for :func:`first_mismatch`;
    ``blocks = (rec, kind, k, offset, stored)`` ``[J]``: the record (index into ``segs``) whose
    region holds block ``j``, its kind (index into :data:`KINDS`), number and file offset, and
    the CRC its table holds. Raises :class:`PayloadChecksumError` for the first that differs.
    """
    rec, kind, k, offset, stored = blocks
    hit = first_mismatch(views, *pieces, stored)
    if hit is None:
        return
    j, got = hit
    s = segs[int(rec[j])]
    label = "header" if kind[j] == 0 else f"{KINDS[int(kind[j])]} {int(k[j])}"
    raise mismatch_error(
        file=s.file,
        field=name,
        region=s.offset,
        block=label,
        offset=int(offset[j]),
        stored=int(stored[j]),
        computed=got,
    )


def unique_blocks(
    rec: np.ndarray, k0: np.ndarray, k1: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct ``(record, block)`` pairs of pieces ``[P]`` covering blocks ``k0..k1`` of
    record ``rec``, sorted by record then block: ``(rec [J], k [J], first [P])``, ``first``
    the pair of each piece's first block (its others follow it; any pair for an empty piece,
    ``k1 < k0``)."""
    n = np.maximum(k1 - k0 + 1, 0)
    r = np.repeat(rec, n)
    k = np.repeat(k0 - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    order = np.lexsort((k, r))
    r, k = r[order], k[order]
    keep = np.ones(len(r), bool)
    keep[1:] = (r[1:] != r[:-1]) | (k[1:] != k[:-1])
    pair = np.empty(len(r), np.int64)
    pair[order] = np.cumsum(keep) - 1
    first = pair[np.minimum(np.cumsum(n) - n, len(pair) - 1)] if len(pair) else 0 * n
    return r[keep], k[keep], first
