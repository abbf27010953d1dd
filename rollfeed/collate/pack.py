"""Packing: First-Fit-Decreasing into bins of at most ``capacity`` tokens.

Worked example (capacity 8)::

    pack_ffd([5, 3, 6, 2, 2], 8) -> [[2, 3], [0, 1], [4]]
    # decreasing order 6, 5, 3, 2, 2: 6 opens bin A, 5 opens bin B, 3 joins B, 2 joins A, 2 -> C

Items of equal length keep their input order (a stable sort), so the plan is deterministic.
"""

from __future__ import annotations

import numpy as np


def pack_ffd(lengths: np.ndarray | list[int], capacity: int) -> list[list[int]]:
    """Item indices per bin, bins in opening order, indices ascending inside a bin."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"pack_ffd needs 1 <= length <= capacity={capacity}")
    order = np.argsort(-lengths, kind="stable")
    # One free-space slot per possible bin; slot `opened` always stands for a fresh, empty bin.
    free = np.full(len(lengths) + 1, capacity, dtype=np.int64)
    bins: list[list[int]] = []
    opened = 0
    for i, size in zip(order.tolist(), lengths[order].tolist(), strict=True):
        b = int(np.argmax(free[: opened + 1] >= size))
        if b == opened:
            bins.append([])
            opened += 1
        free[b] -= size
        bins[b].append(i)
    return [sorted(b) for b in bins]
