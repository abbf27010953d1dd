"""Planned: one micro batch's items on their way from the sampler to the collator, with the config.

The sampler plans from lengths (:func:`rollfeed.collate.plan_lengths`) and yields a ``Planned``
list of dataset indices in packing order; the dataset's ``__getitems__`` turns it into a
``Planned`` list of samples carrying the same config; the collator places them
(:func:`rollfeed.collate.place_micro_batch`) under its own config, after checking that the two
are equal (:class:`~rollfeed.loaders.errors.PlanMismatchError`): a sampler and a collator built
with different options inside one DataLoader never give a micro batch silently different from
the plan. Example::

    Planned([7, 3], config)      # -> dataset.__getitems__ -> Planned([s7, s3], config)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollfeed.collate import PlanConfig


class Planned(list):
    """A list (indices or samples of one micro batch) and the ``config`` it was planned with."""

    def __init__(self, items: Iterable[Any], config: PlanConfig) -> None:
        super().__init__(items)
        self.config = config

    @staticmethod
    def like(source: Any, items: list[Any]) -> list[Any]:
        """``items`` as a ``Planned`` with ``source``'s config when ``source`` is planned."""
        return Planned(items, source.config) if isinstance(source, Planned) else items
