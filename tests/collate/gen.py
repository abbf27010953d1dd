"""Random samples for the collate tests, each built twice: fields inline and by handle.

Routing (``routed_experts`` uint8 ``[T, 2, 2]`` and ``routed_expert_weights`` float32) covers the
forwarded positions ``[0, T - 1)`` and is written as two regions in two files. The sampling mask
(kept sets holding their sampled token, in random order) and its logprobs (ragged) cover the
completion ``[P, T)``, written as one region per request and handed over as two segments split
mid-request (the second one with a clipped head, ``first > 0``).
"""

from __future__ import annotations

import numpy as np

from rollfeed.collate import Sample
from rollfeed.payload import PayloadWriter, clip_segments

LAYERS, TOPK = 2, 2


def _route(rng, n):
    return (
        rng.integers(0, 8, (n, LAYERS, TOPK)).astype(np.uint8),
        rng.random((n, LAYERS, TOPK), dtype=np.float32),
    )


def kept_sets(rng, counts: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """Kept sets of ``counts`` distinct ids below 1000, each holding its sampled token, in no
    particular order (the collate path and the writer order them alike)."""
    rows = []
    for c, y in zip(counts.tolist(), sampled.tolist(), strict=True):
        others = rng.choice(np.setdiff1d(np.arange(1000), [y]), c - 1, replace=False)
        rows.append(rng.permutation(np.concatenate([[y], others])))
    return np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)


def make_pair(rng, T: int, writers: list[PayloadWriter], uid: str) -> tuple[Sample, Sample]:
    """(inline sample, by-handle sample) with equal tokens and equal field contents."""
    # Prompt length; the completion is [P, T). P = 0 often, so that a mask row sits at a sample's
    # position 0, which the last position of the sample packed before it must not read.
    P = 0 if rng.random() < 0.3 else int(rng.integers(0, T))
    base = dict(
        token_ids=rng.integers(0, 1000, T),
        loss_mask=np.arange(T) >= P,
        advantages=rng.standard_normal(T).astype(np.float32),
        inference_logprobs=-rng.random(T, dtype=np.float32),
    )
    temps = rng.choice([0.7, 1.0], T).astype(np.float32) if rng.random() < 0.5 else None
    inline, segs = {}, []
    if T > 1 and rng.random() < 0.8:
        ids, w = _route(rng, T - 1)
        inline["routed_experts"], inline["routed_expert_weights"] = ids, w
        q = int(rng.integers(0, T))  # rows [0, q) in file A, [q, T - 1) in file B
        for wr, lo, hi in ((writers[0], 0, q), (writers[1], q, T - 1)):
            if hi > lo:
                arrays = {"routed_experts": ids[lo:hi], "routed_expert_weights": w[lo:hi]}
                segs += wr.write(arrays, lo)
    if rng.random() < 0.8:
        n = T - P
        counts = rng.choice([1, 1, 2, 3, 7], n)
        sampled = base["token_ids"][P:]
        mask = kept_sets(rng, counts, sampled)
        logp = -rng.random(int(counts.sum()), dtype=np.float32)
        full = np.concatenate([np.zeros(P, np.int64), counts])
        inline["sampling_mask"] = (full, mask)
        inline["sampling_mask_logprobs"] = (full, logp)
        region = writers[int(rng.integers(0, 2))].write(
            {"sampling_mask": (counts, mask), "sampling_mask_logprobs": (counts, logp)},
            P,
            sampled=sampled,
        )
        m = int(rng.integers(P, T + 1))
        segs += clip_segments(region, P, m) + clip_segments(region, m, T)
    a = Sample(**base, temperatures=temps, fields=inline, uid=uid)
    b = Sample(**base, temperatures=temps, payload=segs, uid=uid)
    return a, b


def make_batch(rng, n: int, seq_len: int, writers: list[PayloadWriter]):
    lengths = rng.integers(1, 3 * seq_len + 1, n)
    pairs = [make_pair(rng, int(T), writers, f"s{i}") for i, T in enumerate(lengths)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def inline_batch(rng, n: int, max_len: int) -> list[Sample]:
    """Token-only samples (no payload) of lengths 1..max_len, for planning invariants."""
    out = []
    for i, T in enumerate(rng.integers(1, max_len + 1, n)):
        T = int(T)
        out.append(
            Sample(
                rng.integers(0, 1000, T),
                loss_mask=rng.random(T) < 0.7,
                advantages=rng.standard_normal(T).astype(np.float32),
                inference_logprobs=-rng.random(T, dtype=np.float32),
                uid=f"s{i}",
            )
        )
    return out
