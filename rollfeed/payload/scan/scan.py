"""Walk payload files region by region, for ``python -m rollfeed inspect`` and ``verify``.

Readers never need this (segments point straight at bodies); it exists so that an operator can
see what a payload root holds and check it without any segment records.

A scan never hangs, never leaves the root and never allocates more than the file it reads:

- the tree is walked with ``os.scandir`` without following symlinks; a symlink anywhere under the
  root is a finding (readers refuse every symlink, so nothing behind it is readable by handle);
- files are opened with :func:`~rollfeed.payload.stores.safe_open.open_beneath` (no symlink, no FIFO
  blocking ``open``, type checked on the descriptor);
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
import os
from dataclasses import dataclass, field

import numpy as np

from rollfeed.payload.errors import (
    PayloadChecksumError,
    PayloadError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadRegionError,
    PayloadTruncatedError,
)
from rollfeed.payload.format.checksum import ENTRY, RegionSums, table_entries
from rollfeed.payload.format.layout import (
    DTYPE_SIZES,
    FILE_HEADER,
    FILE_HEADER_V1,
    KIND_FIXED,
    KIND_RAGGED,
    RegionHeader,
    decode_index,
    index_table,
    parse_file_header,
    region_struct,
    values_start,
)
from rollfeed.payload.scan.scan_claims import check_claims, malformed
from rollfeed.payload.stores.safe_open import open_beneath

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


def scan_root(root: str, *, checksums: bool = True) -> RootScan:
    """Walk ``root`` (never following a symlink) and scan every ``*.rfp`` file under it;
    ``checksums``: also check every block of every region against its checksum (``verify``),
    which reads every byte (``inspect`` reads headers and CSR indexes only).
    ``s3://bucket/prefix``: the objects under it (:mod:`rollfeed.payload.scan.object_scan`)."""
    if root.startswith("s3://"):
        from rollfeed.payload.scan.object_scan import scan_store

        return scan_store(root, checksums=checksums)
    names, refused = _walk(root)
    scans = []
    for rel in names:
        try:
            scans.append(scan_file(root, rel, checksums=checksums))
        except PayloadMissingFileError as err:
            refused.append(type(err)(f"{err.message}: it vanished during the scan", file=rel))
        except PayloadError as err:  # could not be opened: symlink swapped in, FIFO, ...
            refused.append(err)
    return RootScan(root=root, scans=scans, refused=sorted(refused, key=lambda e: e.file or ""))


def _walk(root: str) -> tuple[list[str], list[PayloadError]]:
    names: list[str] = []
    refused: list[PayloadError] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
                entries = list(it)
        except OSError as err:
            refused.append(_os_finding(err, rel_dir or ".", "directory"))
            continue
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                if entry.is_symlink():
                    refused.append(
                        PayloadPathError(
                            "symlink, not followed: readers never follow symlinks, so nothing "
                            "behind it is readable by handle; put the file itself there",
                            file=rel,
                        )
                    )
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(rel)
                elif entry.name.endswith(SUFFIX):
                    names.append(rel)  # open_beneath refuses a FIFO, socket or device by type
            except OSError as err:
                refused.append(_os_finding(err, rel, "entry"))
    return sorted(names), refused


def _os_finding(err: OSError, rel: str, what: str) -> PayloadError:
    if isinstance(err, FileNotFoundError):
        return PayloadMissingFileError(f"{what} vanished during the scan (pruned?)", file=rel)
    return PayloadPathError(f"{what} cannot be read: {err.strerror}", file=rel)


def scan_file(root: str, rel: str, *, checksums: bool = True) -> FileScan:
    """Walk the region headers of ``rel``, decode every CSR index and (``checksums``) check every
    block of every region; stop at the first problem.

    Raises a :class:`PayloadError` only when the file cannot be opened (missing, a symlink, not a
    regular file); problems with its bytes are returned in :attr:`FileScan.problem`.
    """
    fd = open_beneath(root, rel)
    try:
        st = os.fstat(fd)
        regions: list[tuple[int, RegionHeader]] = []
        try:
            _walk_regions(fd, rel, st.st_size, regions, checksums)
            problem = None
        except PayloadError as err:
            problem = err
        except OSError as err:  # EIO and the like, after the open succeeded
            problem = PayloadIOError(f"read failed: {err.strerror}", file=rel)
        return FileScan(
            file=rel, size=st.st_size, mtime=st.st_mtime, regions=regions, problem=problem
        )
    finally:
        os.close(fd)


def _read(fd: int, rel: str, size: int, at: int, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes at ``at``; ``n`` is bounded by ``size`` before any buffer exists."""
    if at + n > size:
        raise PayloadTruncatedError(
            f"file ends {size - at} bytes into the {n}-byte {what} ({size} bytes in all)",
            file=rel,
            offset=at,
        )
    raw = os.pread(fd, n, at)
    if len(raw) != n:
        raise PayloadTruncatedError(
            f"file shrank during the scan: {len(raw)} of the {n}-byte {what} could be read",
            file=rel,
            offset=at,
        )
    return raw


def _walk_regions(fd: int, rel: str, size: int, regions: list, checksums: bool) -> None:
    if size < FILE_HEADER_V1.size:
        _read(fd, rel, size, 0, FILE_HEADER_V1.size, "file header")  # raises: cut short
    try:
        head = parse_file_header(os.pread(fd, min(size, FILE_HEADER.size), 0))
    except PayloadError as err:
        raise err.with_place(file=rel) from None
    fixed_size = region_struct(head.version).size
    at = head.size
    while at < size:
        k = len(regions)
        fixed = _read(fd, rel, size, at, fixed_size, f"header of region {k}")
        name_len = fixed[7]
        name = _read(fd, rel, size, at + fixed_size, name_len, f"field name of region {k}")
        header = RegionHeader.unpack(fixed, name, head.version)
        if header is None:
            raise malformed(head, fixed, name, rel, at, k)
        if header.file_id != head.file_id:
            raise PayloadRegionError(
                f"region {k}: header field file_id = {header.file_id} differs from the file "
                f"header's {head.file_id} (a region of another file?)",
                file=rel,
                field=header.field,
                offset=at,
            )
        body_at = at + header.size
        check_claims(rel, size, header, at, body_at, k)
        try:
            end = _check_bytes(fd, rel, size, header, fixed + name, at, body_at, k, checksums)
        except PayloadChecksumError as err:
            raise type(err)(f"region {k}: {err.message}", **err.place) from None
        regions.append((body_at, header))
        at = end


def _check_bytes(
    fd: int,
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
        return _read(fd, rel, size, offset, n, what)

    end = body_at + h.body_bytes
    sums = None
    if h.version != 1:
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
