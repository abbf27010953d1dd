"""Ragged values at the narrowest width: choose the stored dtype, encode, decode.

A ragged region of an int-fill field stores its values at the narrowest of ``uint8``, ``uint16``,
``uint24`` (3 bytes, little endian; no NumPy dtype) and ``int32`` that holds them all (``int32``
as soon as one is negative); a float-fill field stores ``float32``. Reads hand out ``int32`` /
``float32`` whatever the width (:attr:`rollfeed.payload.PayloadField.ragged_dtype`).

Example: token ids ``[7, 151_935, 40]`` -> ``uint24``, bytes ``07 00 00 7f 51 02 28 00 00``;
``[7, 40]`` -> ``uint8``; ``[-1, 3]`` -> ``int32``.
"""

from __future__ import annotations

import numpy as np

_LIMITS = (("uint8", 1 << 8), ("uint16", 1 << 16), ("uint24", 1 << 24))


def value_dtype(values: np.ndarray, is_int: bool) -> str:
    """The stored dtype name of a ragged region holding ``values`` (already checked to fit
    int32 / to be floats)."""
    if not is_int:
        return "float32"
    if values.size == 0:
        return "uint8"
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0:
        for name, limit in _LIMITS:
            if hi < limit:
                return name
    return "int32"


def encode_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values [V]`` as the stored bytes: uint8 ``[V * DTYPE_SIZES[dtype]]``."""
    if dtype == "uint24":
        wide = np.ascontiguousarray(values, np.dtype("<u4")).view(np.uint8).reshape(-1, 4)
        return np.ascontiguousarray(wide[:, :3]).reshape(-1)
    return np.ascontiguousarray(values, np.dtype(dtype).newbyteorder("<")).view(np.uint8)


def decode_into(out: np.ndarray, raw: np.ndarray, dtype: str) -> None:
    """Decode stored bytes ``raw`` (uint8 ``[V * size]``, plus one spare byte after them for
    ``uint24``) into ``out [V]`` (int32 / float32) in one pass.

    ``uint24`` reads each value as the little-endian u32 at its 3-byte offset (one byte of the
    next value, or the spare, on top) and masks the top byte off.
    """
    n = out.size
    if dtype == "uint24":
        if n:
            u32 = np.ndarray((n,), np.dtype("<u4"), raw.data, 0, (3,))
            np.bitwise_and(u32, 0xFFFFFF, out=out, casting="unsafe")
        return
    stored = np.dtype(dtype).newbyteorder("<")
    out[...] = raw[: n * stored.itemsize].view(stored)


def spare(dtype: str) -> int:
    """Bytes a buffer of stored values needs after them for :func:`decode_into`."""
    return 1 if dtype == "uint24" else 0
