"""Context-parallel layouts and per-field windows (pure index arithmetic).

A micro batch row of ``S`` tokens is cut into slots (``cu_seqlens``: one per sample, plus the
row's tail padding). CP rank ``r`` of ``c`` holds:

- ``contiguous``: the row cut into ``c`` equal chunks; rank ``r`` takes chunk ``r``.
- ``zigzag``: every slot (a multiple of ``2c`` long) cut into ``2c`` chunks; rank ``r`` takes
  chunks ``r`` and ``2c - 1 - r`` of every slot, slot by slot (TransformerEngine's THD order), which
  balances causal attention work.

Worked example (``cu_seqlens = [0, 8, 12]``, ``c = 2``)::

    rank_ranges(..., 0, 2, "contiguous") -> [(0, 6)]
    rank_ranges(..., 0, 2, "zigzag")     -> [(0, 2), (6, 9), (11, 12)]   # adjacent chunks merge
    field_ranges([(0, 2), (6, 8)], "labels", 12)   -> [(1, 3), (7, 9)]
    field_ranges([(0, 2), (6, 8)], "sequence", 12) -> [(0, 12)]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

import numpy as np

from rollfeed.collate.errors import BatchConfigError

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")
Ranges = list[tuple[int, int]]


def layout_unit(cp_size: int, cp_layout: str) -> int:
    """Smallest length every CP-split unit must be a multiple of: ``c`` or ``2c`` (zigzag)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise BatchConfigError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if cp_layout not in LAYOUTS:
        raise BatchConfigError(f"cp_layout must be one of {LAYOUTS}, got {cp_layout!r}")
    return 2 * cp_size if cp_layout == "zigzag" else cp_size


def slot_lengths(lengths: np.ndarray, cp_size: int, cp_layout: str) -> np.ndarray:
    """``[n]`` slot length of each sample: its length, rounded up to ``2c`` for zigzag."""
    if cp_layout != "zigzag":
        return lengths
    unit = 2 * cp_size
    return -(-lengths // unit) * unit


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in ranges:
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def rank_ranges(cu_seqlens: Sequence[int], cp_rank: int, cp_size: int, cp_layout: str) -> Ranges:
    """Row position ranges rank ``cp_rank`` holds, in the order its tensors store them."""
    unit = layout_unit(cp_size, cp_layout)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise BatchConfigError(
            f"cp_rank {cp_rank!r} is outside [0, {cp_size}) of cp_size={cp_size} ({cp_layout}), "
            "the size the micro batch was planned for; pass this rank's cp coordinate"
        )
    total = int(cu_seqlens[-1])
    if total % unit:
        raise BatchConfigError(
            f"row length {total} is not a multiple of {unit} ({cp_layout}, cp_size={cp_size}); "
            "plan the micro batch with the same cp_size and cp_layout"
        )
    if cp_layout == "contiguous":
        chunk = total // cp_size
        return _merge([(cp_rank * chunk, (cp_rank + 1) * chunk)])
    ranges: Ranges = []
    for a, b in itertools.pairwise(cu_seqlens):
        a, b = int(a), int(b)
        if (b - a) % unit:
            raise BatchConfigError(
                f"slot [{a}, {b}) is not a multiple of {unit}; plan with cp_layout='zigzag'"
            )
        c = (b - a) // unit
        j = unit - 1 - cp_rank
        ranges += [(a + cp_rank * c, a + (cp_rank + 1) * c), (a + j * c, a + (j + 1) * c)]
    return _merge(ranges)


def field_ranges(ranges: Ranges, window: str, seq_len: int, *, whole: bool = False) -> Ranges:
    """Positions a field of ``window`` reads for a rank holding ``ranges`` of a ``seq_len`` row.

    ``labels`` reads one ahead (position ``seq_len`` is past the row and reads as fill);
    ``whole`` reads the whole row (shifted for ``labels``) whatever the rank holds.
    """
    if window == "sequence":
        return [(0, seq_len)]
    if whole:
        ranges = [(0, seq_len)]
    if window == "labels":
        return [(lo + 1, hi + 1) for lo, hi in ranges]
    return list(ranges)


def ranges_index(ranges: Ranges) -> np.ndarray:
    """``[n]`` int64 positions of ``ranges`` concatenated in order."""
    if not ranges:
        return np.zeros(0, np.int64)
    lens = np.array([hi - lo for lo, hi in ranges], np.int64)
    starts = np.array([lo for lo, _ in ranges], np.int64)
    return np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens - starts, lens)


def attention_work(cu_seqlens: Sequence[int], ranges: Ranges) -> int:
    """Causal attention work of a rank: for each query it holds, the keys of its slot before it."""
    cu = np.asarray(cu_seqlens, np.int64)
    q = ranges_index(ranges)
    slot_start = cu[np.searchsorted(cu, q, side="right") - 1]
    return int((q - slot_start + 1).sum())
