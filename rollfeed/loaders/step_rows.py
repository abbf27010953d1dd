"""StepRows: what a step's plan is made from, a row per sample, read from the step's index.

The sampler plans a step from these columns alone (:func:`rollfeed.collate.plan_lengths`), after
shuffling them and dropping the samples a staleness bound refuses, both as one
:meth:`StepRows.take` of every column: a column added here goes through both.

Example (a step of three samples, dataset indices 4..6, shuffled)::

    rows = StepRows.read(dataset, step=2)      # order [4, 5, 6], lengths [12, 5, 9], ...
    rows.take(np.array([2, 0, 1]))             # order [6, 4, 5], lengths [9, 12, 5], ...
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollfeed.collate import ImageRuns, LossRuns, SharedPrefixes
from rollfeed.loaders.dataset import RolloutDataset


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepRows:
    """A step's rows: ``order [n]`` dataset indices, ``lengths [n]``, loss ``runs``, ``images``
    runs and claimed ``prefixes`` (None where the step has none), ``versions [n]`` (the oldest
    policy version of each sample)."""

    order: np.ndarray
    lengths: np.ndarray
    runs: LossRuns
    images: ImageRuns | None
    prefixes: SharedPrefixes | None
    versions: np.ndarray

    @classmethod
    def read(cls, dataset: RolloutDataset, step: int) -> StepRows:
        """The rows of ``step``, in the dataset's order."""
        return cls(
            order=dataset.step_indices(step),
            lengths=dataset.lengths(step),
            runs=dataset.loss_runs(step),
            images=dataset.image_runs(step),
            prefixes=dataset.shared_prefixes(step),
            versions=dataset.policy_versions(step),
        )

    def take(self, rows: np.ndarray) -> StepRows:
        """These rows, in this order (a shuffle, or the samples a staleness bound keeps)."""
        chains = None if self.prefixes is None else tuple(self.prefixes.chains[r] for r in rows)
        return StepRows(
            order=self.order[rows],
            lengths=self.lengths[rows],
            runs=self.runs.take(rows),
            images=None if self.images is None else self.images.take(rows),
            prefixes=None if chains is None else SharedPrefixes(chains=chains),
            versions=self.versions[rows],
        )
