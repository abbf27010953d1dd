"""Loss runs: where each sample's loss tokens lie, as ``[start, end)`` token ranges.

A sample's ``loss_mask [T]`` is stored as its *runs*: the maximal ranges of consecutive loss
tokens, in token order. A step's runs are ``counts [n]`` (runs of each sample) and
``spans [R, 2]`` (every run's start and end, sample after sample; ``R = counts.sum()``). A step
file's index stores them (:mod:`rollfeed.payload.format.step_layout`), so the planner counts loss
tokens without reading a sample.

The loss tokens a sample brings to training are those
:func:`~rollfeed.collate.to_tensor_micro_batch` marks in ``loss_mask``: label coordinates shift
each token one back, so token 0 of a sample is never a label, and truncation at ``seq_len`` keeps
tokens ``[0, seq_len)``. A sample of ``T`` tokens kept to ``T' = min(T, seq_len)`` brings
``Σ_runs max(0, min(end, T') - max(start, 1))``.

Worked example (``seq_len=4``)::

    loss_mask [1, 1, 0, 1, 1, 1]  -> runs [[0, 2], [3, 6]]
    label tokens: [0, 2] -> [1, 2): 1;  [3, 6] cut at 4 -> [3, 4): 1;   total 2
    (the micro batch's loss_mask: the sample's loss_mask[1:4] = [1, 0, 1])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rollfeed.collate.runs import Runs
from rollfeed.collate.sample import Sample


def mask_runs(mask: np.ndarray) -> np.ndarray:
    """``[r, 2]`` int64: the maximal runs of True in the bool ``mask [T]``, in order."""
    edges = np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]]))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LossRuns(Runs):
    """Every sample's loss runs (see the module doc): ``counts [n]`` and ``spans [R, 2]``, int64;
    ``offsets [n + 1]``: sample ``i``'s runs are ``spans[offsets[i]:offsets[i + 1]]``."""

    @classmethod
    def of_masks(cls, masks: Iterable[np.ndarray]) -> LossRuns:
        """The runs of each bool ``loss_mask``, in order."""
        runs = [mask_runs(m) for m in masks]
        spans = np.concatenate(runs) if runs else np.zeros((0, 2), np.int64)
        return cls(counts=np.fromiter(map(len, runs), np.int64, len(runs)), spans=spans)

    @classmethod
    def of_samples(cls, samples: Sequence[Sample]) -> LossRuns:
        return cls.of_masks(s.loss_mask for s in samples)

    def label_tokens(self, lengths: np.ndarray, seq_len: int) -> np.ndarray:
        """``[n]`` int64: each sample's loss tokens in label coordinates, after truncation at
        ``seq_len`` (``lengths [n]``: the samples' token counts); see the module doc."""
        kept = np.minimum(np.asarray(lengths, np.int64), seq_len)
        owner = np.repeat(np.arange(len(self.counts)), self.counts)
        ends = np.minimum(self.spans[:, 1], kept[owner])
        each = np.maximum(ends - np.maximum(self.spans[:, 0], 1), 0)
        out = np.zeros(len(self.counts), np.int64)
        np.add.at(out, owner, each)
        return out
