"""Records against the files they point into, vectorised over all records of one read.

Before any byte is read (and before any allocation), every byte range a record claims must lie
inside its file as it is now (:func:`check_room`, and the reader's extent checks), so no offset
arithmetic can wrap around and no buffer is larger than what the files hold. The region header
sits right before each body; the reader reads it in the same batch as the body (one more small
buffer per region, in the same ``preadv`` when adjacent) and :func:`check_regions` holds each
record to it before any byte is handed out: field, kind, dtype, row shape, rows, ragged layout and
file id. A file id that differs is :class:`PayloadStaleFileError` (the root reopens once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rollfeed.payload.errors import (
    PayloadRegionError,
    PayloadSegmentError,
    PayloadStaleFileError,
)
from rollfeed.payload.format.checksum import fixed_block_rows
from rollfeed.payload.format.layout import (
    CHECKSUM_CRC32C,
    DTYPE_CODES,
    FLAGS_AT,
    KIND_FIXED,
    KIND_RAGGED,
    LABEL_OMITTED,
    MAX_NDIM,
    REGION_HEADER,
    REGION_MAGIC,
    REGION_RECORD,
    REGION_RECORD_V1,
    VERSION,
    region_magic,
    values_start,
)
from rollfeed.payload.read.checks import RecordTable

_MAX_EXTENT = 1 << 62


def check_room(t: RecordTable, header_size: np.ndarray, hsize: np.ndarray) -> None:
    """Each record's region header fits between the file header and the body: ``[S]`` columns
    ``header_size`` (the file header's, per record) and ``hsize`` (the region header's)."""
    bad = t.offset - hsize < header_size
    if bad.any():
        i = int(np.argmax(bad))
        raise t.fail(
            PayloadRegionError,
            i,
            f"body offset {int(t.offset[i])} leaves no room for its {int(hsize[i])}-byte region "
            f"header after the {int(header_size[i])}-byte file header",
        )


def check_file_ids(t: RecordTable, file_id: np.ndarray) -> None:
    """Records name the file now open under their name (``file_id [S]``: the open file's id, 0
    for version 1); else :class:`PayloadStaleFileError` (the caller reopens once and asks again).
    A record without a file id is only taken for a version-1 file (which has none): for any
    other it is :class:`PayloadSegmentError`, since nothing could tell a rewritten file apart."""
    missing = (t.file_id == 0) & (file_id != 0)
    if missing.any():
        i = int(np.argmax(missing))
        raise t.fail(
            PayloadSegmentError,
            i,
            "the record carries no file id, but the file under its name has one (format version "
            "2 or 3, whose writers put it in every record): a record without one belongs to a "
            "pre-release format or was made by hand, and a rewritten file could not be told "
            "apart; use the records the writer returned",
        )
    bad = (t.file_id != 0) & (t.file_id != file_id)
    if bad.any():
        i = int(np.argmax(bad))
        raise t.fail(
            PayloadStaleFileError,
            i,
            f"the record was written into file id {int(t.file_id[i])}, but the file now under "
            f"this name has id {int(file_id[i]) or 'none (format version 1)'}: it was replaced "
            "after the record was made (pruned and written again?); use the new records",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionColumns:
    """``S`` region headers as ``[S]`` int64 columns (values past ``2**62`` clamp to it, which no
    record value reaches; file ids are taken as they are). ``file_id`` 0, ``ndim`` -1 and
    ``checksum`` 0 for version-1 headers (not recorded); ``flags`` 0 before version 3."""

    magic_ok: np.ndarray
    name_ok: np.ndarray
    kind: np.ndarray
    count_bytes: np.ndarray
    dtype: np.ndarray
    block_rows: np.ndarray
    rows: np.ndarray
    values: np.ndarray
    body_bytes: np.ndarray
    file_id: np.ndarray
    ndim: np.ndarray
    checksum: np.ndarray
    dims: np.ndarray  # [S, MAX_NDIM]
    pad_ok: np.ndarray  # 1 where the padding bytes are zero, as written
    flags: np.ndarray


_CLAMP = np.uint64(_MAX_EXTENT)


def parse_regions(hbuf: np.ndarray, version: np.ndarray, name: bytes) -> RegionColumns:
    """Parse ``hbuf [S, REGION_HEADER.size + len(name)]`` (uint8; header ``i`` at the start of row
    ``i``, laid out as its file's ``version[i]`` says) into columns."""
    if (version == VERSION).all():  # the common case: no mixing of format versions
        return RegionColumns(
            **{"pad_ok": np.ones(len(hbuf), np.int64), **_parse(hbuf, VERSION, name)}
        )
    n = len(hbuf)
    cols = {k: np.zeros(n, np.int64) for k in _SMALL + _LARGE + ("file_id", "checksum", "flags")}
    cols.update(
        ndim=np.full(n, -1, np.int64),
        dims=np.zeros((n, MAX_NDIM), np.int64),
        magic_ok=np.zeros(n, bool),
        name_ok=np.zeros(n, bool),
        pad_ok=np.ones(n, np.int64),
    )
    for ver in (VERSION, 2, 1):
        m = version == ver
        for key, col in _parse(hbuf[m], ver, name).items():
            cols[key][m] = col
    return RegionColumns(**cols)


_SMALL = ("kind", "count_bytes", "dtype", "block_rows")
_LARGE = ("rows", "values", "body_bytes")


def _parse(hbuf: np.ndarray, version: int, name: bytes) -> dict[str, np.ndarray]:
    record = REGION_RECORD_V1 if version == 1 else REGION_RECORD
    k = record.itemsize
    h = np.ascontiguousarray(hbuf[:, :k]).view(record)[:, 0]
    want = np.frombuffer(name, np.uint8)
    cols = {key: h[key].astype(np.int64) for key in _SMALL}
    cols.update({key: np.minimum(h[key], _CLAMP).astype(np.int64) for key in _LARGE})
    cols["magic_ok"] = h["magic"] == region_magic(version)
    cols["name_ok"] = (h["name_len"] == len(name)) & (hbuf[:, k : k + len(name)] == want).all(1)
    cols["flags"] = np.zeros(len(hbuf), np.int64)
    if version != 1:  # file ids are < 2**63 when valid; others wrap around: a mismatch
        cols.update(file_id=h["file_id"].astype(np.int64), ndim=h["ndim"].astype(np.int64))
        cols.update(checksum=h["checksum"].astype(np.int64), dims=h["dims"].astype(np.int64))
        cols["pad_ok"] = (hbuf[:, FLAGS_AT + 1] == 0).astype(np.int64)
        if version == VERSION:
            cols["flags"] = h["flags"].astype(np.int64)
        else:
            cols["pad_ok"] &= hbuf[:, FLAGS_AT] == 0
    return cols


_ROW_FLOOR = 1 << 16  # a zero-row region may claim rows this large even in a smaller file


def check_regions(
    t: RecordTable,
    hbuf: np.ndarray,
    version: np.ndarray,
    *,
    name: bytes,
    size: np.ndarray,
    file_id: np.ndarray,
    shape: tuple[int, ...] | None,
    ragged: tuple[int, int] | None,
    omitted: bool = False,
) -> None:
    """Every record agrees with its region header, else a typed error naming the first that
    does not, what it claims and what the header says.

    ``hbuf``/``version``: as for :func:`parse_regions`; ``size``/``file_id`` ``[S]``: the
    record's file size and id as opened; fixed-width records pass their row ``shape``, ragged
    ones ``ragged=(count_bytes, block_rows)`` (values of the record's dtype) and ``omitted``
    (the field's rows omit their sampled token: version-3 headers say so). Headers of the
    current version are compared as bytes with what the records determine (a few vectorised
    operations); anything else, or any mismatch, takes the column by column path that names what
    disagrees.
    """
    flags = LABEL_OMITTED if omitted else 0
    if (version == VERSION).all() and not _mismatch(
        t, hbuf, name, size, file_id, shape, ragged, flags
    ):
        return
    _explain(t, parse_regions(hbuf, version, name), version, size, file_id, shape, ragged, flags)


def _mismatch(t, hbuf, name, size, file_id, shape, ragged, flags) -> bool:
    """Whether any version-3 header disagrees with its record (the fast path)."""
    ndim = len(shape) if ragged is None else 0
    if ndim > MAX_NDIM:
        return True
    dims = [*(shape or ()), *[0] * (MAX_NDIM - ndim)]
    kind, cb, block = (KIND_FIXED, 0, 0) if ragged is None else (KIND_RAGGED, *ragged)
    head = REGION_HEADER.pack(
        REGION_MAGIC,
        kind,
        cb,
        0,
        len(name),
        block,
        0,
        0,
        0,
        0,
        ndim,
        CHECKSUM_CRC32C,
        flags if ragged else 0,
        *dims,
    )
    diff = hbuf != np.frombuffer(head + name, np.uint8)
    diff[:, 6] = hbuf[:, 6] != t.dtype
    diff[:, 12:44] = False  # rows, values, body bytes and file id: compared as integers below
    got = hbuf[:, 12:44].view("<i8")  # [S, 4]; a value past 2**63 reads negative: refused
    rows, values, body = got[:, 0], got[:, 1], got[:, 2]
    elems = math.prod(shape) if ragged is None else 0
    row_bytes = t.itemsize * elems
    if ragged is None:  # the checksum block follows each record's row bytes
        diff[:, 8:12] = hbuf[:, 8:12].view("<u4") != fixed_block_rows(row_bytes)[:, None]
    # the header's file id is the record's own (bytes of the very file read vouch for it)
    bad = diff.any(axis=1) | (got[:, 3] != file_id) | (t.first + t.rows > rows)
    bad |= (t.file_id != 0) & (got[:, 3] != t.file_id)
    room = size - t.offset
    if ragged is None:
        q, r = np.divmod(body, row_bytes)
        # once body == rows * row_bytes <= room holds, rows * elems cannot wrap around
        bad |= (r != 0) | (q != rows) | (body > room) | (values != rows * elems)
        if not rows.all():
            bad |= (rows == 0) & (row_bytes > np.maximum(size, _ROW_FLOOR))
    else:
        want = values_start(np.minimum(t.lay_rows, room), cb, block) + t.itemsize * t.lay_values
        bad |= (rows != t.lay_rows) | (values != t.lay_values) | (body != want)
    return bool(bad.any())


def _explain(t, h: RegionColumns, version, size, file_id, shape, ragged, flags) -> None:
    """Raise the typed error for the first record that disagrees with its header, if any."""
    room = size - t.offset  # bytes from the body start to the end of the file (>= 0: checked)
    checks = [
        (~h.magic_ok, lambda i: "no region header (magic) before the body: wrong offset?"),
        (~h.name_ok, lambda i: "the region header is of another field (or not well formed)"),
        # a valid header of another file than the one opened, or than the record's
        (
            (h.file_id != 0)
            & ((h.file_id != file_id) | ((t.file_id != 0) & (h.file_id != t.file_id))),
            None,
        ),
        (h.kind != (KIND_RAGGED if ragged else KIND_FIXED), lambda i: f"kind {h.kind[i]}"),
        (h.dtype != t.dtype, lambda i: f"dtype: {_dtype_name(h.dtype[i])}"),
    ]
    v2 = h.ndim >= 0
    checks.append(
        (v2 & (h.checksum != CHECKSUM_CRC32C), lambda i: f"checksum kind {h.checksum[i]}")
    )
    if ragged is None:
        dims = np.zeros(MAX_NDIM, np.int64)
        dims[: min(len(shape), MAX_NDIM)] = shape[:MAX_NDIM]
        checks.append(
            (
                v2 & ((h.ndim != len(shape)) | (h.dims != dims).any(axis=1)),
                lambda i: f"row shape {tuple(h.dims[i, : max(h.ndim[i], 0)].tolist())}",
            )
        )
        want_block = fixed_block_rows(t.itemsize * math.prod(shape))
        checks.append(
            (
                v2 & (h.block_rows != want_block),
                lambda i: f"checksum blocks of {h.block_rows[i]} rows (not {want_block[i]})",
            )
        )
    checks += [
        (h.body_bytes > room, lambda i: f"a {h.body_bytes[i]}-byte body past the file's end"),
        (t.first + t.rows > h.rows, lambda i: f"{h.rows[i]} rows"),
    ]
    if ragged is None:
        elems = math.prod(shape)
        row_bytes = t.itemsize * elems
        checks += [
            (
                (h.body_bytes % row_bytes != 0) | (h.body_bytes // row_bytes != h.rows),
                lambda i: f"{h.body_bytes[i]} body bytes for {h.rows[i]} rows",
            ),
            (
                (h.values % elems != 0) | (h.values // elems != h.rows),
                lambda i: f"{h.values[i]} values for {h.rows[i]} rows",
            ),
            (
                (h.rows == 0) & (row_bytes > np.maximum(size, _ROW_FLOOR)),
                lambda i: f"no rows, and a {row_bytes[i]}-byte row larger than the whole file",
            ),
        ]
    else:
        cb, block = ragged
        rows, values = np.minimum(t.lay_rows, room), np.minimum(t.lay_values, room)
        body = values_start(rows, cb, block) + t.itemsize * values  # bounded: no wrap-around
        wide = (h.dtype == DTYPE_CODES.index("int32")) | (h.dtype == DTYPE_CODES.index("float32"))
        want_flags = np.where(version == VERSION, flags, 0)
        checks += [
            (
                (version < VERSION) & ~wide,
                lambda i: (
                    f"values of {_dtype_name(h.dtype[i])} in a version-{version[i]} region "
                    "(which stores 4-byte values)"
                ),
            ),
            (
                h.flags != want_flags,
                lambda i: (
                    f"row flags {h.flags[i]} (the field's rows "
                    f"{'omit' if want_flags[i] else 'keep'} their sampled token: {want_flags[i]})"
                ),
            ),
            (h.count_bytes != cb, lambda i: f"count bytes {h.count_bytes[i]}"),
            (h.block_rows != block, lambda i: f"block rows {h.block_rows[i]}"),
            (h.rows != t.lay_rows, lambda i: f"region rows {h.rows[i]}"),
            (h.values != t.lay_values, lambda i: f"region values {h.values[i]}"),
            (h.body_bytes != body, lambda i: f"{h.body_bytes[i]} body bytes"),
            (h.ndim > 0, lambda i: f"a row shape of {h.ndim[i]} dims"),
        ]
    checks.append((h.pad_ok == 0, lambda i: "non-zero padding bytes: not a header as written"))
    bad = checks[0][0].copy()
    for mask, _ in checks[1:]:
        bad |= mask
    if not bad.any():
        return
    i = int(np.argmax(bad))
    says = next(says for mask, says in checks if mask[i])
    if says is None:
        raise t.fail(
            PayloadStaleFileError,
            i,
            f"the region header says file id {h.file_id[i]}, the file was opened with id "
            f"{file_id[i]} and the record names id {t.file_id[i]}: the file was rewritten "
            "in place or replaced while it was read",
        )
    s = t.segs[i]
    claim = f"dtype {s.dtype}, shape {s.shape}, rows [{s.first}, {s.first + s.rows})"
    if s.ragged is not None:
        claim += f", layout {s.ragged.rows} rows / {s.ragged.values} values"
    raise t.fail(
        PayloadRegionError,
        i,
        f"the record disagrees with the region header before its body: the record says "
        f"{claim}; the header says {says(i)}. The record does not point at a region of this "
        "field as written (wrong offset, or a corrupted record or file)",
    )


def _dtype_name(code: int) -> str:
    return DTYPE_CODES[code] if 0 <= code < len(DTYPE_CODES) else f"code {code}"
