"""The tree side of :func:`~rollfeed.collate.to_tensor_micro_batch`: a micro batch with prefix
trees as one cp rank's flat rows and tree tokens (:mod:`rollfeed.collate.tree_batch`).

- :func:`place_rank`: the rank's tree-row positions (its cp ranges of the tree row), the flat rows
  whose tree token it holds, and the map between them;
- :class:`Coords` (:func:`tree_coords`): the row a field is read over -- the flat row, or for the
  ``inputs``-window fields the tree row, whose inline rows (:func:`span_rows`) and records
  (``MicroBatch.tree_segments``) are each span's owner's;
- :func:`check_shared_inputs`: every sample below a shared span carries the same ``inputs``-window
  rows over it as the span's owner, by handle identity (the same records, e.g. a prompt's routes
  written once) or else by bytes (their rows read and compared); a difference is a
  :class:`~rollfeed.collate.SharedPrefixError` naming the sample, field and position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rollfeed.collate.cp import Ranges, ranges_index, rank_ranges
from rollfeed.collate.errors import BatchConfigError, SharedPrefixError
from rollfeed.collate.micro_batch import MicroBatch
from rollfeed.collate.tree_batch import TreeBatch
from rollfeed.payload import PayloadRoot, clip_segments, read_fields, shift_segments


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlace:
    """One cp rank's share of a tree micro batch: tree ranges and positions ``tidx [n]``, flat
    positions ``fidx [N]`` (ascending) and ranges, ``rows [N]`` (index into ``tidx``), and the
    flat rows every rank holds."""

    tree_ranges: Ranges
    tidx: np.ndarray
    flat_ranges: Ranges
    fidx: np.ndarray
    rows: np.ndarray
    flat_counts: tuple[int, ...]


def _runs(idx: np.ndarray) -> Ranges:
    """Ascending positions as ranges of consecutive ones."""
    if not idx.size:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    lo = np.concatenate([[0], breaks])
    hi = np.concatenate([breaks, [idx.size]])
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(lo, hi, strict=True)]


def place_rank(mb: MicroBatch, cp_rank: int) -> RankPlace:
    """Rank ``cp_rank``'s share of ``mb`` (which holds a tree row)."""
    tree, config = mb.tree, mb.config
    assert tree is not None
    size, layout = config.cp_size, config.cp_layout
    owner = np.empty(tree.length, np.int64)
    mine: np.ndarray | None = None
    tranges: Ranges = []
    for r in range(size):
        ranges = rank_ranges(tree.cu_seqlens, r, size, layout)
        idx = ranges_index(ranges)
        owner[idx] = r
        if r == cp_rank:
            mine, tranges = idx, ranges
    if mine is None:  # rank_ranges refused cp_rank already unless it is out of range
        raise BatchConfigError(f"cp_rank {cp_rank!r} is outside [0, {size})")
    flat_rows = tree.flat_rows([len(s) for s in mb.samples])
    held = owner[flat_rows]
    fidx = np.flatnonzero(held == cp_rank)
    local = np.empty(tree.length, np.int64)
    local[mine] = np.arange(mine.size)
    return RankPlace(
        tree_ranges=tranges,
        tidx=mine,
        flat_ranges=_runs(fidx),
        fidx=fidx,
        rows=local[flat_rows[fidx]],
        flat_counts=tuple(np.bincount(held, minlength=size).tolist()),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Coords:
    """The row a field is read over: its length, this rank's ranges of it, the by-handle
    segments in its coordinates and the inline rows placed in it (``rows(name, labels)``)."""

    length: int
    ranges: Ranges
    segments: dict
    rows: Callable[[str, bool], Iterator]


def tree_coords(mb: MicroBatch, ranges: Ranges) -> Coords:
    """The tree row as the row ``inputs``-window fields are read over."""
    assert mb.tree is not None
    return Coords(
        length=mb.tree.length,
        ranges=ranges,
        segments=mb.tree_segments,
        rows=lambda name, labels: span_rows(mb, name),
    )


def span_rows(mb: MicroBatch, name: str) -> Iterator[tuple[int, int, object]]:
    """``(sample, tree-row position, rows)`` of each span's inline rows of the ``inputs`` field
    ``name`` (fixed ``[R, ...]`` or ragged ``(counts, values)``), from the span's owner."""
    tree = mb.tree
    assert tree is not None
    for owner, start, depth, n in zip(
        tree.owners, tree.starts, tree.depths, tree.lengths, strict=True
    ):
        data = mb.samples[owner].fields.get(name) if owner >= 0 else None
        if data is not None:
            yield owner, start, _slice(data, depth, depth + n)


def _slice(data, lo: int, hi: int):
    if isinstance(data, tuple):
        counts, values = data
        offsets = np.concatenate([[0], np.cumsum(counts)])
        a, b = min(lo, len(counts)), min(hi, len(counts))
        return counts[a:b], values[offsets[a] : offsets[b]]
    return data[lo:hi]


def tree_tokens(mb: MicroBatch) -> np.ndarray:
    """``[S_tree]`` int64 token ids of the tree row (0 on padding)."""
    tree = mb.tree
    assert tree is not None
    ids = np.zeros(tree.length, np.int64)
    for owner, start, depth, n in zip(
        tree.owners, tree.starts, tree.depths, tree.lengths, strict=True
    ):
        if owner >= 0:
            ids[start : start + n] = mb.samples[owner].token_ids[depth : depth + n]
    return ids


def check_shared_inputs(mb: MicroBatch, names: list[str], root: PayloadRoot | None) -> None:
    """Every sample below a shared span carries its owner's ``inputs``-window rows of each field
    in ``names`` over the span (see the module doc)."""
    tree = mb.tree
    assert tree is not None
    below: dict[int, list[int]] = {}
    for i, path in enumerate(mb.tree.paths):
        for span in path[:-1]:  # a sample's last span is its own
            below.setdefault(span, []).append(i)
    for span, under in below.items():
        owner, depth, n = tree.owners[span], tree.depths[span], tree.lengths[span]
        for name in names:
            mine = _records(mb, owner, name, depth, n)
            for i in under:
                if i == owner or (mine is not None and _records(mb, i, name, depth, n) == mine):
                    continue
                want = _rows_of(mb, owner, name, depth, n, root)
                got = _rows_of(mb, i, name, depth, n, root)
                _compare(want, got, mb, owner, i, name, depth)


def _records(mb: MicroBatch, i: int, name: str, depth: int, n: int):
    """Sample ``i``'s records of ``name`` over ``[depth, depth + n)``, relative to ``depth``
    (None when it holds the field inline)."""
    sample = mb.samples[i]
    if name in sample.fields:
        return None
    segs = [s for s in sample.payload if s.field == name]
    return [s for s in shift_segments(clip_segments(segs, depth, depth + n), -depth) if s.rows]


def _rows_of(mb, i, name, depth, n, root) -> tuple[np.ndarray, np.ndarray]:
    """``(values, covered)`` of sample ``i``'s rows of ``name`` over ``[depth, depth + n)``."""
    sample, spec = mb.samples[i], mb.config.fields[name]
    data = sample.fields.get(name)
    if data is not None:
        part = _slice(data, depth, depth + n)
        if isinstance(part, tuple):
            raise SharedPrefixError(
                "a ragged inputs-window field over a shared prefix is not compared by bytes",
                sample=mb.indices[i],
                field=name,
            )
        covered = np.zeros(n, bool)
        covered[: len(part)] = True
        full = np.full((n, *part.shape[1:]), spec.fill, dtype=part.dtype)
        full[: len(part)] = part
        return full, covered
    segs = _records(mb, i, name, depth, n)
    if not segs:
        return np.zeros(0), np.zeros(n, bool)
    if root is None:
        raise BatchConfigError("micro batch holds payload segments; pass root=", field=name)
    read = read_fields(segs, {name: [(0, n)]}, root=root, fields=mb.config.fields)[name]
    values = read.values
    values = values.numpy() if isinstance(values, torch.Tensor) else values
    return values, read.coverage.numpy().astype(bool)


def _compare(want, got, mb, owner: int, i: int, name: str, depth: int) -> None:
    (wv, wc), (gv, gc) = want, got
    differ = wc != gc
    both = wc & gc
    if wv.shape[1:] == gv.shape[1:] and both.any():
        rows = (wv[both] != gv[both]).reshape(int(both.sum()), -1).any(-1)
        differ[np.flatnonzero(both)[rows]] = True
    elif both.any():
        differ |= both
    if differ.any():
        at = depth + int(np.argmax(differ))
        raise SharedPrefixError(
            f"its {name} rows differ from sample {mb.indices[owner]}'s at token {at} inside the "
            "prefix they were planned to share (computed once, with one set of rows); give the "
            "samples one record of the prefix or plan them without it",
            sample=mb.indices[i],
            field=name,
            pos=at,
        )


def tree_batch(mb: MicroBatch, place: RankPlace) -> TreeBatch:
    """The :class:`TreeBatch` of rank ``place``."""
    tree = mb.tree
    assert tree is not None
    ids, pos = tree_tokens(mb), tree.position_ids()
    return TreeBatch(
        input_ids=torch.from_numpy(ids[place.tidx]),
        position_ids=torch.from_numpy(pos[place.tidx]),
        positions=torch.from_numpy(place.tidx),
        rows=torch.from_numpy(place.rows),
        cu_seqlens=torch.from_numpy(np.asarray(tree.cu_seqlens, np.int32)),
        seq_len=tree.length,
        starts=tree.starts,
        depths=tree.depths,
        lengths=tree.lengths,
        parents=tree.parents,
        flat_counts=place.flat_counts,
    )
