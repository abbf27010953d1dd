"""Runs: ``[start, end)`` token ranges of each sample of a step, in one flat table.

A step's runs are ``counts [n]`` (runs of each sample) and ``spans [R, 2]`` (every run's start and
end, sample after sample; ``R = counts.sum()``); ``offsets [n + 1]`` locate each sample's runs.
Two kinds share this table: where a sample's loss tokens lie
(:class:`~rollfeed.collate.loss_runs.LossRuns`) and where its images' placeholder tokens lie
(:class:`~rollfeed.collate.image_runs.ImageRuns`). Worked example (two samples, runs
``[[1, 3]]`` and ``[[0, 2], [3, 5]]``)::

    counts [1, 2]   spans [[1, 3], [0, 2], [3, 5]]   offsets [0, 1, 3]
    take([1]) -> counts [2], spans [[0, 2], [3, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Self

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Runs:
    """``counts [n]``, ``spans [R, 2]`` and ``offsets [n + 1]``, int64 (see the module doc).

    ``ADJACENT``: whether a run may start where the one before it ends (image runs may; loss runs
    are maximal, so they never do)."""

    counts: np.ndarray
    spans: np.ndarray
    offsets: np.ndarray = field(init=False)
    ADJACENT: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", np.asarray(self.counts, np.int64).reshape(-1))
        object.__setattr__(self, "spans", np.asarray(self.spans, np.int64).reshape(-1, 2))
        offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        assert offsets[-1] == len(self.spans), "one span per counted run"
        object.__setattr__(self, "offsets", offsets)

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def owner(self) -> np.ndarray:
        """``[R]`` int64: the sample each run belongs to."""
        return np.repeat(np.arange(len(self.counts)), self.counts)

    def of(self, i: int) -> np.ndarray:
        """``[r, 2]``: sample ``i``'s runs."""
        return self.spans[self.offsets[i] : self.offsets[i + 1]]

    def take(self, order: np.ndarray) -> Self:
        """The runs of samples ``order [m]`` (positions into these), in that order."""
        order = np.asarray(order, np.int64)
        counts = self.counts[order]
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        at = np.repeat(self.offsets[order] - first, counts) + np.arange(int(counts.sum()))
        return type(self)(counts=counts, spans=self.spans[at])

    def misplaced(self, lengths: np.ndarray) -> int | None:
        """The first sample (of ``lengths [n]`` tokens each) whose runs are not in token order,
        non-empty, inside the sample and apart (``start`` after the previous run's ``end``, or at
        it when ``ADJACENT``), or ``None`` when every sample's are."""
        owner = self.owner
        starts, ends = self.spans[:, 0], self.spans[:, 1]
        prev = np.concatenate([[-1], ends[:-1]])
        prev[self.offsets[:-1][self.counts > 0]] = -1  # a sample's first run follows nothing
        lengths = np.asarray(lengths, np.int64)
        before = starts < prev if self.ADJACENT else starts <= prev
        bad = (starts < 0) | (starts >= ends) | (ends > lengths[owner]) | before
        return int(owner[np.argmax(bad)]) if bad.any() else None
