"""prepare_batch: samples -> micro batches per DP rank (truncate, balance, pack, pad).

Steps, all pure and deterministic (same inputs -> same plan on every rank):

1. Truncate at ``seq_len`` (``overlong``: ``"truncate"`` | ``"drop"`` | ``"error"``, counted).
2. Balance samples over DP ranks by the cost of their slots (linear + quadratic, Karmarkar–Karp
   then refinement, :mod:`rollfeed.collate.balance`); balancing whole samples rather than packed
   bins keeps the granularity fine.
3. Pack each rank's samples First-Fit-Decreasing into micro batches of at most ``seq_len`` tokens
   (zigzag slots padded to ``2 * cp_size`` first), heaviest micro batch first so that the ranks'
   k-th micro steps are alike.
4. Pad each micro batch to a multiple of the pad multiple (default ``cp_size`` for contiguous,
   ``2 * cp_size`` for zigzag) and give short ranks dummy micro batches of that minimum length, so
   every rank runs the same number of micro steps.

Worked example (``seq_len=8``, ``dp_size=2``, lengths ``[5, 3, 6, 2]``, contiguous, cp 1)::

    rank 0: [MicroBatch(indices=(2, 3), length=8)]        cost 6 + 2 (+ quadratic terms)
    rank 1: [MicroBatch(indices=(0, 1), length=8)]        cost 5 + 3
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from rollfeed.collate.balance import DEFAULT_QUADRATIC, partition_costs, sequence_cost
from rollfeed.collate.cp import layout_unit, slot_lengths
from rollfeed.collate.errors import BatchConfigError, OverlongError
from rollfeed.collate.micro_batch import MicroBatch, build_micro_batch, dummy_micro_batch
from rollfeed.collate.pack import pack_ffd
from rollfeed.collate.sample import Sample
from rollfeed.collate.truncate import truncate_sample
from rollfeed.payload import PAYLOAD_FIELDS, PayloadField

logger = logging.getLogger(__name__)
OVERLONG = ("truncate", "drop", "error")


class BatchPlan(list):
    """``plan[dp_rank][micro_step] -> MicroBatch``, plus ``plan.metrics`` (counters, ratios)."""

    def __init__(self, ranks: list[list[MicroBatch]], metrics: dict[str, float]) -> None:
        super().__init__(ranks)
        self.metrics = metrics


def _check_config(seq_len, dp_size, cp_size, cp_layout, pad_to_multiple_of, overlong) -> int:
    unit = layout_unit(cp_size, cp_layout)
    for name, value in (("seq_len", seq_len), ("dp_size", dp_size)):
        if not isinstance(value, int) or value < 1:
            raise BatchConfigError(f"{name} must be an int >= 1, got {value!r}")
    if overlong not in OVERLONG:
        raise BatchConfigError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    pad = unit if pad_to_multiple_of is None else pad_to_multiple_of
    if not isinstance(pad, int) or pad < 1 or pad % unit:
        raise BatchConfigError(
            f"pad_to_multiple_of must be a positive multiple of {unit} ({cp_layout}, "
            f"cp_size={cp_size}), got {pad_to_multiple_of!r}"
        )
    if seq_len % pad:
        raise BatchConfigError(
            f"seq_len={seq_len} is not a multiple of the pad multiple {pad} ({cp_layout}, "
            f"cp_size={cp_size}); choose seq_len = k * {pad}"
        )
    return pad


def prepare_batch(
    samples: Sequence[Sample],
    *,
    seq_len: int,
    dp_size: int,
    cp_size: int = 1,
    cp_layout: Literal["contiguous", "zigzag"] = "contiguous",
    pad_to_multiple_of: int | None = None,
    overlong: Literal["truncate", "drop", "error"] = "truncate",
    quadratic_cost: float = DEFAULT_QUADRATIC,
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
) -> BatchPlan:
    """Plan ``[dp_rank][micro_step]`` micro batches; see the module doc. No I/O.

    ``plan.metrics``: samples, truncated, truncated_tokens, dropped, tokens, padding_tokens,
    padding_fraction, micro_steps, dummy_micro_batches, rank_cost_max, rank_cost_mean,
    rank_cost_max_over_mean.
    """
    pad = _check_config(seq_len, dp_size, cp_size, cp_layout, pad_to_multiple_of, overlong)
    kept: list[Sample] = []
    index: list[int] = []
    truncated = truncated_tokens = dropped = 0
    for i, sample in enumerate(samples):
        sample.check_fields(fields, index=i)
        if len(sample) > seq_len:
            if overlong == "error":
                raise OverlongError(
                    f"sample has {len(sample)} tokens > seq_len={seq_len}; raise seq_len or pass "
                    "overlong='truncate' or 'drop'",
                    sample=i,
                    pos=seq_len,
                )
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
            truncated_tokens += len(sample) - seq_len
            sample = truncate_sample(sample, seq_len)
        kept.append(sample)
        index.append(i)
    lengths = np.fromiter((len(s) for s in kept), np.int64, len(kept))
    slots = slot_lengths(lengths, cp_size, cp_layout)
    costs = sequence_cost(slots, quadratic_cost)
    ranks: list[list[MicroBatch]] = []
    for part in partition_costs(costs, dp_size):
        bins = [[part[j] for j in b] for b in pack_ffd(slots[part], seq_len)] if part else []
        mbs = [
            build_micro_batch(
                [kept[j] for j in b],
                [index[j] for j in b],
                slots[b].tolist(),
                length=-(-int(slots[b].sum()) // pad) * pad,
                cp_size=cp_size,
                cp_layout=cp_layout,
                cost=float(costs[b].sum()),
                fields=fields,
            )
            for b in bins
        ]
        mbs.sort(key=lambda m: -m.cost)  # stable: equal costs keep packing order
        ranks.append(mbs)
    steps = max((len(r) for r in ranks), default=0)
    dummies = 0
    for r in ranks:
        dummies += steps - len(r)
        r += [dummy_micro_batch(pad, cp_size=cp_size, cp_layout=cp_layout)] * (steps - len(r))
    rank_cost = np.array([sum(m.cost for m in r) for r in ranks])
    tokens = int(lengths.sum())
    total = sum(m.length for r in ranks for m in r)
    mean = float(rank_cost.mean())
    metrics = {
        "samples": len(samples),
        "truncated": truncated,
        "truncated_tokens": truncated_tokens,
        "dropped": dropped,
        "tokens": tokens,
        "padding_tokens": total - tokens,
        "padding_fraction": (total - tokens) / total if total else 0.0,
        "micro_steps": steps,
        "dummy_micro_batches": dummies,
        "rank_cost_max": float(rank_cost.max()),
        "rank_cost_mean": mean,
        "rank_cost_max_over_mean": float(rank_cost.max()) / mean if mean else 1.0,
    }
    if truncated or dropped:
        logger.debug("prepare_batch truncated %d and dropped %d samples", truncated, dropped)
    return BatchPlan(ranks, metrics)
