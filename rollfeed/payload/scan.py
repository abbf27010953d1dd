"""Walk payload files region by region, for ``python -m rollfeed inspect`` and ``verify``.

Readers never need this (segments point straight at bodies); it exists so that an operator can
see what a payload root holds and check it without any segment records.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from rollfeed.payload.errors import PayloadError
from rollfeed.payload.layout import (
    FILE_HEADER,
    KIND_RAGGED,
    MAGIC,
    REGION_HEADER,
    VERSION,
    RegionHeader,
    decode_index,
    index_table,
    values_start,
)
from rollfeed.payload.segment import ITEMSIZE


@dataclass(frozen=True, kw_only=True, slots=True)
class FileScan:
    """What one payload file holds: its regions, and what is wrong with it (empty when sound)."""

    file: str
    size: int
    mtime: float
    regions: list[tuple[int, RegionHeader]] = field(default_factory=list)  # (body offset, header)
    problems: list[str] = field(default_factory=list)


def payload_files(root: str) -> list[str]:
    """Every ``*.rfp`` under ``root``, relative to it, sorted."""
    found = []
    for here, _, names in os.walk(root):
        found += [os.path.relpath(os.path.join(here, n), root) for n in names if n.endswith(".rfp")]
    return sorted(found)


def scan_file(root: str, rel: str) -> FileScan:
    """Walk the region headers of ``rel`` and decode every CSR index; stop at the first problem."""
    path = os.path.join(root, rel)
    st = os.stat(path)
    scan = FileScan(file=rel, size=st.st_size, mtime=st.st_mtime)
    with open(path, "rb") as f:
        head = f.read(FILE_HEADER.size)
        if len(head) < FILE_HEADER.size or FILE_HEADER.unpack(head)[0] != MAGIC:
            scan.problems.append("bad magic: not a payload file")
            return scan
        if FILE_HEADER.unpack(head)[1] != VERSION:
            scan.problems.append(
                f"format version {FILE_HEADER.unpack(head)[1]}, expected {VERSION}"
            )
            return scan
        at = FILE_HEADER.size
        while at < st.st_size:
            fixed = f.read(REGION_HEADER.size)
            name_len = fixed[7] if len(fixed) == REGION_HEADER.size else 0
            header = RegionHeader.unpack(fixed, f.read(name_len)) if name_len or fixed else None
            if len(fixed) < REGION_HEADER.size or header is None:
                scan.problems.append(f"offset {at}: not a region header")
                return scan
            body_at = at + header.size
            problem = _check_region(f, header, body_at)
            if problem:
                scan.problems.append(f"offset {at} ({header.field}): {problem}")
                return scan
            scan.regions.append((body_at, header))
            at = body_at + header.body_bytes
            f.seek(at)
        if at != st.st_size:
            scan.problems.append(f"last region ends at {at}, file has {st.st_size} bytes")
    return scan


def _check_region(f, header: RegionHeader, body_at: int) -> str | None:
    size = os.fstat(f.fileno()).st_size
    if body_at + header.body_bytes > size:
        return f"body of {header.body_bytes} bytes runs past the end of the file ({size})"
    if header.kind != KIND_RAGGED:
        itemsize = ITEMSIZE[header.dtype]
        if header.rows and (
            header.body_bytes % header.rows or header.body_bytes // header.rows % itemsize
        ):
            return f"{header.body_bytes} bytes do not split into {header.rows} {header.dtype} rows"
        return None
    if header.count_bytes not in (1, 2, 4) or header.block_rows < 1:
        return (
            f"bad ragged layout (count bytes {header.count_bytes}, block rows {header.block_rows})"
        )
    expected = values_start(header.rows, header.count_bytes, header.block_rows) + 4 * header.values
    if header.body_bytes != expected:
        return f"ragged body is {header.body_bytes} bytes, its index says {expected}"
    if header.rows:
        one = np.ones(1, np.int64)
        table = index_table(
            0 * one,
            header.rows * one,
            header.rows * one,
            header.values * one,
            count_bytes=header.count_bytes,
            block_rows=header.block_rows,
        )
        f.seek(body_at)
        table.table[: int(table.span_len[0])] = np.frombuffer(
            f.read(int(table.span_len[0])), np.uint8
        )
        try:
            decode_index(table)
        except PayloadError as err:
            return str(err)
    return None
