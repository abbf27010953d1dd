"""MicroBatch: one packed, padded row of samples, with its payload segments in row coordinates.

Worked example (samples of 3 and 2 tokens, zigzag with ``cp_size=1`` -> slots padded to 2,
pad multiple 2)::

    starts (0, 4)   cu_seqlens (0, 4, 6)   length 6
    row     [a0 a1 a2 pad | b0 b1]        (slot 0 holds sample a and one padding token)

``segments`` groups the samples' segments per field and shifts them to row positions, on demand
(planning thousands of samples then moves no records; the rank that reads does it for its micro
batches only). ``labels``-window segments are first clipped to ``[1, T)`` of their sample: a label
at the sample's last position ``T - 1`` would read row position ``start + T`` (the next sample's
first token), and position 0 of a sample is never anyone's label, so clipping it away makes that
read fill.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rollfeed.collate.sample import Sample
from rollfeed.payload import PayloadField, PayloadSegment, clip_segments, shift_segments


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MicroBatch:
    """One micro batch of a DP rank; see the module doc. Dummy when it holds no samples."""

    samples: tuple[Sample, ...]  # truncated samples, sample coordinates
    indices: tuple[int, ...]  # position of each sample in the list given to prepare_batch
    starts: tuple[int, ...]  # row position of each sample's first token
    cu_seqlens: tuple[int, ...]  # [num_slots + 1] slot boundaries, 0 .. length
    length: int  # S: tokens in the padded row
    cp_size: int
    cp_layout: str
    cost: float = 0.0  # balance cost of the samples (0 for a dummy)
    label_fields: frozenset[str] = frozenset()  # fields read one ahead: clipped to [1, T)

    @property
    def is_dummy(self) -> bool:
        return not self.samples

    @property
    def segments(self) -> dict[str, tuple[PayloadSegment, ...]]:
        """By-handle segments per field, in row coordinates (see module doc)."""
        grouped: dict[str, list[PayloadSegment]] = {}
        for sample, start in zip(self.samples, self.starts, strict=True):
            for seg in sample.payload:
                if seg.field in self.label_fields:
                    (seg,) = clip_segments([seg], 1, len(sample))
                grouped.setdefault(seg.field, []).extend(shift_segments([seg], start))
        return {k: tuple(v) for k, v in grouped.items()}

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return sum(len(s) for s in self.samples)


def build_micro_batch(
    samples: Sequence[Sample],
    indices: Sequence[int],
    slots: Sequence[int],
    *,
    length: int,
    cp_size: int,
    cp_layout: str,
    cost: float,
    fields: Mapping[str, PayloadField],
) -> MicroBatch:
    """Place ``samples`` in slots of the given lengths, then a tail padding slot to ``length``."""
    cu = [0]
    for n in slots:
        cu.append(cu[-1] + int(n))
    assert cu[-1] <= length, (cu, length)
    starts = tuple(cu[:-1])
    if cu[-1] < length:
        cu.append(length)
    return MicroBatch(
        samples=tuple(samples),
        indices=tuple(indices),
        starts=starts,
        cu_seqlens=tuple(cu),
        length=length,
        cp_size=cp_size,
        cp_layout=cp_layout,
        cost=cost,
        label_fields=frozenset(k for k, f in fields.items() if f.window == "labels"),
    )


def dummy_micro_batch(length: int, *, cp_size: int, cp_layout: str) -> MicroBatch:
    """All padding (one slot), no samples, no segments: nothing to read, nothing to learn."""
    return MicroBatch(
        samples=(),
        indices=(),
        starts=(),
        cu_seqlens=(0, length),
        length=length,
        cp_size=cp_size,
        cp_layout=cp_layout,
    )
