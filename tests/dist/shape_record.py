"""A dispatch mode that records the shape of every tensor an op returns, to prove no ``[S, V]``.

Under DTensor the mode sees the DTensor-level ops (global shapes: a vocabulary-parallel ``[S, V]``
shows as ``[S, V]``), under FSDP2 the all-gathers and the unsharded parameters. A tensor is
``[S, V]``-like when one of its dims is a vocabulary width (the full ``V`` or a TP shard's) and
another a row length (the whole row's or this rank's share): the logits of a row, or their local
vocabulary shard. Parameters ``[V, H]`` do not match as long as no row length equals ``H``.

Example::

    with ShapeRecord() as rec:
        model(input_ids=ids[None]).logits       # records (1, S, V) among others
    rec.matching(vocab={V}, rows={S})           # -> [(1, S, V), ...]
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ShapeRecord(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.shapes.add(tuple(leaf.shape))
        return out

    def matching(self, *, vocab: set[int], rows: set[int]) -> list[tuple[int, ...]]:
        """Recorded shapes with a dim in ``vocab`` and another dim in ``rows``."""
        found = []
        for shape in self.shapes:
            for i, d in enumerate(shape):
                if d in vocab and any(e in rows for j, e in enumerate(shape) if j != i):
                    found.append(shape)
                    break
        return sorted(found)
