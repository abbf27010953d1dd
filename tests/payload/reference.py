"""Plain NumPy reference for what read_field must return: positions -> rows, fill elsewhere."""

from __future__ import annotations

import numpy as np


def dense_fixed(length: int, blocks, fill, shape, dtype) -> np.ndarray:
    """blocks: [(pos, array[rows, *shape])] -> [length, *shape] with fill where nothing wrote."""
    out = np.full((length, *shape), fill, dtype)
    for pos, arr in blocks:
        out[pos : pos + len(arr)] = arr
    return out


def dense_ragged(length: int, blocks) -> list[np.ndarray | None]:
    """blocks: [(pos, counts, values)] -> per position the row's values (None: no row)."""
    rows: list[np.ndarray | None] = [None] * length
    for pos, counts, values in blocks:
        starts = np.cumsum(counts) - counts
        for i, (s, c) in enumerate(zip(starts, counts, strict=True)):
            rows[pos + i] = values[s : s + c]
    return rows


def window_positions(ranges) -> np.ndarray:
    return np.concatenate([np.arange(lo, hi) for lo, hi in ranges] or [np.zeros(0, np.int64)])


def read_fixed_ref(dense: np.ndarray, ranges, fill) -> np.ndarray:
    pos = window_positions(ranges)
    out = np.full((len(pos), *dense.shape[1:]), fill, dense.dtype)
    inside = pos < len(dense)
    out[inside] = dense[pos[inside]]
    return out


def read_ragged_ref(
    rows, ranges, fill, dtype, covered: range | None = None, lead: int = 0
) -> np.ndarray:
    """W = max(1, lead + widest row among `covered` positions (all rows of the segments)); each
    row at columns ``lead..`` (``lead = 1``: rows that omit their sampled token)."""
    covered = covered if covered is not None else range(len(rows))
    widest = max([len(rows[p]) for p in covered if rows[p] is not None] + [0])
    pos = window_positions(ranges)
    out = np.full((len(pos), max(1, lead + widest)), fill, dtype)
    for i, p in enumerate(pos):
        if p < len(rows) and p in covered and rows[p] is not None:
            out[i, lead : lead + len(rows[p])] = rows[p]
    return out
