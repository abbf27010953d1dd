"""Step counts: the step-wide loss-token counts every micro batch carries, from the plan.

A loss normalised over the whole step (the global batch) needs the step's counts before the first
backward. Every rank plans the step from the same token counts and loss runs
(:mod:`rollfeed.collate.loss_runs`), so every rank knows them without a collective, exact after
truncation: they count what ends up True in ``loss_mask`` over every micro batch of every dp rank,
each token once over the ``cp`` ranks.

:class:`StepLoss` is a plan's: ``per_sample [n]`` loss tokens of each planned sample (0 for one
left out under ``overlong="drop"``). :class:`StepCounts` is what one micro batch carries
(``MicroBatch.step_counts``, ``TensorMicroBatch.step_counts``): the step's totals and, for each
of its own samples, that sample's loss tokens over the whole step (all its ``cp`` ranks).

Worked example (a step of 3 samples bringing 4, 0 and 2 loss tokens; a micro batch of samples
2 and 0)::

    StepLoss.of(per_sample=[4, 0, 2], planned=[True, True, True]).counts([2, 0])
    -> StepCounts(loss_tokens=6, samples=3, samples_with_loss=2, sample_loss_tokens=tensor([2, 4]))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepCounts:
    """One micro batch's copy of its step's counts (see the module doc).

    loss_tokens: the step's loss tokens (label coordinates, after truncation).
    samples: the step's planned samples (those left out by ``overlong="drop"`` excluded).
    samples_with_loss: of those, the samples with at least one loss token.
    sample_loss_tokens: ``[num_samples]`` int64, each of this micro batch's samples' loss tokens
        (whole sample, every ``cp`` rank), in the micro batch's sample order; ``[0]`` for a dummy.
    """

    loss_tokens: int
    samples: int
    samples_with_loss: int
    sample_loss_tokens: torch.Tensor

    def apply(self, fn: Callable[[torch.Tensor], Any]) -> StepCounts:
        """A copy with ``fn`` applied to ``sample_loss_tokens``."""
        return StepCounts(
            loss_tokens=self.loss_tokens,
            samples=self.samples,
            samples_with_loss=self.samples_with_loss,
            sample_loss_tokens=fn(self.sample_loss_tokens),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepCounts):
            return NotImplemented
        mine = (self.loss_tokens, self.samples, self.samples_with_loss)
        theirs = (other.loss_tokens, other.samples, other.samples_with_loss)
        a, b = self.sample_loss_tokens, other.sample_loss_tokens
        same = a.dtype == b.dtype and a.shape == b.shape
        return mine == theirs and same and bool((a.cpu() == b.cpu()).all())

    __hash__ = None  # type: ignore[assignment]  # equal by value, holds a tensor


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepLoss:
    """A planned step's loss tokens: ``per_sample [n]`` int64 (0 for a sample left out under
    ``overlong="drop"``) and the step's totals (:meth:`of`)."""

    per_sample: np.ndarray
    loss_tokens: int
    samples: int
    samples_with_loss: int

    @classmethod
    def of(cls, per_sample: np.ndarray, planned: np.ndarray) -> StepLoss:
        """From each sample's loss tokens ``[n]`` and whether it is planned ``[n]`` bool."""
        per_sample = np.where(planned, per_sample, 0).astype(np.int64)
        return cls(
            per_sample=per_sample,
            loss_tokens=int(per_sample.sum()),
            samples=int(np.count_nonzero(planned)),
            samples_with_loss=int(np.count_nonzero(per_sample)),
        )

    def counts(self, positions: Sequence[int]) -> StepCounts:
        """The :class:`StepCounts` of a micro batch of samples ``positions`` (packing order)."""
        mine = self.per_sample[np.asarray(positions, np.int64)]
        return StepCounts(
            loss_tokens=self.loss_tokens,
            samples=self.samples,
            samples_with_loss=self.samples_with_loss,
            sample_loss_tokens=torch.from_numpy(mine.astype(np.int64, copy=True)),
        )
