"""Helpers the tests of ``rollfeed.payload`` share: a root that does not wait, kept sets in the
writer's canonical order and what a region stores of them, and a packed micro batch written by
several writers. Plain references of what a read must return are in
:mod:`tests.payload.reference`."""

from __future__ import annotations

import numpy as np
import torch

from rollfeed.payload import PayloadRoot, PayloadWriter, RaggedRows, shift_segments

GROUP = "step_000001"


def fast_root(path, **kw) -> PayloadRoot:
    """A root over ``path`` that never retries (a test of a broken file fails at once)."""
    return PayloadRoot(path, retries=0, **kw)


def kept_sets(rng: np.random.Generator, counts, high: int = 50_000, sampled=None):
    """Kept sets of ``counts [R]`` (>= 1) distinct ids below ``high``, in the canonical order
    the writer stores: per row its sampled token (``sampled[r]`` when given), then the other ids
    ascending. Returns ``(ids [sum(counts)], sampled [R])``."""
    counts = np.asarray(counts, np.int64)
    ids = np.zeros(int(counts.sum()), np.int64)
    at = 0
    for r, c in enumerate(counts.tolist()):
        row = rng.choice(high, c + 1, replace=False)
        if sampled is not None:
            row = np.concatenate([[sampled[r]], row[row != sampled[r]]])
        ids[at : at + c] = [row[0], *np.sort(row[1:c])]
        at += c
    return ids, ids[np.cumsum(counts) - counts]


def stored(counts, ids):
    """What a ``label="omitted"`` region stores of canonical kept sets: ``(counts - 1, ids
    without each row's first)``; read back after each row's label slot (the label given, or the
    fill)."""
    counts = np.asarray(counts, np.int64)
    return counts - 1, np.delete(np.asarray(ids), np.cumsum(counts) - counts)


FIELDS = ("routed_experts", "routed_expert_weights", "sampling_mask", "sampling_mask_logprobs")


def packed_micro_batch(tmp_path, rng, *, files=3, samples=7, unit=4, clip=True):
    """Samples written by ``files`` writers, packed one after another into one row (each slot a
    multiple of ``unit``, so both CP layouts split it); some fields are missing or clipped."""
    writers = [PayloadWriter(tmp_path, group="g", name=f"w{i}") for i in range(files)]
    segs, cu = [], [0]
    for k in range(samples):
        rows = int(rng.integers(1, 300))
        counts = rng.integers(1, 6, rows)
        ids, sampled = kept_sets(rng, counts, 5000)
        arrays = {
            "routed_experts": rng.integers(0, 200, (rows, 2, 3)),
            "routed_expert_weights": rng.random((rows, 2)).astype(np.float32),
            "sampling_mask": (counts, ids),
            "sampling_mask_logprobs": (counts, -rng.random(counts.sum()).astype(np.float32)),
        }
        if k % 3 == 1:
            del arrays["routed_expert_weights"]  # a field some samples lack
        mine = writers[k % files].write(arrays, pos=0, sampled=sampled)
        if clip and k % 4 == 2:  # a record clipped at its tail (truncation)
            mine = [s.model_copy(update={"rows": s.rows // 2}) for s in mine]
        slot = -(-(rows + 1) // unit) * unit
        segs += shift_segments(mine, cu[-1] + 1)
        cu.append(cu[-1] + slot)
    for w in writers:
        w.close()
    return segs, cu


def same_read(a, b) -> bool:
    """Two reads of one field hold bitwise the same values: both :class:`RaggedRows` with equal
    offsets and values (dtype included), or both tensors of one dtype and equal elements."""
    if isinstance(a, RaggedRows) or isinstance(b, RaggedRows):
        return isinstance(a, RaggedRows) and isinstance(b, RaggedRows) and a.equal(b)
    return a.dtype == b.dtype and torch.equal(a, b)
