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

``lengths(step)`` gives token counts, ``loss_runs(step)`` where each sample's loss tokens lie
(:mod:`rollfeed.collate.loss_runs`) and ``image_runs(step)`` where its images' placeholder tokens
lie (:mod:`rollfeed.collate.image_runs`) without building micro batches, so the sampler plans, and
counts the step's loss tokens, from them only (from the index, or from the samples of a list or a
step parsed whole: the same runs either way); ``step_version(step)`` names the version of the step
file they came from (:mod:`rollfeed.loaders.step_version`). A batch of indices the sampler planned
carries that version and the planned lengths: this process reads the step through a descriptor on
that version (an older copy of the index, a forked worker's, is read again), and a step file that is
not that version, or a sample of another length, raises :class:`StepReplacedError`. A step that has
no file raises :class:`StepMissingError` naming the step and the directory.

Example: steps 3 and 4 of two and one samples -> ``step_indices(4) == [4 * 2**32 + 0]``.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import BinaryIO

import numpy as np
from torch.utils.data import Dataset

from rollfeed.collate import ImageRuns, LossRuns, Sample
from rollfeed.loaders.errors import LoaderConfigError, StepFileError, StepReplacedError
from rollfeed.loaders.plan import Planned
from rollfeed.loaders.step_files import list_steps, step_file_name
from rollfeed.loaders.step_identity import StepIdentity
from rollfeed.loaders.step_index import StepIndex
from rollfeed.loaders.step_index_check import read_indexed_sample
from rollfeed.loaders.step_load import (
    MISSING_INDEX,
    LoadedStep,
    MissingIndex,
    load_local,
    load_stored,
)
from rollfeed.loaders.step_open import open_step
from rollfeed.loaders.step_store import StepStore
from rollfeed.loaders.step_version import StepVersion, replaced_error
from rollfeed.loaders.step_wait import check_step_dir, wait_in_directory
from rollfeed.payload.stores.store_url import is_store_url

STEP_STRIDE = 1 << 32
MAX_STEP = (1 << 31) - 1  # the largest step whose dataset indices fit int64


class RolloutDataset(Dataset[Sample]):
    """Samples of training steps; see the module doc for the two sources and index encoding."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self._samples: Sequence[Sample] | None = samples
        self._lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
        self.directory: str | None = None
        self._store: StepStore | None = None  # step files in an object store (s3://...)
        self.cache_steps = 0
        self.missing_index: MissingIndex = "parse"
        self._identity: StepIdentity | None = None  # an in-memory list's, once asked for
        self._runs: LossRuns | None = None  # an in-memory list's, once asked for
        self._images: tuple[ImageRuns | None] | None = None  # an in-memory list's, once asked for
        self._reset()

    def _reset(self) -> None:
        """Per-process state: cached steps, open step files, counters."""
        self._cache: OrderedDict[int, LoadedStep] = OrderedDict()
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
        by default the ``AWS_*`` variables).

        A local directory is checked at once (:class:`LoaderConfigError`): it must exist (a
        missing one is far more often a mistyped path than a producer yet to start, and waiting
        for it would only delay the error; create it to start a trainer first), and one that
        holds no step file while a subfolder does -- a run folder given for its ``steps/`` -- is
        refused naming that subfolder. An empty directory is fine: passes wait for the producer.
        """
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
        check_step_dir(os.path.abspath(directory))
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
        keys += ("_identity", "_runs", "_images")
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
        return sum(len(v.entry) for v in self._cache.values())

    def __getitem__(self, index: int) -> Sample:
        return self._sample(index, None)

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """The samples of one batch of indices. A :class:`~rollfeed.loaders.plan.Planned` batch
        is read from the step file version it was planned from, each sample held to its planned
        length (see the module doc), and keeps its planner config, which the collator checks
        against its own."""
        version = getattr(indices, "version", None)
        samples = [self._sample(i, version) for i in indices]
        lengths = getattr(indices, "lengths", None)
        for i, sample, planned in zip(indices, samples, lengths or (), strict=True):
            if len(sample) != planned:
                step, line = divmod(int(i), STEP_STRIDE)
                raise StepReplacedError(
                    f"sample {line} of step {step} has {len(sample)} tokens, the plan has "
                    f"{planned}: the samples changed after the step was planned; a written step "
                    "must not be replaced",
                    file=None if self._samples is not None else self._path(step),
                    step=step,
                )
        return Planned.like(indices, samples)

    def _sample(self, index: int, version: StepVersion | None) -> Sample:
        if self._samples is not None:
            return self._samples[index]
        step, line = divmod(int(index), STEP_STRIDE)
        entry = self._loaded(step, version).entry
        if not 0 <= line < len(entry):
            raise StepReplacedError(
                f"dataset index {index} asks for sample {line} of step {step}, which has "
                f"{len(entry)}: the step file changed after the step was planned; a written step "
                "file must not be replaced",
                file=self._path(step),
                step=step,
            )
        if not isinstance(entry, StepIndex):
            return entry[line]
        self._counts["lines_parsed"] += 1
        if self._store is not None:
            return self._store.read_sample(entry, self._cache[step].version, step, line)
        f = self._files[step]  # the version's descriptor (_loaded)
        return read_indexed_sample(f.fileno(), entry, line, file=self._path(step))

    def _path(self, step: int) -> str:
        assert self.directory is not None
        if self._store is not None:
            return self._store.where(step_file_name(step))
        return os.path.join(self.directory, step_file_name(step))

    def _loaded(self, step: int, want: StepVersion | None = None) -> LoadedStep:
        """Step ``step`` as this process holds it, of version ``want`` when given.

        This process's copy is read again when it cannot be read as it is (a forked worker
        inherits indexes but not descriptors, and the file at the path is now another version)
        or is not ``want`` (a worker's copy older than the plan); :class:`StepReplacedError`
        when the step file is still not ``want``."""
        self._own_process()
        got = self._cache.get(step)
        if got is not None and (
            not self._readable(step, got) or (want is not None and got.version != want)
        ):
            self._forget(step)
            got = None
        if got is None:
            got = self._cache[step] = self._load(step)
            while len(self._cache) > self.cache_steps:
                self._forget(next(iter(self._cache)))
        else:
            self._cache.move_to_end(step)
        if want is not None and got.version != want:
            raise replaced_error(step, self._path(step), want, got.version)
        return got

    def _readable(self, step: int, got: LoadedStep) -> bool:
        """Whether this process reads ``got``'s lines from its version: by ``If-Match`` (a
        store), from memory (parsed samples) or through a descriptor on that file."""
        if self._store is not None or not isinstance(got.entry, StepIndex) or step in self._files:
            return True
        fd = open_step(self._path(step), what="step file")
        if fd is None:
            return False
        f = os.fdopen(fd, "rb", buffering=0)
        if StepVersion.of_stat(os.fstat(fd)) != got.version:
            f.close()
            return False
        self._files[step] = f
        return True

    def _forget(self, step: int) -> None:
        self._cache.pop(step, None)
        f = self._files.pop(step, None)
        if f is not None:
            f.close()

    def _load(self, step: int) -> LoadedStep:
        """Step ``step``'s index, or its parsed samples when it has none (``missing_index``)."""
        if step > MAX_STEP:
            raise StepFileError(
                f"step {step} is beyond the largest step a loader reads, {MAX_STEP} (a dataset "
                "index is step * 2**32 + line, in int64); number steps from 0",
                file=self._path(step),
                step=step,
            )
        if self._store is not None:
            got = load_stored(self._store, step, missing_index=self.missing_index)
        else:
            assert self.directory is not None
            got, f = load_local(
                self._path(step), step, self.directory, missing_index=self.missing_index
            )
            if f is not None:
                self._files[step] = f
        if got.indexed:
            self._counts["indexed_steps"] += 1
        else:
            self._counts["unindexed_steps"] += 1
            self._counts["lines_parsed"] += len(got.entry)
        return got

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

    def wait_for_step(self, step: int, *, timeout_s: float, exact: bool = True) -> int:
        """Step ``step`` once its file is there (``exact=False``: the first step file from
        ``step`` on); a bounded, logged wait (:mod:`~rollfeed.loaders.step_wait`)."""
        if self._samples is not None:
            return step  # a list has every step
        if self._store is not None:
            return self._store.wait_for_step(step, timeout_s=timeout_s, exact=exact)
        assert self.directory is not None
        return wait_in_directory(self.directory, step, exact=exact, timeout_s=timeout_s)

    def step_indices(self, step: int) -> np.ndarray:
        """``[n]`` int64 dataset indices of step ``step``'s samples, in file (list) order."""
        if self._samples is not None:
            return np.arange(len(self._samples), dtype=np.int64)
        return step * STEP_STRIDE + np.arange(len(self._loaded(step).entry), dtype=np.int64)

    def lengths(self, step: int = 0) -> np.ndarray:
        """``[n]`` int64 token count of each sample of ``step``, aligned with ``step_indices``."""
        if self._samples is not None:
            return self._lengths
        entry = self._loaded(step).entry
        if isinstance(entry, StepIndex):
            return entry.lengths
        return np.fromiter((len(s) for s in entry), np.int64, len(entry))

    def loss_runs(self, step: int = 0) -> LossRuns:
        """Each sample's loss runs in ``step`` (aligned with ``step_indices``): from the index,
        or from the samples (an in-memory list; a step parsed whole)."""
        if self._samples is not None:
            if self._runs is None:
                self._runs = LossRuns.of_samples(self._samples)
            return self._runs
        entry = self._loaded(step).entry
        return entry.runs if isinstance(entry, StepIndex) else LossRuns.of_samples(entry)

    def image_runs(self, step: int = 0) -> ImageRuns | None:
        """Each sample's image placeholder runs in ``step`` (aligned with ``step_indices``), or
        None when no sample of the step holds an image: from the index, or from the samples."""
        if self._samples is not None:
            if self._images is None:
                has = any(s.images for s in self._samples)
                self._images = (ImageRuns.of_samples(self._samples) if has else None,)
            return self._images[0]
        entry = self._loaded(step).entry
        if isinstance(entry, StepIndex):
            return entry.images
        return ImageRuns.of_samples(entry) if any(s.images for s in entry) else None

    def step_identity(self, step: int) -> StepIdentity:
        """The identity of step ``step``'s samples (:mod:`~rollfeed.loaders.step_identity`),
        which a saved state's count of micro batches is held to."""
        if self._samples is not None:
            if self._identity is None:
                self._identity = StepIdentity.of_samples(self._samples)
            return self._identity
        return self._loaded(step).identity

    def step_version(self, step: int) -> StepVersion | None:
        """The version of step ``step``'s file that ``lengths(step)`` describes (``None`` for an
        in-memory list)."""
        return None if self._samples is not None else self._loaded(step).version
