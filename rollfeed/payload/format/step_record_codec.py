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
              (:mod:`~rollfeed.payload.format.step_segments`)
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

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.format import step_columns as sc
from rollfeed.payload.format.step_layout import marked_misplaced
from rollfeed.payload.format.step_segments import (
    SEGMENT,
    Strings,
    decode_segment,
    encode_segments,
    text,
)
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
assert RECORD_HEADER.size == 32 and COLUMN.itemsize == 48


def _pad(n: int) -> int:
    return -n % 8


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
    strings = Strings()
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
    segs = encode_segments(record.segments, strings)
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


def _name(strings: Strings, name: object) -> tuple[int, int]:
    if not isinstance(name, str) or not name or len(name.encode()) > 0xFFFF:
        raise PayloadInputError(f"a column name is a non-empty string, got {name!r:.60}")
    return strings(name)


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
        text(strings, t["name_off"], t["name_len"]): text(strings, t["off"], t["len"]) for t in tx
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
        segments=tuple(decode_segment(strings, s) for s in segs),
        spans=own_marked,
        group=group,
    )


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
        name = text(strings, c["name_off"], c["name_len"])
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
