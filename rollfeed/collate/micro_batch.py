"""MicroBatch and its placement: one packed, padded row of samples, with its payload segments.

:func:`place_micro_batch` lays out one planned micro batch's samples (in packing order, as
:func:`~rollfeed.collate.plan_lengths` lists them): each truncated at ``seq_len`` in a slot of its
length (rounded up to ``2 * cp_size`` for zigzag), the row padded to ``config.pad`` by a tail slot;
no samples give a dummy of ``config.pad`` tokens. The micro batch records its config and, when
planned with them, its step's loss-token counts (:mod:`rollfeed.collate.step_counts`), held to its
samples: each sample's count must be what its truncated ``loss_mask`` brings.

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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.collate.config import PlanConfig
from rollfeed.collate.cp import slot_lengths
from rollfeed.collate.errors import OverlongError, SampleValueError
from rollfeed.collate.image_runs import image_cut
from rollfeed.collate.sample import Sample
from rollfeed.collate.step_counts import StepCounts
from rollfeed.collate.truncate import truncate_sample
from rollfeed.payload import ImageSpan, PayloadSegment, clip_segments, shift_segments


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MicroBatch:
    """One micro batch of a DP rank; see the module doc. Dummy when it holds no samples."""

    samples: tuple[Sample, ...]  # truncated samples, sample coordinates
    indices: tuple[int, ...]  # position of each sample in the list it was planned from
    starts: tuple[int, ...]  # row position of each sample's first token
    cu_seqlens: tuple[int, ...]  # [num_slots + 1] slot boundaries, 0 .. length
    length: int  # S: tokens in the padded row
    config: PlanConfig  # the options it was planned with (CP size and layout, fields)
    step_counts: StepCounts | None = None  # the step's loss-token counts, when planned with them

    @property
    def is_dummy(self) -> bool:
        return not self.samples

    @property
    def segments(self) -> dict[str, tuple[PayloadSegment, ...]]:
        """By-handle segments per field, in row coordinates (see module doc)."""
        fields = self.config.fields
        grouped: dict[str, list[PayloadSegment]] = {}
        for sample, start in zip(self.samples, self.starts, strict=True):
            for seg in sample.payload:
                if fields[seg.field].window == "labels":
                    (seg,) = clip_segments([seg], 1, len(sample))
                grouped.setdefault(seg.field, []).extend(shift_segments([seg], start))
        return {k: tuple(v) for k, v in grouped.items()}

    @property
    def images(self) -> tuple[ImageSpan, ...]:
        """Every sample's images in row coordinates (placeholder runs shifted to the row)."""
        return tuple(
            im.shifted(start)
            for sample, start in zip(self.samples, self.starts, strict=True)
            for im in sample.images
        )

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return sum(len(s) for s in self.samples)


def place_micro_batch(
    samples: Sequence[Sample],
    config: PlanConfig,
    *,
    indices: Sequence[int] | None = None,
    check_fields: bool = True,
    step_counts: StepCounts | None = None,
) -> MicroBatch:
    """The micro batch of ``samples`` in packing order (``[]``: the dummy); see the module doc.

    Args:
        samples: one planned micro batch's samples, in packing order.
        config: the options it was planned with; recorded in the micro batch.
        indices: each sample's position in the list it was planned from (default
            ``0 .. n-1``), recorded in the micro batch and named by errors.
        check_fields: check each sample's fields against ``config.fields`` (``False``: the
            caller has checked them).
        step_counts: the step's loss-token counts from the plan (``BatchPlan.loss.counts``),
            recorded in the micro batch; each sample's count is checked against its truncated
            ``loss_mask`` (:class:`SampleValueError` when they differ).

    A sample longer than ``seq_len`` is truncated under ``overlong="truncate"`` (before an image
    whose placeholder run the cut would split) and refused (:class:`OverlongError`) otherwise,
    or when nothing precedes that image: planning leaves such samples out or fails.
    """
    indices = tuple(range(len(samples))) if indices is None else tuple(indices)
    seq_len, fields = config.seq_len, config.fields
    kept, lengths = [], []
    for i, s in zip(indices, samples, strict=True):
        if check_fields:
            s.check_fields(fields, index=i)
        n = len(s)
        if n > seq_len:
            cut = image_cut(s.images, seq_len)
            if config.overlong != "truncate" or cut == 0:
                why = "its cut would leave nothing before its first image" if cut == 0 else ""
                raise OverlongError(
                    f"sample has {n} tokens > seq_len={seq_len} under overlong="
                    f"{config.overlong!r}{why and ', and ' + why}; plan the samples with this "
                    "config (it leaves them out)",
                    sample=i,
                    pos=seq_len,
                )
            s, n = truncate_sample(s, cut), cut
        kept.append(s)
        lengths.append(n)
    if step_counts is not None:
        _check_counts(kept, indices, step_counts)
    cu = [0]
    for n in slot_lengths(np.array(lengths, np.int64), config.cp_size, config.cp_layout).tolist():
        cu.append(cu[-1] + n)
    pad = config.pad
    length = max(1, -(-cu[-1] // pad)) * pad
    starts = tuple(cu[:-1])
    if cu[-1] < length:
        cu.append(length)
    return MicroBatch(
        samples=tuple(kept),
        indices=indices,
        starts=starts,
        cu_seqlens=tuple(cu),
        length=length,
        config=config,
        step_counts=step_counts,
    )


def _check_counts(samples: list[Sample], indices: tuple[int, ...], counts: StepCounts) -> None:
    """Each (truncated) sample brings the loss tokens the plan counted: ``loss_mask[1:]``, the
    labels that end up in the micro batch's ``loss_mask``."""
    planned = counts.sample_loss_tokens.tolist()
    if len(planned) != len(samples):
        raise SampleValueError(
            f"step counts hold {len(planned)} samples, the micro batch {len(samples)}: they are "
            "another micro batch's; pass the plan's counts of these samples"
        )
    for i, s, want in zip(indices, samples, planned, strict=True):
        got = int(np.count_nonzero(s.loss_mask[1:]))
        if got != want:
            raise SampleValueError(
                f"the sample brings {got} loss tokens (loss_mask[1:] after truncation), the plan "
                f"counted {want}: its loss_mask changed after the step was planned (or the loss "
                "runs it was planned from are not this sample's)",
                sample=i,
                field="loss_mask",
            )
