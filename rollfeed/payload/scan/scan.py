"""Walk payload files region by region, for ``python -m rollfeed inspect`` and ``verify``.

Readers never need this (segments point straight at bodies); it exists so that an operator can
see what a payload root holds and check it without any segment records.

A scan never hangs, never leaves the root and never allocates more than the file it reads:

- files are listed and opened through the root's store
  (:class:`~rollfeed.payload.stores.store.Store`): a local tree is walked without following
  symlinks, a symlink anywhere under the root is a finding (readers refuse every symlink, so
  nothing behind it is readable by handle), and a file is opened beneath the root (no symlink, no
  FIFO blocking ``open``, type checked on the descriptor); an object store is listed, and each
  object read by ranged GETs pinned to the ETag seen at open;
- every size a header claims (name length, body bytes, rows, values, count bytes, block rows) is
  checked in Python ints against the bytes the file really has before anything is read or
  allocated for it;
- every problem is a typed :class:`~rollfeed.payload.errors.PayloadError` naming the file and,
  inside a file, the region number, its byte offset, its field and the header field at fault.
  Nothing else escapes: a file that vanishes or cannot be read mid-scan is a finding too.

Worked example (root holding ``step_1/a.rfp`` sound, ``step_1/b.rfp`` cut inside its second
region header, and a symlink ``step_1/c.rfp -> /etc``)::

    r = scan_root(root)
    [s.file for s in r.scans]           -> ["step_1/a.rfp", "step_1/b.rfp"]
    r.scans[1].problem                  -> PayloadTruncatedError("file ends 12 bytes into the
                                           64-byte header of region 1 ...", offset=...)
    r.refused                           -> [PayloadPathError("symlink, not followed ...")]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rollfeed.payload.errors import (
    PayloadChecksumError,
    PayloadError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadRegionError,
    PayloadTruncatedError,
)
from rollfeed.payload.format.checksum import ENTRY, RegionSums, table_entries
from rollfeed.payload.format.layout import (
    DTYPE_SIZES,
    FILE_HEADER,
    KIND_FIXED,
    KIND_RAGGED,
    REGION_HEADER,
    RegionHeader,
    decode_index,
    index_table,
    parse_file_header,
    values_start,
)
from rollfeed.payload.root import PayloadRoot, as_root
from rollfeed.payload.scan.scan_claims import check_claims
from rollfeed.payload.stores.store import Listed, Store, StoreFile

SUFFIX = ".rfp"


@dataclass(frozen=True, kw_only=True, slots=True)
class FileScan:
    """What one opened payload file holds: its regions up to the first problem, and that problem."""

    file: str
    size: int
    mtime: float
    regions: list[tuple[int, RegionHeader]] = field(default_factory=list)  # (body offset, header)
    problem: PayloadError | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RootScan:
    """Every ``*.rfp`` file opened under a root (``scans``, sorted by file) and every entry that
    could not be scanned (``refused``: symlinks, FIFOs and other non-regular files, files or
    directories that vanished or could not be read)."""

    root: str
    scans: list[FileScan]
    refused: list[PayloadError]

    @property
    def entries(self) -> int:
        return len(self.scans) + len(self.refused)

    @property
    def problems(self) -> list[PayloadError]:
        """Every finding, refused entries first, then broken files in file order."""
        return self.refused + [s.problem for s in self.scans if s.problem is not None]


def scan_root(
    root: str | PayloadRoot,
    *,
    checksums: bool = True,
    select: Callable[[str], bool] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> RootScan:
    """Scan every ``*.rfp`` file under ``root`` (a directory, walked without following any
    symlink, or ``s3://bucket/prefix``: credentials from the ``AWS_*`` variables, or a
    :class:`~rollfeed.payload.PayloadRoot`'s own) through its store; ``checksums``: also check
    every block of every region against its checksum (``verify``), which reads every byte
    (``inspect`` reads headers and CSR indexes only).

    ``select(path)``: scan only the listed entries whose path (relative to the root) it accepts;
    the others are neither opened nor reported. ``progress(done, total, nbytes)``: called after
    each listed file, with the files done and selected and the bytes of the files scanned.
    """
    store = as_root(root).store
    listed, refused = store.listing(SUFFIX)
    if select is not None:
        listed = [found for found in listed if select(found.rel)]
        refused = [err for err in refused if select(err.file or ".")]
    scans: list[FileScan] = []
    nbytes = 0
    try:
        for done, found in enumerate(listed, start=1):
            try:
                scans.append(scan_file(store, found, checksums=checksums))
                nbytes += scans[-1].size
            except PayloadMissingFileError as err:
                refused.append(
                    type(err)(f"{err.message}: it vanished during the scan", file=found.rel)
                )
            except PayloadError as err:  # could not be opened: symlink swapped in, FIFO, ...
                refused.append(err)
            if progress is not None:
                progress(done, len(listed), nbytes)
    finally:
        store.close()
    name = root if isinstance(root, str) else root.path
    return RootScan(root=name, scans=scans, refused=sorted(refused, key=lambda e: e.file or ""))


def scan_file(store: Store, found: Listed, *, checksums: bool = True) -> FileScan:
    """Walk the region headers of ``found``, decode every CSR index and (``checksums``) check
    every block of every region; stop at the first problem.

    Raises a :class:`PayloadError` only when the file cannot be opened (missing, a symlink, not a
    regular file); problems with its bytes are returned in :attr:`FileScan.problem`.
    """
    rel = found.rel
    file = store.open_file(rel)
    try:
        regions: list[tuple[int, RegionHeader]] = []
        try:
            _walk_regions(file, rel, file.size, regions, checksums)
            problem = None
        except PayloadError as err:
            problem = err
        except OSError as err:  # EIO and the like, after the open succeeded
            problem = PayloadIOError(f"read failed: {err.strerror}", file=rel)
        return FileScan(
            file=rel, size=file.size, mtime=found.mtime, regions=regions, problem=problem
        )
    finally:
        file.close()


def _read(file: StoreFile, rel: str, size: int, at: int, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes at ``at``; ``n`` is bounded by ``size`` before any buffer exists."""
    if at + n > size:
        raise PayloadTruncatedError(
            f"file ends {size - at} bytes into the {n}-byte {what} ({size} bytes in all)",
            file=rel,
            offset=at,
        )
    raw = file.read(at, n)
    if len(raw) != n:
        raise PayloadTruncatedError(
            f"file shrank during the scan: {len(raw)} of the {n}-byte {what} could be read",
            file=rel,
            offset=at,
        )
    return raw


def _walk_regions(file: StoreFile, rel: str, size: int, regions: list, checksums: bool) -> None:
    if size < FILE_HEADER.size:
        _read(file, rel, size, 0, FILE_HEADER.size, "file header")  # raises: cut short
    try:
        file_id = parse_file_header(file.read(0, FILE_HEADER.size))
    except PayloadError as err:
        raise err.with_place(file=rel) from None
    fixed_size = REGION_HEADER.size
    at = FILE_HEADER.size
    while at < size:
        k = len(regions)
        fixed = _read(file, rel, size, at, fixed_size, f"header of region {k}")
        name_len = fixed[7]
        name = _read(file, rel, size, at + fixed_size, name_len, f"field name of region {k}")
        try:
            header = RegionHeader.unpack(fixed, name)
        except PayloadRegionError as err:
            raise type(err)(f"region {k} is {err.message}", file=rel, offset=at) from None
        if header.file_id != file_id:
            raise PayloadRegionError(
                f"region {k}: header field file_id = {header.file_id} differs from the file "
                f"header's {file_id} (a region of another file?)",
                file=rel,
                field=header.field,
                offset=at,
            )
        body_at = at + header.size
        check_claims(rel, size, header, at, body_at, k)
        try:
            end = _check_bytes(file, rel, size, header, fixed + name, at, body_at, k, checksums)
        except PayloadChecksumError as err:
            raise type(err)(f"region {k}: {err.message}", **err.place) from None
        regions.append((body_at, header))
        at = end


def _check_bytes(
    file: StoreFile,
    rel: str,
    size: int,
    h: RegionHeader,
    head: bytes,
    at: int,
    body_at: int,
    k: int,
    checksums: bool,
) -> int:
    """Decode the CSR index of a region whose claims hold, and with ``checksums`` check every
    block against the region's checksum table. Returns the offset where the region ends."""

    def bad(what: str, kind: type[PayloadError] = PayloadRegionError) -> PayloadError:
        return kind(f"region {k}: {what}", file=rel, field=h.field, offset=at)

    def read(offset: int, n: int, what: str = f"body of region {k}") -> bytes:
        return _read(file, rel, size, offset, n, what)

    end = body_at + h.body_bytes
    sums = None
    n = 4 * table_entries(h.kind == KIND_RAGGED, h.rows, h.block_rows)
    if end + n > size:
        raise bad(
            f"its {n}-byte checksum table runs past the end of the file (only {size - end} "
            "bytes follow the body; cut short)",
            PayloadTruncatedError,
        )
    if checksums:
        stored = np.frombuffer(read(end, n, f"checksum table of region {k}"), ENTRY)
        sums = RegionSums(file=rel, field=h.field, region_at=at, body_at=body_at, stored=stored)
        sums.header(head)
    end += n
    if h.kind == KIND_FIXED:
        if sums is not None:
            row_bytes = DTYPE_SIZES[h.dtype] * math.prod(h.shape or ())
            sums.fixed(read, h.rows, row_bytes, h.block_rows)
        return end
    if h.rows == 0:
        return end
    one = np.ones(1, np.int64)
    table = index_table(
        0 * one,
        h.rows * one,
        h.rows * one,
        h.values * one,
        count_bytes=h.count_bytes,
        block_rows=h.block_rows,
    )
    n = int(table.span_len[0])
    table.table[:n] = np.frombuffer(read(body_at, n, f"index of region {k}"), np.uint8)
    try:
        index = decode_index(table)  # a structural finding is named before a checksum one
    except PayloadError as err:
        raise bad(err.message, type(err)) from None
    if sums is not None:
        vs = values_start(h.rows, h.count_bytes, h.block_rows)
        sums.index(table.table[:n], read(body_at + n, vs - n), 8 + h.block_rows * h.count_bytes)
        sums.values(read, vs, index.block_start, index.block_end, DTYPE_SIZES[h.dtype])
    return end
