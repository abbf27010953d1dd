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
(:class:`~rollfeed.collate.StepCounts`), which go on with the samples to the micro batch.
Example::

    Planned([7, 3], config, version=v, lengths=[12, 5], counts=c)  # -> dataset.__getitems__
    -> Planned([s7, s3], config, counts=c)              # read from version v, len 12 and 5
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rollfeed.collate import PlanConfig, StepCounts
from rollfeed.loaders.step_version import StepVersion


class Planned(list):
    """A list (indices or samples of one micro batch) and the ``config`` it was planned with,
    the step's loss-token ``counts`` for its items; for indices, the step file's ``version``
    (``None``: an in-memory list) and the planned ``lengths`` (one per index, or ``None``)."""

    def __init__(
        self,
        items: Iterable[Any],
        config: PlanConfig,
        *,
        version: StepVersion | None = None,
        lengths: Sequence[int] | None = None,
        counts: StepCounts | None = None,
    ) -> None:
        super().__init__(items)
        self.config, self.version, self.lengths = config, version, lengths
        self.counts = counts

    @staticmethod
    def like(source: Any, items: list[Any]) -> list[Any]:
        """``items`` as a ``Planned`` with ``source``'s config and counts when ``source`` is
        planned."""
        if not isinstance(source, Planned):
            return items
        return Planned(items, source.config, counts=source.counts)
