"""The batches planner seen from a loader: plan from lengths, rebuild a micro batch from samples.

The sampler and the collator live in different processes and see different things: the sampler
(main process) has only the step's ``lengths()``, the collator (a worker) only the samples it is
handed. Both reuse :func:`rollfeed.collate.prepare_batch` and its building blocks:

- :func:`plan_step` runs ``prepare_batch`` on token-free stand-ins of the right lengths (views of
  one zero buffer, so no per-sample allocation) and keeps, per DP rank and micro step, the indices
  of the micro batch's samples **in packing order** (empty for a dummy micro batch);
- :func:`rebuild_micro_batch` re-applies the deterministic tail of the planner to the samples in
  that order: truncate at ``seq_len``, slot lengths, pad to the pad multiple, place.

So the indices a sampler yields carry the whole plan, and the collator's micro batch equals the
planner's (same starts, ``cu_seqlens``, length, dummies), hence bitwise equal tensors.

Example (``seq_len=8``, ``dp_size=2``, lengths ``[5, 3, 6, 2]``)::

    plan_step([5, 3, 6, 2], spec, dp_size=2) -> [[(2, 3)], [(0, 1)]]
    rebuild_micro_batch([s2, s3], spec)      -> starts (0, 6), cu_seqlens (0, 6, 8), length 8
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from rollfeed.collate import MicroBatch, Sample, prepare_batch, sequence_cost, truncate_sample
from rollfeed.collate.balance import DEFAULT_QUADRATIC
from rollfeed.collate.cp import layout_unit, slot_lengths
from rollfeed.collate.micro_batch import build_micro_batch, dummy_micro_batch
from rollfeed.payload import PAYLOAD_FIELDS, PayloadField

MicroPlan = list[list[tuple[int, ...]]]  # [dp_rank][micro_step] -> sample positions


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSpec:
    """The planner options the sampler and the collator must share (see ``prepare_batch``)."""

    seq_len: int
    cp_size: int = 1
    cp_layout: Literal["contiguous", "zigzag"] = "contiguous"
    pad_to_multiple_of: int | None = None
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    quadratic_cost: float = DEFAULT_QUADRATIC
    fields: Mapping[str, PayloadField] = field(
        default_factory=lambda: PAYLOAD_FIELDS, compare=False
    )

    def __post_init__(self) -> None:
        self.plan([], dp_size=1)  # the planner's own config checks, with its typed errors

    @property
    def pad(self) -> int:
        """Pad multiple of a micro batch's length (and the length of a dummy micro batch)."""
        if self.pad_to_multiple_of is not None:
            return self.pad_to_multiple_of
        return layout_unit(self.cp_size, self.cp_layout)

    def plan(self, samples: Sequence[Sample], *, dp_size: int):
        return prepare_batch(
            samples,
            seq_len=self.seq_len,
            dp_size=dp_size,
            cp_size=self.cp_size,
            cp_layout=self.cp_layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            overlong=self.overlong,
            quadratic_cost=self.quadratic_cost,
            fields=self.fields,
        )


def plan_step(lengths: np.ndarray | Sequence[int], spec: PlanSpec, *, dp_size: int) -> MicroPlan:
    """``[dp_rank][micro_step]`` positions (into ``lengths``) in packing order; see module doc."""
    lengths = np.asarray(lengths, np.int64)
    longest = int(lengths.max(initial=1))
    ids, mask = np.zeros(longest, np.int64), np.zeros(longest, bool)
    real = np.zeros(longest, np.float32)
    stand_ins = [Sample(ids[:n], mask[:n], real[:n], real[:n]) for n in lengths.tolist()]
    plan = spec.plan(stand_ins, dp_size=dp_size)
    return [[mb.indices for mb in rank] for rank in plan]


def rebuild_micro_batch(samples: Sequence[Sample], spec: PlanSpec) -> MicroBatch:
    """The planner's micro batch for ``samples`` given in packing order (``[]``: the dummy)."""
    if not samples:
        return dummy_micro_batch(spec.pad, cp_size=spec.cp_size, cp_layout=spec.cp_layout)
    kept = []
    for i, s in enumerate(samples):
        s.check_fields(spec.fields, index=i)
        kept.append(truncate_sample(s, spec.seq_len) if len(s) > spec.seq_len else s)
    lengths = np.fromiter((len(s) for s in kept), np.int64, len(kept))
    slots = slot_lengths(lengths, spec.cp_size, spec.cp_layout)
    pad = spec.pad
    return build_micro_batch(
        kept,
        list(range(len(kept))),
        slots.tolist(),
        length=-(-int(slots.sum()) // pad) * pad,
        cp_size=spec.cp_size,
        cp_layout=spec.cp_layout,
        cost=float(sequence_cost(slots, spec.quadratic_cost).sum()),
        fields=spec.fields,
    )
