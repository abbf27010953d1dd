"""RolloutDataset: map-style, item = :class:`~rollfeed.collate.Sample` (metadata, no payload bytes).

Sources:

- ``RolloutDataset(samples)``: an in-memory list; every training step sees the whole list, and
  indices are list positions.
- ``RolloutDataset.from_step_dir(directory)``: step files (:mod:`rollfeed.loaders.step_files`);
  training step ``k`` is file ``k``. An index encodes ``(step, line)`` as
  ``step * STEP_STRIDE + line``, so a worker resolves indices of steps that appeared after it was
  started: it parses that step's file on first use and keeps the last ``cache_steps`` steps.

``lengths(step)`` gives token counts without building micro batches, so the sampler plans from
lengths only; for a step directory it parses the step file once in the calling process.

Example: steps 3 and 4 of two and one samples -> ``step_indices(4) == [4 * 2**32 + 0]``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

from rollfeed.collate import Sample
from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.step_files import list_steps, read_step_file, step_file_name, wait_for_step

STEP_STRIDE = 1 << 32


class RolloutDataset(Dataset[Sample]):
    """Samples of training steps; see the module doc for the two sources and index encoding."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self._samples: Sequence[Sample] | None = samples
        self._lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
        self.directory: str | None = None
        self.cache_steps = 0
        self._cache: OrderedDict[int, list[Sample]] = OrderedDict()

    @classmethod
    def from_step_dir(
        cls, directory: str | os.PathLike[str], *, cache_steps: int = 2
    ) -> RolloutDataset:
        if not os.path.isdir(directory):
            raise LoaderConfigError(f"step directory {os.fspath(directory)!r} does not exist")
        if cache_steps < 1:
            raise LoaderConfigError(f"cache_steps must be >= 1, got {cache_steps}")
        self = cls([])
        self._samples = None
        self.directory = os.path.abspath(directory)
        self.cache_steps = cache_steps
        return self

    @property
    def streams(self) -> bool:
        """True when steps come from a directory that can grow (stream mode possible)."""
        return self.directory is not None

    def __getstate__(self) -> dict:
        state = {k: getattr(self, k) for k in ("_samples", "_lengths", "directory", "cache_steps")}
        return state  # parsed steps stay behind: a worker parses what it needs

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._cache = OrderedDict()

    def __len__(self) -> int:
        """In-memory: the list's length. Step directory: samples of the steps cached here."""
        if self._samples is not None:
            return len(self._samples)
        return sum(len(v) for v in self._cache.values())

    def __getitem__(self, index: int) -> Sample:
        if self._samples is not None:
            return self._samples[index]
        step, line = divmod(int(index), STEP_STRIDE)
        return self._step(step)[line]

    def _step(self, step: int) -> list[Sample]:
        samples = self._cache.get(step)
        if samples is None:
            assert self.directory is not None
            samples = read_step_file(os.path.join(self.directory, step_file_name(step)))
            self._cache[step] = samples
            while len(self._cache) > self.cache_steps:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(step)
        return samples

    def steps_from(self, step: int) -> list[int]:
        """Steps from ``step`` on: in-memory ``[step]``; directory: the step files >= step."""
        if self._samples is not None:
            return [step]
        assert self.directory is not None
        return [s for s in list_steps(self.directory) if s >= step]

    def first_step(self) -> int:
        """Step a fresh stream starts at: the oldest step file present, else 0."""
        return min(self.steps_from(0), default=0)

    def wait_for_step(self, step: int, *, timeout_s: float) -> None:
        if self.directory is None:
            raise LoaderConfigError("stream mode needs a step directory (from_step_dir)")
        wait_for_step(self.directory, step, timeout_s=timeout_s)

    def step_indices(self, step: int) -> np.ndarray:
        """``[n]`` int64 dataset indices of step ``step``'s samples, in file (list) order."""
        if self._samples is not None:
            return np.arange(len(self._samples), dtype=np.int64)
        return step * STEP_STRIDE + np.arange(len(self._step(step)), dtype=np.int64)

    def lengths(self, step: int = 0) -> np.ndarray:
        """``[n]`` int64 token count of each sample of ``step``, aligned with ``step_indices``."""
        if self._samples is not None:
            return self._lengths
        return np.fromiter((len(s) for s in self._step(step)), np.int64)
