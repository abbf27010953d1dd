"""TreeRow: the row a micro batch holding prefix trees runs through the model.

A micro batch with trees has two rows. Its *flat row* is its samples back to back, as if packed
one by one without padding (``MicroBatch.starts``, ``cu_seqlens``, ``length``): every per-token
field, label and score lines up there. Its *tree row* is what the forward computes: each tree in
one slot (each span once, in preorder), each flat sample in a slot of its own, slots rounded up to
``2 * cp_size`` for zigzag and the row padded to the pad multiple; ``seq_len`` bounds this row.

The tree row is tiled by *spans*: a tree's spans, a flat sample as one root span, and each run
of padding as a root span of its own (``owner = -1``). A token of a span attends to every token of
the span's ancestors and causally within its span; its position id is the span's ``depth`` plus
its offset in the span. ``owner``: the micro batch sample whose tokens (and ``inputs``-window
fields, e.g. routes) the span holds: the first sample below a shared span.

Worked example: samples a (6 tokens) and b (7) share 4 prompt tokens, c (3) is flat; contiguous,
pad 2 (zigzag would round each slot up and add padding spans)::

    flat row   a0..a5 b0..b6 c0..c2                 length 16, cu_seqlens (0, 6, 13, 16)
    tree row   [p0 p1 p2 p3 | a4 a5 | b4 b5 b6] [c0 c1 c2]        length 12, cu_seqlens (0, 9, 12)
    spans      start (0, 4, 6, 9)  depth (0, 4, 4, 0)  length (4, 2, 3, 3)
               parent (-1, 0, 0, -1)  owner (0, 0, 1, 2)
    paths      a: (0, 1)   b: (0, 2)   c: (3,)
    flat_rows  [0 1 2 3 4 5  0 1 2 3 6 7 8  9 10 11]   (tree row position of each flat token)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.collate.prefix_trees import PrefixTree


@dataclass(frozen=True, kw_only=True, slots=True)
class TreeRow:
    """The tree row of a micro batch (see the module doc); every tuple is per span unless named
    otherwise."""

    length: int  # S_tree: tokens in the padded tree row
    cu_seqlens: tuple[int, ...]  # slot bounds of the tree row (the units cp splits)
    starts: tuple[int, ...]  # row position of each span's first token
    depths: tuple[int, ...]  # position id of each span's first token
    lengths: tuple[int, ...]
    parents: tuple[int, ...]  # parent span, -1 for a root
    owners: tuple[int, ...]  # sample whose tokens the span holds, -1 for padding
    paths: tuple[tuple[int, ...], ...]  # per sample: its spans, root first

    def flat_rows(self, sample_lengths: Sequence[int]) -> np.ndarray:
        """``[sum(sample_lengths)]`` int64: the tree row position of each flat-row token."""
        out = []
        for path, n in zip(self.paths, sample_lengths, strict=True):
            for span in path:
                a = self.depths[span]
                b = min(a + self.lengths[span], n)
                out.append(np.arange(self.starts[span], self.starts[span] + b - a))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def position_ids(self) -> np.ndarray:
        """``[S_tree]`` int64: each tree-row token's position in its sample (0 on padding spans'
        first token, counting on)."""
        pos = np.zeros(self.length, np.int64)
        for a, d, n in zip(self.starts, self.depths, self.lengths, strict=True):
            pos[a : a + n] = np.arange(d, d + n)
        return pos


def tree_row(
    lengths: Sequence[int],
    trees: Sequence[tuple[int, PrefixTree]],
    *,
    unit: int,
    pad: int,
) -> TreeRow:
    """The tree row of a micro batch whose samples have ``lengths`` (after truncation), with
    ``trees`` as ``(first sample, tree)``; ``unit``: slot multiple (``2 * cp_size`` for zigzag,
    else 1); ``pad``: the row's pad multiple."""
    at = {first: tree for first, tree in trees}
    starts, depths, sizes, parents, owners = [], [], [], [], []
    paths: list[tuple[int, ...]] = [()] * len(lengths)
    cu, row, i = [0], 0, 0

    def span(start, depth, n, parent, owner) -> int:
        starts.append(start)
        depths.append(depth)
        sizes.append(n)
        parents.append(parent)
        owners.append(owner)
        return len(starts) - 1

    while i < len(lengths):
        tree = at.get(i)
        slot_start = row
        if tree is None:
            paths[i] = (span(row, 0, int(lengths[i]), -1, i),)
            row += int(lengths[i])
            i += 1
        else:
            index: list[int] = []
            first_under = _first_members(tree)
            for k, s in enumerate(tree.spans):
                parent = -1 if s.parent < 0 else index[s.parent]
                owner = i + (s.sample if s.sample >= 0 else first_under[k])
                index.append(span(row, s.start, s.end - s.start, parent, owner))
                row += s.end - s.start
                if s.sample >= 0:
                    path, k2 = [], k
                    while k2 >= 0:
                        path.append(index[k2])
                        k2 = tree.spans[k2].parent
                    paths[i + s.sample] = tuple(reversed(path))
            i += tree.members
        filled = row - slot_start
        slot = -(-filled // unit) * unit
        if slot > filled:
            span(row, 0, slot - filled, -1, -1)
            row = slot_start + slot
        cu.append(row)
    length = max(1, -(-row // pad)) * pad
    if length > row:
        span(row, 0, length - row, -1, -1)
        cu.append(length)
    return TreeRow(
        length=length,
        cu_seqlens=tuple(cu),
        starts=tuple(starts),
        depths=tuple(depths),
        lengths=tuple(sizes),
        parents=tuple(parents),
        owners=tuple(owners),
        paths=tuple(paths),
    )


def _first_members(tree: PrefixTree) -> list[int]:
    """Per span of ``tree``: the first member below it (preorder: the first leaf after it)."""
    out = [0] * len(tree.spans)
    nxt = -1
    for k in range(len(tree.spans) - 1, -1, -1):
        if tree.spans[k].sample >= 0:
            nxt = tree.spans[k].sample
        out[k] = nxt
    return out
