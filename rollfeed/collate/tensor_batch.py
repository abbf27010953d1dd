"""TensorMicroBatch: the tensors one CP rank feeds to the model for one micro batch.

Coordinates. A micro batch is one packed row of ``S`` tokens (``S`` a multiple of the pad
multiple). The row is cut into *slots*: one per sample (for the zigzag layout a sample's slot is
padded to a multiple of ``2 * cp_size``), plus one final slot for the row's tail padding when there
is any. A CP rank holds ``N = S // cp_size`` of the row's positions, listed in ``positions`` in the
order its tensors store them (``contiguous``: one chunk; ``zigzag``: chunks ``r`` and
``2 * cp_size - 1 - r`` of every slot, TransformerEngine's THD order).

Every per-token training tensor is in *label coordinates*: entry ``j`` describes the prediction made
at input position ``j`` of token ``j + 1`` (``labels[j] = input_ids[j + 1]``), so ``loss_mask``,
``advantages``, ``inference_logprobs`` and ``temperatures`` belong to sampled token ``j + 1``.
They are computed on the whole row before the split, so a rank never needs its neighbour's tokens.
At a sample's last position and on padding there is no label: ``labels = IGNORE_INDEX``,
``loss_mask = False``, advantages and logprobs 0, temperature 1.

``versions`` (int32, label coordinates like ``advantages``) holds the policy version that sampled
token ``j + 1`` (the trainer step whose weights produced it, from the sample's version spans:
:mod:`rollfeed.collate.versions`), and -1 where that token carries none: a prompt or tool token,
a sample's last position, padding. A rollout continued across a weight update shows both
versions. Example: sample ``[5, 6, 7, 8]`` with spans ``[[2, 3, 4], [3, 4, 5]]`` (tokens 7 and 8
sampled under steps 4 and 5) -> ``versions [-1, 4, 5, -1]``.

Worked example: samples ``[5, 6, 7]`` (loss_mask ``[0, 1, 1]``) and ``[8, 9]`` (``[0, 1]``),
contiguous layout, ``cp_size=2``, pad multiple 2 -> ``S = 6``::

    whole row        input_ids [5, 6, 7, 8, 9, 0]   position_ids [0, 1, 2, 0, 1, 0]
                     labels    [6, 7, -100, 9, -100, -100]   loss_mask [1, 1, 0, 1, 0, 0]
                     seq_lens  [3, 2]               cu_seqlens [0, 3, 5, 6]   (last slot: padding)
    cp_rank 0        positions [0, 1, 2]  input_ids [5, 6, 7]  labels [6, 7, -100]
    cp_rank 1        positions [3, 4, 5]  input_ids [8, 9, 0]  labels [9, -100, -100]

``fields`` holds one tensor per payload field present in the micro batch, read over the field's
window (:mod:`rollfeed.payload.fields`): ``inputs`` -> ``[N, ...]`` at ``positions``; ``labels``
-> ``[N, ...]`` at ``positions + 1`` (row position ``S`` reads fill); ``sequence`` -> ``[S, ...]``
over the whole row.
With ``fields_whole=True`` every field was read over the whole row instead (``[S, ...]``, labels
fields at ``1 .. S``), for models that shard inside the forward. Fixed-width fields are
``[n, *shape]`` at their stored dtype (routing ids stay ``uint8``); ragged fields are
:class:`~rollfeed.payload.RaggedRows` of ``n`` rows of ``int32``/``float32`` values (a kept set
with its sampled token first; a position nothing covers an empty row), or ``[n, width]`` padded
with the field's fill when the collator was given a ``width``. Example: in the row above, kept
sets ``{6, 2}`` recorded for token 6 (position 1) and ``{7}`` for token 7 (position 2); the mask
is read over the ``labels`` window, so ``cp_rank 0`` (positions 0..2) holds the kept sets of
positions 1, 2 and 3 (token 8 starts a sample: no label, an empty row)::

    sampling_mask  offsets [0, 2, 3, 3]   values [6, 2, 7]     (rows [6, 2], [7], [])

``coverage`` holds, for every fixed-width ``inputs``-window field (routing ids and weights), a
bool ``[n]`` that is True on the rows that came from recorded data and False on fill (padding, a
position no record or inline row covers), the same by handle and inline: router replay replays
covered rows only and keeps the model's own routing elsewhere. Example: samples ``[5, 6, 7]``
(routing recorded for its first two tokens only) and ``[8, 9]`` (routing for both), cp 1 ->
``coverage["routed_experts"] = [1, 1, 0, 1, 1, 0]``.

A dummy micro batch (a DP rank that came up short) has ``num_samples == 0``, all-padding tokens,
``loss_mask`` all False and ``fields == coverage == {}``: no payload is read for it, it has no
recorded rows.

``step_counts`` holds the step's loss-token counts from the plan every rank makes
(:class:`~rollfeed.collate.step_counts.StepCounts`: the step's loss tokens, samples and samples
with a loss token, and ``sample_loss_tokens [num_samples]``, each of this micro batch's samples'
loss tokens over the whole step), so a loss is normalised over the step without a collective
(:func:`rollfeed.objectives.aggregate`); a dummy carries them too. In the row above, a step of
these two samples: ``loss_tokens 3, samples 2, samples_with_loss 2, sample_loss_tokens [2, 1]``.
``None`` for a micro batch placed without a plan's counts (by hand, or a collator given a plain
list of samples).

``media`` holds the images of a micro batch whose samples have any
(:class:`~rollfeed.collate.MediaBatch`: mRoPE positions, placeholder mask, the row's images and
the pixels of those this rank encodes); ``None`` for a text-only micro batch.

``checks`` holds what the collator found on the CPU while building it (largest and smallest token
id, the first invalid temperature of a scored row: :mod:`rollfeed.collate.token_checks`), as plain
Python values that every copy below keeps, so a scorer checks them without a device sync. ``None``
for a micro batch built by hand: the scorer then relies on its own checks of the tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollfeed.collate.media_batch import MediaBatch
from rollfeed.collate.step_counts import StepCounts
from rollfeed.collate.token_checks import TokenChecks
from rollfeed.payload import RaggedRows

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TensorMicroBatch:
    """One CP rank's tensors for one micro batch. ``N = seq_len // cp_size``; see module doc.

    input_ids, position_ids, labels, positions: ``[N]`` int64.
    loss_mask: ``[N]`` bool. advantages, inference_logprobs, temperatures: ``[N]`` float32.
    versions: ``[N]`` int32, the policy version of each label, -1 for none (see module doc);
    ``None`` for a micro batch built by hand without it.
    seq_lens: ``[num_samples]`` int32, real tokens per sample of the whole row.
    cu_seqlens: ``[num_slots + 1]`` int32, slot boundaries of the whole row (0 .. seq_len).
    fields: field name -> tensor (ragged: RaggedRows) over the field's window (see module doc).
    coverage: fixed-width ``inputs`` field name -> ``[n]`` bool, recorded rows (see module doc).
    step_counts: the step's loss-token counts (see module doc), or None.
    checks: plain-Python facts recorded on the CPU (see module doc), or None.
    media: the micro batch's images (:class:`~rollfeed.collate.MediaBatch`), or None.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: int
    cp_rank: int
    cp_size: int
    cp_layout: str
    versions: torch.Tensor | None = None
    fields: dict[str, torch.Tensor | RaggedRows] = field(default_factory=dict)
    fields_whole: bool = False
    coverage: dict[str, torch.Tensor] = field(default_factory=dict)
    step_counts: StepCounts | None = None
    checks: TokenChecks | None = None
    media: MediaBatch | None = None

    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def is_dummy(self) -> bool:
        """True for the filler micro batch of a DP rank that came up short (no loss)."""
        return self.num_samples == 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor: the dataclass fields in declaration order, then ``fields`` (a ragged
        field's offsets, then values), ``coverage`` in order, the step counts'
        ``sample_loss_tokens`` and the media's tensors."""
        top = [getattr(self, f.name) for f in dataclasses.fields(self)]
        fields = [
            t
            for v in self.fields.values()
            for t in (v.tensors() if isinstance(v, RaggedRows) else (v,))
        ]
        counts = [] if self.step_counts is None else [self.step_counts.sample_loss_tokens]
        media = [] if self.media is None else self.media.tensors()
        return [
            *(t for t in top if isinstance(t, torch.Tensor)),
            *fields,
            *self.coverage.values(),
            *counts,
            *media,
        ]

    def apply(self, fn: Callable[[torch.Tensor], Any]) -> TensorMicroBatch:
        """A copy with ``fn`` applied to every tensor, in :meth:`tensors` order."""
        top = {
            f.name: fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(
            self,
            **top,
            fields={k: map_field(v, fn) for k, v in self.fields.items()},
            coverage={k: fn(v) for k, v in self.coverage.items()},
            step_counts=None if self.step_counts is None else self.step_counts.apply(fn),
            media=None if self.media is None else self.media.apply(fn),
        )

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TensorMicroBatch:
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TensorMicroBatch:
        """Page-locked copy; ``DataLoader(pin_memory=True)`` calls this for custom batch types."""
        return self.apply(torch.Tensor.pin_memory)


def map_field(value: torch.Tensor | RaggedRows | Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to a field's tensor, or to a ragged field's offsets and values."""
    return value.apply(fn) if isinstance(value, RaggedRows) else fn(value)
