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

With prefix trees (``trees``, from the plan) the micro batch has two rows
(:mod:`rollfeed.collate.tree_row`): ``starts``, ``cu_seqlens`` and ``length`` describe the *flat
row*, the samples back to back without padding, where every per-token field lines up as if they
had been packed one by one; ``tree`` is the row the forward computes, each shared prefix once.
Placing confirms that the samples below each shared span agree on its tokens
(:class:`SharedPrefixError` naming the sample and the first differing position otherwise) and
refuses samples with images among them. ``tree_segments`` holds the ``inputs``-window segments
(routes) in tree-row coordinates: each span's from the sample that owns it, so a shared prefix's
routes are read once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.collate.config import PlanConfig
from rollfeed.collate.cp import layout_unit, slot_lengths
from rollfeed.collate.errors import (
    BatchConfigError,
    OverlongError,
    SampleValueError,
    SharedPrefixError,
)
from rollfeed.collate.image_runs import image_cut
from rollfeed.collate.prefix_trees import PrefixTree
from rollfeed.collate.sample import Sample
from rollfeed.collate.step_counts import StepCounts
from rollfeed.collate.tree_row import TreeRow, tree_row
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
    trees: tuple[tuple[int, PrefixTree], ...] = ()  # (first sample, tree) of each prefix tree
    tree: TreeRow | None = None  # the row the forward computes, when it holds trees

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
    def tree_segments(self) -> dict[str, tuple[PayloadSegment, ...]]:
        """``inputs``-window segments per field in tree-row coordinates: each span's rows from
        its owner (see module doc); empty without a tree."""
        tree, fields = self.tree, self.config.fields
        if tree is None:
            return {}
        grouped: dict[str, list[PayloadSegment]] = {}
        for owner, start, depth, n in zip(
            tree.owners, tree.starts, tree.depths, tree.lengths, strict=True
        ):
            if owner < 0:
                continue
            for seg in self.samples[owner].payload:
                if fields[seg.field].window != "inputs":
                    continue
                (seg,) = clip_segments([seg], depth, depth + n)
                grouped.setdefault(seg.field, []).extend(shift_segments([seg], start - depth))
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
    trees: Sequence[tuple[int, PrefixTree]] = (),
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
        trees: the micro batch's prefix trees from the plan (``BatchPlan.trees``), as
            ``(first sample, tree)``: the samples are placed in a flat row and a tree row (see
            the module doc), their shared tokens confirmed.

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
    if trees:
        trees = tuple(trees)
        _check_trees(kept, indices, trees)
        unit = layout_unit(config.cp_size, config.cp_layout) if config.cp_layout == "zigzag" else 1
        row = tree_row(lengths, trees, unit=unit, pad=config.pad)
        if row.length > seq_len:
            raise BatchConfigError(
                f"the tree row holds {row.length} tokens > seq_len={seq_len}; place the trees "
                "the plan made with this config"
            )
        flat = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        return MicroBatch(
            samples=tuple(kept),
            indices=indices,
            starts=tuple(flat[:-1]),
            cu_seqlens=tuple(flat),
            length=flat[-1],
            config=config,
            step_counts=step_counts,
            trees=trees,
            tree=row,
        )
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


def _check_trees(
    samples: list[Sample], indices: tuple[int, ...], trees: tuple[tuple[int, PrefixTree], ...]
) -> None:
    """Trees that fit these samples (consecutive members, leaf spans ending at each member's
    length), no images among them, and the tokens below each shared span alike."""
    nxt = 0
    for first, tree in trees:
        members = tree.members
        if first < nxt or first + members > len(samples) or members < 2:
            raise SharedPrefixError(
                f"a tree of {members} samples at sample {first} overlaps another or runs past "
                f"the micro batch's {len(samples)} samples; place the trees the plan made"
            )
        nxt = first + members
        for k, span in enumerate(tree.spans):
            top = 0 if span.parent < 0 else tree.spans[span.parent].end
            if not (span.parent < k and span.start == top < span.end):
                raise SharedPrefixError(
                    f"span {k} of the tree at sample {first} does not continue its parent "
                    f"({span}); place the trees the plan made"
                )
        below: list[list[int]] = [[] for _ in tree.spans]
        for k, span in enumerate(tree.spans):
            if span.sample < 0:
                continue
            i = first + span.sample
            if span.end != len(samples[i]):
                raise SharedPrefixError(
                    f"the tree plans {span.end} tokens for a sample of {len(samples[i])}: it "
                    "was planned from other lengths",
                    sample=indices[i],
                )
            if samples[i].images:
                raise SharedPrefixError(
                    "a sample with images is not packed as a tree; plan it without its shared "
                    "prefix",
                    sample=indices[i],
                    field="images",
                )
            while k >= 0:
                below[k].append(i)
                k = tree.spans[k].parent
        for span, under in zip(tree.spans, below, strict=True):
            if span.sample >= 0:
                continue
            ref = samples[under[0]].token_ids[span.start : span.end]
            for i in under[1:]:
                ids = samples[i].token_ids[span.start : span.end]
                if not np.array_equal(ids, ref):
                    at = span.start + int(np.argmax(ids != ref))
                    raise SharedPrefixError(
                        f"token {int(ids[at - span.start])} differs from "
                        f"{int(ref[at - span.start])} of sample {indices[under[0]]} inside the "
                        f"prefix [{span.start}, {span.end}) they were planned to share",
                        sample=indices[i],
                        field="token_ids",
                        pos=at,
                    )
