"""A step record's arrays, each stored at the narrowest of four encodings, and read back bounded.

A column is a named array ``[rows, *dims]`` (at most 4 row dims) of one of the dtypes of
:data:`DTYPES` (its *dtype*, what a reader gets back). It is stored in one of four encodings:

- ``RAW`` (0): the values at the *stored* dtype, C order. An integer column is stored at the
  narrowest integer dtype holding its smallest and largest value (unsigned when none is negative),
  a float or bool column at its own dtype: ``[8192]`` int64 token ids below 151,936 are stored as
  uint32, 4 bytes each;
- ``CONST`` (1): one value at the stored dtype, for a 1-D column of the record's tokens whose
  values are all the same bytes (a per-sample advantage: 4 bytes for the whole sample);
- ``RUNS`` (2): a 1-D bool column of the record's tokens as ``<u4`` pairs ``start, end`` of its
  runs of True (a loss mask of one completion: 8 bytes);
- ``BITS`` (3): a 1-D bool column of the record's tokens as bits, 8 per byte, least significant
  first, unused bits 0.

Each bool column takes the smallest of CONST, RUNS and BITS. Decoding is bounded before it
allocates: a column's stored bytes are exactly what its rows, dims and encoding take; CONST, RUNS
and BITS columns hold exactly the record's tokens; and the record's columns together never decode
to more than :data:`EXPANSION` times the record's bytes (a token id takes at least one byte of
them), so a few bytes cannot claim gigabytes.

Example::

    encode_column(np.full(8, 0.5, np.float32), tokens=8)
        -> Encoded(encoding=CONST, dtype="float32", stored="float32", data=b"\\x00\\x00\\x00?")
    encode_column(np.array([0, 1, 1, 0] * 2, bool), tokens=8)
        -> Encoded(encoding=BITS, dtype="bool", stored="uint8", data=b"f")
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rollfeed.payload.errors import PayloadInputError

RAW, CONST, RUNS, BITS = 0, 1, 2, 3
ENCODINGS = ("raw", "const", "runs", "bits")
DTYPES = (
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
)
CODES = {name: code for code, name in enumerate(DTYPES)}
MAX_DIMS = 4  # row dims a column may have
EXPANSION = 64  # a record's columns decode to at most this many times its bytes
_UNSIGNED = ("uint8", "uint16", "uint32", "uint64")
_SIGNED = ("int8", "int16", "int32", "int64")


@dataclass(frozen=True, kw_only=True, slots=True)
class Encoded:
    """One column as stored: ``encoding``, its ``dtype`` and ``stored`` dtype names, ``rows``,
    ``dims`` (row shape) and ``data`` (the stored bytes)."""

    encoding: int
    dtype: str
    stored: str
    rows: int
    dims: tuple[int, ...]
    data: bytes


def narrowest(low: int, high: int, dtype: str) -> str:
    """The narrowest integer dtype holding ``[low, high]`` that a column of integer ``dtype`` may
    be stored at (:func:`valid_pair`): unsigned ones first when ``low >= 0``."""
    for name in (*(_UNSIGNED if low >= 0 else ()), *_SIGNED):
        info = np.iinfo(name)
        if info.min <= low and high <= info.max and valid_pair(dtype, name, RAW):
            return name
    return dtype


def encode_column(values: np.ndarray, *, tokens: int) -> Encoded:
    """``values`` at their narrowest encoding (see the module doc); ``tokens``: the record's."""
    arr = np.ascontiguousarray(values)
    name = arr.dtype.name
    if name not in CODES or arr.ndim < 1 or arr.ndim > MAX_DIMS + 1:
        raise PayloadInputError(
            f"a step record column is an array of 1 to {MAX_DIMS + 1} dims of one of {DTYPES}, "
            f"got {name} of shape {arr.shape}"
        )
    rows, dims = arr.shape[0], tuple(arr.shape[1:])
    per_token = arr.ndim == 1 and rows == tokens and rows > 0
    if name == "bool":
        if not per_token:
            return Encoded(
                encoding=RAW, dtype=name, stored=name, rows=rows, dims=dims, data=arr.tobytes()
            )
        return _bool_column(arr)
    stored = name
    if arr.dtype.kind in "iu" and arr.size:
        stored = narrowest(int(arr.min()), int(arr.max()), name)
    raw = arr.astype(stored).reshape(-1)
    if (
        per_token
        and rows > 1
        and (raw.view(f"u{raw.itemsize}") == raw.view(f"u{raw.itemsize}")[0]).all()
    ):
        return Encoded(
            encoding=CONST,
            dtype=name,
            stored=stored,
            rows=rows,
            dims=(),
            data=raw[:1].astype(raw.dtype.newbyteorder("<")).tobytes(),
        )
    data = raw.astype(raw.dtype.newbyteorder("<")).tobytes()
    return Encoded(encoding=RAW, dtype=name, stored=stored, rows=rows, dims=dims, data=data)


def _bool_column(mask: np.ndarray) -> Encoded:
    rows = len(mask)
    if mask.all() or not mask.any():
        return Encoded(
            encoding=CONST,
            dtype="bool",
            stored="bool",
            rows=rows,
            dims=(),
            data=bytes([int(mask[0])]),
        )
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.view(np.int8), [0]])))
    runs = edges.astype("<u4").tobytes()
    bits = np.packbits(mask, bitorder="little").tobytes()
    if len(runs) < len(bits):
        return Encoded(encoding=RUNS, dtype="bool", stored="uint32", rows=rows, dims=(), data=runs)
    return Encoded(encoding=BITS, dtype="bool", stored="uint8", rows=rows, dims=(), data=bits)


def stored_bytes(encoding: int, stored: str, rows: int, dims: tuple[int, ...], data: int) -> int:
    """The bytes a column of this description must store (``data``: what it claims, needed for
    RUNS, whose run count only its bytes give); -1 for a description no writer makes."""
    size = np.dtype(stored).itemsize
    if encoding == RAW:
        return rows * math.prod(dims) * size
    if dims:
        return -1
    if encoding == CONST:
        return size
    if encoding == RUNS:
        return data if stored == "uint32" and data % 8 == 0 else -1
    if encoding == BITS:
        return -(-rows // 8) if stored == "uint8" else -1
    return -1


def valid_pair(dtype: str, stored: str, encoding: int) -> bool:
    """Whether a column of ``dtype`` may be stored at ``stored`` in ``encoding``."""
    if dtype == "bool":
        return (encoding, stored) in (
            (RAW, "bool"),
            (CONST, "bool"),
            (RUNS, "uint32"),
            (BITS, "uint8"),
        )
    if encoding not in (RAW, CONST):
        return False
    if np.dtype(dtype).kind == "f":
        return stored == dtype
    if np.dtype(stored).kind not in "iu":
        return False
    if stored == "uint64" and dtype == "int64":
        return True  # ids and counts of int64 columns: values beyond int64 are refused at decode
    low, high = np.iinfo(stored).min, np.iinfo(stored).max
    return np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max


def decode_column(
    encoding: int, dtype: str, stored: str, rows: int, dims: tuple[int, ...], data: memoryview
) -> np.ndarray:
    """The column ``[rows, *dims]`` at ``dtype`` from its stored ``data`` (already held to
    :func:`stored_bytes`); ``ValueError`` naming what is wrong for values that no writer makes
    (a bool byte other than 0 or 1, runs out of order, bits past the rows, uint64 values beyond
    int64)."""
    raw = np.frombuffer(data, np.dtype(stored).newbyteorder("<"))
    if encoding == CONST:
        out = np.full(rows, raw[0], dtype=stored)
    elif encoding == RUNS:
        out = _runs_mask(raw.astype(np.int64), rows)
    elif encoding == BITS:
        if rows % 8 and raw[-1] >> (rows % 8):
            raise ValueError("bits set past the column's rows")
        out = np.unpackbits(raw, count=rows, bitorder="little").view(bool)
    else:
        out = raw.reshape(rows, *dims)
    if stored == "bool" and (out.view(np.uint8) > 1).any():
        raise ValueError("a bool byte other than 0 or 1")
    if stored == "uint64" and dtype == "int64" and (out > np.iinfo(np.int64).max).any():
        raise ValueError("uint64 values beyond int64")
    return out.astype(dtype)


def _runs_mask(edges: np.ndarray, rows: int) -> np.ndarray:
    starts, ends = edges[0::2], edges[1::2]
    prev = np.concatenate([[-1], ends[:-1]])
    if ((starts >= ends) | (ends > rows) | (starts <= prev)).any():
        raise ValueError(
            "runs that are not [start, end) ranges in order, apart and inside the rows"
        )
    delta = np.zeros(rows + 1, np.int8)
    delta[starts] = 1
    delta[ends] -= 1
    return np.cumsum(delta[:-1], dtype=np.int8).view(bool)


def decoded_bytes(dtype: str, rows: int, dims: tuple[int, ...]) -> int:
    """Bytes a column decodes to."""
    return rows * math.prod(dims) * np.dtype(dtype).itemsize
