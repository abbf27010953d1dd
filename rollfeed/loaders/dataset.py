"""RolloutDataset: map-style, item = :class:`~rollfeed.collate.Sample` (metadata, no payload bytes).

Sources:

- ``RolloutDataset(samples)``: an in-memory list; every training step sees the whole list, and
  indices are list positions.
- ``RolloutDataset.from_step_dir(directory)``: step files (:mod:`rollfeed.loaders.step_files`);
  training step ``k`` is file ``k``. An index encodes ``(step, line)`` as
  ``step * STEP_STRIDE + line``, so a worker resolves indices of steps that appeared after it was
  started. A step file with an index (:mod:`rollfeed.loaders.step_index`, written by
  ``write_step_file``): ``lengths(step)`` reads only the index, and ``dataset[i]`` seeks to and
  parses only sample ``i``'s line. Without one, policy ``missing_index``: ``"parse"`` (default)
  parses the whole step file on first use of the step in each process, as a loader without
  indexes would, logs a warning once per step and counts it in ``metrics()["unindexed_steps"]``;
  ``"error"`` raises :class:`StepFileError`. Each process keeps the last ``cache_steps`` steps
  (index or parsed samples, and the open step file); indexed samples are not kept, as each is
  used once per pass.

``lengths(step)`` gives token counts without building micro batches, so the sampler plans from
lengths only.

Example: steps 3 and 4 of two and one samples -> ``step_indices(4) == [4 * 2**32 + 0]``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import BinaryIO, Literal

import numpy as np
from torch.utils.data import Dataset

from rollfeed.collate import Sample
from rollfeed.loaders.errors import LoaderConfigError, StepFileError
from rollfeed.loaders.plan import Planned
from rollfeed.loaders.step_files import list_steps, read_step_file, step_file_name, wait_for_step
from rollfeed.loaders.step_index import (
    StepIndex,
    index_path,
    read_indexed_sample,
    read_step_index,
)
from rollfeed.loaders.step_store import StepStore
from rollfeed.payload.store_url import is_store_url

logger = logging.getLogger(__name__)
STEP_STRIDE = 1 << 32
MissingIndex = Literal["parse", "error"]
MISSING_INDEX: tuple[MissingIndex, ...] = ("parse", "error")


class RolloutDataset(Dataset[Sample]):
    """Samples of training steps; see the module doc for the two sources and index encoding."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self._samples: Sequence[Sample] | None = samples
        self._lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
        self.directory: str | None = None
        self._store: StepStore | None = None  # step files in an object store (s3://...)
        self.cache_steps = 0
        self.missing_index: MissingIndex = "parse"
        self._reset()

    def _reset(self) -> None:
        """Per-process state: cached steps, open step files, counters."""
        self._cache: OrderedDict[int, StepIndex | list[Sample]] = OrderedDict()
        self._files: dict[int, BinaryIO] = {}
        self._pid = os.getpid()
        self._counts: Counter[str] = Counter()

    @classmethod
    def from_step_dir(
        cls,
        directory: str | os.PathLike[str],
        *,
        cache_steps: int = 2,
        missing_index: MissingIndex = "parse",
        store: Mapping[str, object] | None = None,
    ) -> RolloutDataset:
        """Steps from ``directory``: a local directory, or ``s3://bucket/prefix`` (``store``:
        endpoint, region and credentials of :class:`~rollfeed.loaders.step_store.StepStore`;
        by default the ``AWS_*`` variables)."""
        if is_store_url(directory):
            self = cls([])
            self._samples, self.directory = None, str(directory)
            self._store = StepStore(str(directory), **(store or {}))
            self.cache_steps, self.missing_index = cache_steps, missing_index
            if cache_steps < 1 or missing_index not in MISSING_INDEX:
                raise LoaderConfigError(
                    f"cache_steps must be >= 1 and missing_index one of {MISSING_INDEX}, got "
                    f"{cache_steps}, {missing_index!r}"
                )
            return self
        if not os.path.isdir(directory):
            raise LoaderConfigError(f"step directory {os.fspath(directory)!r} does not exist")
        if cache_steps < 1:
            raise LoaderConfigError(f"cache_steps must be >= 1, got {cache_steps}")
        if missing_index not in MISSING_INDEX:
            raise LoaderConfigError(
                f"missing_index must be one of {MISSING_INDEX}, got {missing_index!r}"
            )
        self = cls([])
        self._samples = None
        self.directory = os.path.abspath(directory)
        self.cache_steps = cache_steps
        self.missing_index = missing_index
        return self

    @property
    def streams(self) -> bool:
        """True when steps come from a directory that can grow (stream mode possible)."""
        return self.directory is not None

    def __getstate__(self) -> dict:
        keys = ("_samples", "_lengths", "directory", "_store", "cache_steps", "missing_index")
        return {k: getattr(self, k) for k in keys}  # cached steps and files stay behind

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._reset()

    def metrics(self) -> dict[str, int]:
        """This process's counters: ``indexed_steps`` and ``unindexed_steps`` (steps loaded with
        and without an index; the latter parsed whole) and ``lines_parsed`` (step file lines)."""
        self._own_process()
        return {k: self._counts[k] for k in ("indexed_steps", "unindexed_steps", "lines_parsed")}

    def _own_process(self) -> None:
        """A forked worker keeps the inherited cache (indexes, parsed steps: copy-on-write) but
        opens its own step files and starts its own counts."""
        if self._pid != os.getpid():
            self._pid, self._files, self._counts = os.getpid(), {}, Counter()

    def __len__(self) -> int:
        """In-memory: the list's length. Step directory: samples of the steps cached here."""
        if self._samples is not None:
            return len(self._samples)
        return sum(len(v) for v in self._cache.values())

    def __getitem__(self, index: int) -> Sample:
        if self._samples is not None:
            return self._samples[index]
        step, line = divmod(int(index), STEP_STRIDE)
        entry = self._step(step)
        if not 0 <= line < len(entry):
            raise StepFileError(
                f"dataset index {index} asks for sample {line} of step {step}, which has "
                f"{len(entry)}: the step file changed after the step was planned; a written step "
                "file must not be replaced",
                file=self._path(step),
            )
        if not isinstance(entry, StepIndex):
            return entry[line]
        if self._store is not None:
            self._counts["lines_parsed"] += 1
            return self._store.read_sample(entry, step, line)
        f = self._files.get(step)
        if f is None:
            f = self._files[step] = open(self._path(step), "rb", buffering=0)  # noqa: SIM115
        self._counts["lines_parsed"] += 1
        return read_indexed_sample(f.fileno(), entry, line, file=f.name)

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """The samples of one batch of indices; a :class:`~rollfeed.loaders.plan.Planned` batch
        keeps its planner config, which the collator checks against its own."""
        return Planned.like(indices, [self[i] for i in indices])

    def _path(self, step: int) -> str:
        assert self.directory is not None
        if self._store is not None:
            return self._store.where(step_file_name(step))
        return os.path.join(self.directory, step_file_name(step))

    def _step(self, step: int) -> StepIndex | list[Sample]:
        """Step ``step``'s index, or its parsed samples when it has none (``missing_index``)."""
        self._own_process()
        entry = self._cache.get(step)
        if entry is not None:
            self._cache.move_to_end(step)
            return entry
        path = self._path(step)
        entry = self._store.read_index(step) if self._store else read_step_index(path)
        if entry is not None:
            self._counts["indexed_steps"] += 1
        elif self.missing_index == "error":
            raise StepFileError(
                f"step file has no index {index_path(path).name} and missing_index='error'; "
                "write it with build_step_index, or pass missing_index='parse'",
                file=path,
            )
        else:
            logger.warning(
                "step file %s has no index; parsing it whole (missing_index='parse'); "
                "build_step_index writes one",
                path,
            )
            entry = self._store.read_step_file(step) if self._store else read_step_file(path)
            self._counts["unindexed_steps"] += 1
            self._counts["lines_parsed"] += len(entry)
        self._cache[step] = entry
        while len(self._cache) > self.cache_steps:
            old, _ = self._cache.popitem(last=False)
            f = self._files.pop(old, None)
            if f is not None:
                f.close()
        return entry

    def steps_from(self, step: int) -> list[int]:
        """Steps from ``step`` on: in-memory ``[step]``; directory: the step files >= step."""
        if self._samples is not None:
            return [step]
        assert self.directory is not None
        steps = self._store.list_steps() if self._store else list_steps(self.directory)
        return [s for s in steps if s >= step]

    def first_step(self) -> int:
        """Step a fresh stream starts at: the oldest step file present, else 0."""
        return min(self.steps_from(0), default=0)

    def wait_for_step(self, step: int, *, timeout_s: float) -> None:
        if self.directory is None:
            raise LoaderConfigError("stream mode needs a step directory (from_step_dir)")
        if self._store is not None:
            self._store.wait_for_step(step, timeout_s=timeout_s)
            return
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
        entry = self._step(step)
        if isinstance(entry, StepIndex):
            return entry.lengths
        return np.fromiter((len(s) for s in entry), np.int64, len(entry))
