"""One step record's bytes: token ids, mask runs, marked spans, columns, texts and segment records.

Layout (format version 1 of :mod:`rollfeed.payload.format.step_layout`; little endian; the
sections in this order, each padded with zeros to a multiple of 8 bytes where marked ``|8``)::

    header    32 bytes <4sBBHHHIQII  magic b"RREC", id dtype (0 uint8, 1 uint16, 2 uint32,
                                     3 uint64), 0, columns C, texts X, marked spans K, segments
                                     S, tokens T, runs R, string bytes N
    ids       T token ids at the id dtype (the narrowest unsigned one holding the largest)  |8
    runs      R pairs <u4 start, end: the mask's runs, exactly the index row's
    spans     K pairs <u4 start, end: the record's marked spans (a sample's image placeholder
              runs), exactly the index row's
    columns   C descriptors of 48 bytes (COLUMN): name (offset, length into the strings),
              encoding, dtype, stored dtype (codes of :data:`~rollfeed.payload.format.
              step_columns.DTYPES`), row dims n (0..4), rows, stored bytes, dims (4 x u32, unused 0)
    texts     X descriptors of 16 bytes <IIII: name offset, name length, value offset, value
              length (into the strings); the text of empty name is the record's group id
    segments  S descriptors of 128 bytes (SEGMENT): ``field``, ``file`` and ``dtype`` (offset and
              length into the strings), shape dims n (0..4), flags (bit 0: ``ragged`` given,
              bit 1: ``file_id`` given), then int64 ``offset``, ``pos``, ``rows``, ``first``,
              ``file_id``, the ragged layout's ``rows``, ``values``, ``count_bytes``,
              ``block_rows`` (0 when absent), and the shape (4 x int64, unused 0)
    strings   N bytes of UTF-8, the names and values above (each distinct string once)        |8
    data      each column's stored bytes (:mod:`~rollfeed.payload.format.step_columns`), in
              descriptor order, each                                                          |8

Worked example (3 tokens ``[5, 6, 7]``, mask ``[0, 1, 1]``, one column ``advantages`` of three
0.5 float32, no text or segment): header 32; ids 3 bytes |8 -> 8; runs ``[1, 3]`` 8; one column
descriptor 48 (CONST, float32); strings ``b"advantages"`` 10 |8 -> 16; data 4 |8 -> 8: 120
bytes.

Decoding holds every claim to the record's bytes before it allocates: the sections must fill
the record exactly; each column's stored bytes are what its description takes; the columns
decode to at most ``EXPANSION`` times the record's bytes; names are unique UTF-8; a segment
record is validated as :class:`~rollfeed.payload.PayloadSegment` is. What fails is a
``ValueError`` naming it (the reader adds file, offset and record).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
from pydantic import ValidationError

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.format import step_columns as sc
from rollfeed.payload.format.step_layout import marked_misplaced
from rollfeed.payload.segment import PayloadSegment
from rollfeed.payload.step_record import StepRecord

RECORD_MAGIC = b"RREC"
RECORD_HEADER = struct.Struct("<4sBBHHHIQII")
ID_DTYPES = ("uint8", "uint16", "uint32", "uint64")
COLUMN = np.dtype(
    [
        ("name_off", "<u4"),
        ("name_len", "<u2"),
        ("encoding", "u1"),
        ("dtype", "u1"),
        ("stored", "u1"),
        ("ndim", "u1"),
        ("pad", "V2"),
        ("rows", "<u8"),
        ("data", "<u8"),
        ("dims", "<u4", (sc.MAX_DIMS,)),
        ("pad2", "V4"),
    ]
)
TEXT = np.dtype([("name_off", "<u4"), ("name_len", "<u4"), ("off", "<u4"), ("len", "<u4")])
_INTS = ("offset", "pos", "rows", "first", "file_id", "r_rows", "r_values", "r_count", "r_block")
SEGMENT = np.dtype(
    [
        ("field_off", "<u4"),
        ("file_off", "<u4"),
        ("dtype_off", "<u4"),
        ("field_len", "<u2"),
        ("file_len", "<u2"),
        ("dtype_len", "<u2"),
        ("ndim", "u1"),
        ("flags", "u1"),
        ("pad", "V4"),
        *[(k, "<i8") for k in _INTS],
        ("shape", "<i8", (4,)),
    ]
)
assert RECORD_HEADER.size == 32 and COLUMN.itemsize == 48 and SEGMENT.itemsize == 128
_RAGGED, _FILE_ID = 1, 2


def _pad(n: int) -> int:
    return -n % 8


class _Strings:
    """The record's string table: each distinct string once, as ``(offset, length)``."""

    def __init__(self) -> None:
        self.at: dict[str, tuple[int, int]] = {}
        self.parts: list[bytes] = []
        self.size = 0

    def __call__(self, text: str) -> tuple[int, int]:
        got = self.at.get(text)
        if got is None:
            data = text.encode()
            got = self.at[text] = (self.size, len(data))
            self.parts.append(data)
            self.size += len(data)
        return got


def encode_record(record: StepRecord, *, id_dtype: str | None = None) -> bytes:
    """The record's bytes (a multiple of 8); ``id_dtype``: the ids' stored dtype (default the
    narrowest holding the largest id). Malformed parts are :class:`PayloadInputError`."""
    ids = np.asarray(record.ids)
    mask = np.asarray(record.mask)
    T = len(ids)
    if (
        ids.ndim != 1
        or T < 1
        or ids.dtype.kind not in "iu"
        or mask.shape != (T,)
        or mask.dtype != bool
    ):
        raise PayloadInputError(
            f"a step record needs ids [T >= 1] of integers and a bool mask "
            f"[T], got {ids.dtype} {ids.shape} and {mask.dtype} {mask.shape}"
        )
    if ids.min() < 0:
        raise PayloadInputError(f"token id {int(ids.min())} is negative")
    top = int(ids.max())
    id_dtype = id_dtype or next(d for d in ID_DTYPES if top <= np.iinfo(d).max)
    if top > np.iinfo(id_dtype).max:
        raise PayloadInputError(f"token id {top} does not fit the ids' dtype {id_dtype}")
    edges = mask_runs(mask).ravel()
    marked = np.asarray(record.spans, np.int64).reshape(-1, 2)
    bad = marked_misplaced(marked, T)
    if bad is not None or len(marked) > 0xFFFF:
        raise PayloadInputError(
            f"marked spans {marked.tolist()[:8]} are not at most 65535 [start, end) ranges in "
            f"token order, non-empty, inside the record's {T} tokens and not overlapping"
        )
    strings = _Strings()
    cols = np.zeros(len(record.columns), COLUMN)
    encoded = []
    for j, (name, values) in enumerate(record.columns.items()):
        e = sc.encode_column(np.asarray(values), tokens=T)
        encoded.append(e)
        row = (
            *_name(strings, name),
            e.encoding,
            sc.CODES[e.dtype],
            sc.CODES[e.stored],
            len(e.dims),
        )
        for k, v in zip(
            ("name_off", "name_len", "encoding", "dtype", "stored", "ndim"), row, strict=True
        ):
            cols[k][j] = v
        cols["rows"][j], cols["data"][j] = e.rows, len(e.data)
        cols["dims"][j, : len(e.dims)] = e.dims
    texts = dict(record.texts)
    if "" in texts:
        raise PayloadInputError("a text's name is not empty (the empty name is the group id)")
    if record.group is not None:
        texts[""] = record.group
    tx = np.zeros(len(texts), TEXT)
    for j, (name, value) in enumerate(texts.items()):
        tx[j] = (*strings(name), *strings(value))
    segs = _segments(record.segments, strings)
    head = RECORD_HEADER.pack(
        RECORD_MAGIC,
        ID_DTYPES.index(id_dtype),
        0,
        len(cols),
        len(tx),
        len(marked),
        len(segs),
        T,
        len(edges) // 2,
        strings.size,
    )
    ids_bytes = ids.astype(np.dtype(id_dtype).newbyteorder("<")).tobytes()
    parts = [head, ids_bytes, bytes(_pad(len(ids_bytes))), edges.astype("<u4").tobytes()]
    parts.append(marked.astype("<u4").tobytes())
    parts += [cols.tobytes(), tx.tobytes(), segs.tobytes(), *strings.parts]
    parts.append(bytes(_pad(strings.size)))
    for e in encoded:
        parts += [e.data, bytes(_pad(len(e.data)))]
    data = b"".join(parts)
    decoded = sum(sc.decoded_bytes(e.dtype, e.rows, e.dims) for e in encoded)
    if decoded > sc.EXPANSION * len(data):
        raise PayloadInputError(
            f"the record's columns decode to {decoded} bytes, more than {sc.EXPANSION} times its "
            f"{len(data)}: a reader refuses it (many columns of one value each); store them once"
        )
    return data


def mask_runs(mask: np.ndarray) -> np.ndarray:
    """``[R, 2]`` int64: the maximal runs ``[start, end)`` of True in the bool ``mask [T]``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]])))
    return edges.reshape(-1, 2).astype(np.int64)


def _name(strings: _Strings, name: object) -> tuple[int, int]:
    if not isinstance(name, str) or not name or len(name.encode()) > 0xFFFF:
        raise PayloadInputError(f"a column name is a non-empty string, got {name!r:.60}")
    return strings(name)


def _segments(segments, strings: _Strings) -> np.ndarray:
    out = np.zeros(len(segments), SEGMENT)
    for j, s in enumerate(segments):
        if not isinstance(s, PayloadSegment) or len(s.shape) > 4:
            raise PayloadInputError(f"segment {j} is not a PayloadSegment of at most 4 row dims")
        r = s.ragged
        layout = (r.rows, r.values, r.count_bytes, r.block_rows) if r else (0, 0, 0, 0)
        values = (s.offset, s.pos, s.rows, s.first, s.file_id or 0, *layout)
        if not all(-(1 << 63) <= v < 1 << 63 for v in (*values, *s.shape)):
            raise PayloadInputError(f"segment {j} holds an integer beyond int64")
        for key, text in (("field", s.field), ("file", s.file), ("dtype", s.dtype)):
            out[f"{key}_off"][j], out[f"{key}_len"][j] = strings(text)
        out["ndim"][j] = len(s.shape)
        out["flags"][j] = (_RAGGED if r else 0) | (_FILE_ID if s.file_id is not None else 0)
        for k, v in zip(_INTS, values, strict=True):
            out[k][j] = v
        out["shape"][j, : len(s.shape)] = s.shape
    return out


def decode_record(
    data: bytes | memoryview, tokens: int, spans: np.ndarray, marked: np.ndarray | None = None
) -> StepRecord:
    """The record of ``data`` whose index row gives ``tokens``, the mask runs ``spans [R, 2]``
    and the marked spans ``marked [K, 2]`` (default none); ``ValueError`` naming what does not
    hold (module doc). ``policy_version`` and ``shared_prefix`` are the index's: the caller sets
    them."""
    view = memoryview(data)
    size = len(view)
    if size < RECORD_HEADER.size:
        raise ValueError(f"a record of {size} bytes is shorter than its header")
    magic, id_code, _, C, X, K, S, T, R, N = RECORD_HEADER.unpack(view[: RECORD_HEADER.size])
    if magic != RECORD_MAGIC or id_code >= len(ID_DTYPES) or tokens != T:
        raise ValueError(
            f"the record header is not its index row's (magic {bytes(magic)!r}, "
            f"ids code {id_code}, {T} tokens where the index has {tokens})"
        )
    id_dtype = np.dtype(ID_DTYPES[id_code]).newbyteorder("<")
    at = RECORD_HEADER.size
    ids_end = at + T * id_dtype.itemsize
    runs_at = ids_end + _pad(ids_end - at)
    cols_at = runs_at + 8 * R + 8 * K
    strings_at = cols_at + C * COLUMN.itemsize + X * TEXT.itemsize + S * SEGMENT.itemsize
    if strings_at + N > size:
        raise ValueError(
            f"its sections ({T} tokens, {R} runs, {K} spans, {C} columns, {X} texts, {S} "
            f"segments, {N} string bytes) do not fit its {size} bytes"
        )
    own = np.frombuffer(view, "<u4", 2 * R, runs_at).astype(np.int64).reshape(-1, 2)
    if not np.array_equal(own, np.asarray(spans).reshape(-1, 2)):
        raise ValueError(
            f"the record's mask runs {own.tolist()} are not its index row's "
            f"{np.asarray(spans).tolist()}"
        )
    own_marked = np.frombuffer(view, "<u4", 2 * K, runs_at + 8 * R).astype(np.int64).reshape(-1, 2)
    marked = np.zeros((0, 2), np.int64) if marked is None else np.asarray(marked).reshape(-1, 2)
    if not np.array_equal(own_marked, marked):
        raise ValueError(
            f"the record's marked spans {own_marked.tolist()} are not its index row's "
            f"{marked.tolist()}"
        )
    ids = np.frombuffer(view, id_dtype, T, at)
    if id_dtype.itemsize == 8 and T and ids.max() > np.iinfo(np.int64).max:
        raise ValueError("a token id beyond int64")
    cols = np.frombuffer(view, COLUMN, C, cols_at)
    tx = np.frombuffer(view, TEXT, X, cols_at + C * COLUMN.itemsize)
    segs = np.frombuffer(view, SEGMENT, S, cols_at + C * COLUMN.itemsize + X * TEXT.itemsize)
    strings = view[strings_at : strings_at + N]
    columns = _columns(cols, strings, view, strings_at + N + _pad(N), T, size)
    texts = {
        _text(strings, t["name_off"], t["name_len"]): _text(strings, t["off"], t["len"]) for t in tx
    }
    if len(texts) != X:
        raise ValueError("two texts of one name")
    group = texts.pop("", None)
    mask = np.zeros(T, bool)
    for start, end in own.tolist():
        mask[start:end] = True
    return StepRecord(
        ids=ids.astype(np.int64),
        mask=mask,
        columns=columns,
        texts=texts,
        segments=tuple(_segment(strings, s) for s in segs),
        spans=own_marked,
        group=group,
    )


def _text(strings: memoryview, off: int, length: int) -> str:
    off, length = int(off), int(length)  # u4 fields: their sum must not wrap
    if off + length > len(strings):
        raise ValueError(
            f"a string at [{off}, {off + length}) past the {len(strings)} string bytes"
        )
    return bytes(strings[off : off + length]).decode()


def _columns(
    cols: np.ndarray, strings: memoryview, view: memoryview, at: int, T: int, size: int
) -> Mapping[str, np.ndarray]:
    budget = sc.EXPANSION * size
    described = []
    for c in cols:
        enc, ndim = int(c["encoding"]), int(c["ndim"])
        codes = (int(c["dtype"]), int(c["stored"]))
        if enc >= len(sc.ENCODINGS) or max(codes) >= len(sc.DTYPES) or ndim > sc.MAX_DIMS:
            raise ValueError(f"a column of encoding {enc}, dtype codes {codes}, {ndim} row dims")
        dtype, stored = (sc.DTYPES[k] for k in codes)
        dims = tuple(int(d) for d in c["dims"][:ndim])
        rows, nbytes = int(c["rows"]), int(c["data"])
        name = _text(strings, c["name_off"], c["name_len"])
        ok = sc.valid_pair(dtype, stored, enc) and min(dims, default=1) >= 1
        ok = ok and not c["dims"][ndim:].any() and (enc == sc.RAW or rows == T)
        if not ok or sc.stored_bytes(enc, stored, rows, dims, nbytes) != nbytes:
            raise ValueError(
                f"column {name!r} ({sc.ENCODINGS[enc]}, {dtype} stored as {stored}, "
                f"rows {rows}, dims {dims}) does not claim its {nbytes} bytes"
            )
        budget -= sc.decoded_bytes(dtype, rows, dims)
        if budget < 0:
            raise ValueError(
                f"its columns decode to more than {sc.EXPANSION} times its {size} bytes"
            )
        described.append((name, enc, dtype, stored, rows, dims, at, nbytes))
        at += nbytes + _pad(nbytes)
        if at > size:
            raise ValueError(f"column {name!r}'s bytes run past the record's {size}")
    if at != size:
        raise ValueError(f"its sections end at byte {at} of its {size}")
    out = {}
    for name, enc, dtype, stored, rows, dims, start, nbytes in described:
        out[name] = sc.decode_column(enc, dtype, stored, rows, dims, view[start : start + nbytes])
    if len(out) != len(described):
        raise ValueError("two columns of one name")
    return out


def _segment(strings: memoryview, s: np.void) -> PayloadSegment:
    ints = {k: int(s[k]) for k in _INTS}
    unused = [*s["shape"][int(s["ndim"]) :].tolist(), *s["pad"].tobytes()]
    if not s["flags"] & _RAGGED:
        unused += [ints[k] for k in ("r_rows", "r_values", "r_count", "r_block")]
    if not s["flags"] & _FILE_ID:
        unused.append(ints["file_id"])
    if s["ndim"] > 4 or s["flags"] > (_RAGGED | _FILE_ID) or any(unused):
        raise ValueError(
            f"a segment record of {int(s['ndim'])} dims, flags {int(s['flags'])}, or a field it "
            "does not use that is not 0"
        )
    record = {
        "field": _text(strings, s["field_off"], s["field_len"]),
        "file": _text(strings, s["file_off"], s["file_len"]),
        "dtype": _text(strings, s["dtype_off"], s["dtype_len"]),
        **{k: ints[k] for k in ("offset", "pos", "rows", "first")},
        "shape": tuple(int(v) for v in s["shape"][: int(s["ndim"])]),
        "file_id": ints["file_id"] if s["flags"] & _FILE_ID else None,
    }
    if s["flags"] & _RAGGED:
        record["ragged"] = {
            "rows": ints["r_rows"],
            "values": ints["r_values"],
            "count_bytes": ints["r_count"],
            "block_rows": ints["r_block"],
        }
    try:
        return PayloadSegment.model_validate(record)
    except ValidationError as err:
        raise ValueError(f"a segment record that is not one: {err}") from None
