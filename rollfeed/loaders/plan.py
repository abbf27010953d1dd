"""Planned: one micro batch's items on their way from the sampler to the collator, with the config.

The sampler plans from lengths (:func:`rollfeed.collate.plan_lengths`) and yields a ``Planned``
list of dataset indices in packing order; the dataset's ``__getitems__`` turns it into a
``Planned`` list of samples carrying the same config; the collator places them
(:func:`rollfeed.collate.place_micro_batch`) under its own config, after checking that the two
are equal (:class:`~rollfeed.loaders.errors.PlanMismatchError`): a sampler and a collator built
with different options inside one DataLoader never give a micro batch silently different from
the plan. An index list also carries what it was planned from: the step file's version
(:class:`~rollfeed.loaders.step_version.StepVersion`) and each sample's planned token count, which
the dataset holds the samples it reads to, and the step's loss-token counts
(:class:`~rollfeed.collate.StepCounts`), the trained ``step`` and the loader's staleness bound
(:class:`~rollfeed.loaders.staleness.Staleness`), which go on with the samples to the micro batch
(the collator masks stale tokens with them, the metrics count tokens by lag).
Example::

    Planned([7, 3], config, version=v, lengths=[12, 5], counts=c, step=4)  # -> __getitems__
    -> Planned([s7, s3], config, counts=c, step=4)      # read from version v, len 12 and 5
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rollfeed.collate import PlanConfig, StepCounts
from rollfeed.loaders.staleness import Staleness
from rollfeed.loaders.step_version import StepVersion


class Planned(list):
    """A list (indices or samples of one micro batch) and the ``config`` it was planned with,
    the step's loss-token ``counts`` for its items, the ``step`` it trains and the
    ``staleness`` bound it was planned under (``None``: none); for indices, the step file's
    ``version`` (``None``: an in-memory list) and the planned ``lengths`` (one per index, or
    ``None``)."""

    def __init__(
        self,
        items: Iterable[Any],
        config: PlanConfig,
        *,
        version: StepVersion | None = None,
        lengths: Sequence[int] | None = None,
        counts: StepCounts | None = None,
        step: int | None = None,
        staleness: Staleness | None = None,
    ) -> None:
        super().__init__(items)
        self.config, self.version, self.lengths = config, version, lengths
        self.counts, self.step, self.staleness = counts, step, staleness

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a DataLoader worker) with its counts as plain numbers: a tensor would go
        by torch's shared memory, a file descriptor and a resource-sharer thread's round trip
        per micro batch."""
        state, c = dict(self.__dict__), self.counts
        if c is not None:
            per = c.sample_loss_tokens.tolist()
            state["counts"] = (c.loss_tokens, c.samples, c.samples_with_loss, per)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        c = state["counts"]
        if c is not None:
            tokens, samples, with_loss, per = c
            state["counts"] = StepCounts(
                loss_tokens=tokens,
                samples=samples,
                samples_with_loss=with_loss,
                sample_loss_tokens=torch.tensor(per, dtype=torch.int64),
            )
        self.__dict__.update(state)

    @staticmethod
    def like(source: Any, items: list[Any]) -> list[Any]:
        """``items`` as a ``Planned`` with ``source``'s config, counts, step and staleness bound
        when ``source`` is planned."""
        if not isinstance(source, Planned):
            return items
        return Planned(
            items,
            source.config,
            counts=source.counts,
            step=source.step,
            staleness=source.staleness,
        )
