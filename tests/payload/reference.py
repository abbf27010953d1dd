"""Plain NumPy reference for what read_field must return: positions -> rows; the fill (fixed
fields) or an empty row (ragged fields) where no record covers the position."""

from __future__ import annotations

import itertools

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
    rows, ranges, dtype, covered: range | None = None, lead: int = 0, labels=None, fill=-1
) -> tuple[np.ndarray, np.ndarray]:
    """The window's rows as ``(offsets [n + 1] int64, values [nnz])``: a window row whose
    position a record covers (in ``covered``, the records' live positions) holds its stored
    values, after one label slot when ``lead = 1`` (``labels[i]`` of window row ``i``, or
    ``fill``); any other row is empty."""
    covered = covered if covered is not None else range(len(rows))
    lengths, values = [], []
    for i, p in enumerate(window_positions(ranges).tolist()):
        row = rows[p] if p < len(rows) and p in covered else None
        if row is None:
            lengths.append(0)
            continue
        head = [fill if labels is None else int(labels[i])] if lead else []
        values += head + list(row)
        lengths.append(len(head) + len(row))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    return offsets, np.array(values, dtype)


def widest_ref(rows, covered: range | None = None, lead: int = 0) -> int:
    """The widest row among the records' rows (``covered``), its label slot included; 0 when
    no record holds a row."""
    covered = covered if covered is not None else range(len(rows))
    held = [lead + len(rows[p]) for p in covered if p < len(rows) and rows[p] is not None]
    return max(held, default=0)


def padded_ref(offsets: np.ndarray, values: np.ndarray, width: int, fill) -> np.ndarray:
    """``[n, width]``: row ``i`` (``values[offsets[i]:offsets[i + 1]]``) left-aligned, ``fill``
    after it."""
    out = np.full((len(offsets) - 1, width), fill, values.dtype)
    for i, (a, b) in enumerate(itertools.pairwise(offsets.tolist())):
        out[i, : b - a] = values[a:b]
    return out


def row_lists(rows) -> list[list]:
    """A :class:`~rollfeed.payload.RaggedRows` as a list of its rows (lists of values)."""
    off, val = rows.offsets.tolist(), rows.values.tolist()
    return [val[a:b] for a, b in itertools.pairwise(off)]
