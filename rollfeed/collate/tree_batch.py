"""TreeBatch: what one cp rank's forward computes for a micro batch holding prefix trees.

A micro batch with trees (:mod:`rollfeed.collate.tree_row`) keeps every per-token tensor of its
:class:`~rollfeed.collate.TensorMicroBatch` in *flat* coordinates, as if its samples had been
packed one by one (``positions`` are flat-row positions, ``seq_len`` the flat row's length,
``cu_seqlens`` its sample bounds), so losses and objectives read them unchanged. Only the forward
runs on the tree row: ``TensorMicroBatch.tree`` holds this rank's share of it, and ``rows`` maps
each flat row the rank holds to the tree token whose hidden state scores it (the last token of a
shared prefix scores the first token of every branch below it, once per branch).

The cp split cuts the *tree* row (its slots, zigzag included); a rank holds the flat rows whose
tree token it holds, so ranks hold different numbers of flat rows (``flat_counts``). The
``inputs``-window payload fields (routes) and their coverage are over this rank's tree tokens
(``positions`` here): a shared prefix's routes are read once.

Worked example (the tree row of :mod:`rollfeed.collate.tree_row`: a 4-token prompt shared by
samples a and b of 6 and 7 tokens, a flat sample c of 3), contiguous, cp 2::

    tree row       [p0 p1 p2 p3 a4 a5 | b4 b5 b6 c0 c1 c2]           S_tree = 12
    rank 0: tree positions [0..5], flat positions [0..9] (a, and the prompt of b)
            rows [0 1 2 3 4 5 0 1 2 3]                                flat_counts (10, 6)
    rank 1: tree positions [6..11], flat positions [10..15] (b4..b6, c)   rows [0 1 2 3 4 5]

``spans`` (host tuples, the whole tree row): ``starts``, ``depths``, ``lengths``, ``parents``, as
in :class:`~rollfeed.collate.tree_row.TreeRow`; the scorer's tree attention reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TreeBatch:
    """One cp rank's tree-row tokens (see the module doc).

    input_ids, position_ids, positions: ``[n]`` int64 (this rank's tree tokens, in the order it
    stores them; ``n = seq_len // cp_size``). rows: ``[N]`` int64, per flat row of the
    micro batch this rank holds, the index of its tree token among the ``n``. cu_seqlens:
    ``[slots + 1]`` int32, the tree row's slot bounds. seq_len: the tree row's length.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: int
    starts: tuple[int, ...]
    depths: tuple[int, ...]
    lengths: tuple[int, ...]
    parents: tuple[int, ...]
    flat_counts: tuple[int, ...]

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.position_ids, self.positions, self.rows, self.cu_seqlens]

    def apply(self, fn: Callable[[torch.Tensor], Any]) -> TreeBatch:
        """A copy with ``fn`` applied to every tensor."""
        return replace(
            self,
            input_ids=fn(self.input_ids),
            position_ids=fn(self.position_ids),
            positions=fn(self.positions),
            rows=fn(self.rows),
            cu_seqlens=fn(self.cu_seqlens),
        )
