"""RolloutDataset: map-style, item = :class:`~rollfeed.collate.Sample` (metadata, no payload bytes).

Its samples come from one :class:`~rollfeed.loaders.step_source.StepSource`, chosen when it is
made:

- ``RolloutDataset(samples)``: an in-memory list; every training step sees the whole list, and
  indices are list positions;
- ``RolloutDataset.from_step_dir(directory)``: the step files of a local directory or of an
  object-store prefix ``s3://bucket/prefix`` (:mod:`rollfeed.loaders.step_files`); training step
  ``k`` is file ``k``, and an index encodes ``(step, sample)`` as ``step * STEP_STRIDE +
  sample``. ``lengths(step)`` reads the step file's index only, and ``dataset[i]`` reads only
  sample ``i``'s record.

``lengths(step)`` gives token counts, ``loss_runs(step)`` where each sample's loss tokens lie
(:mod:`rollfeed.collate.loss_runs`), ``image_runs(step)`` where its images' placeholder tokens
lie (:mod:`rollfeed.collate.image_runs`) and ``policy_versions(step)`` each sample's oldest
policy version (:mod:`rollfeed.loaders.staleness`) without building micro batches, so the
sampler plans, and counts the step's loss tokens, from them only; ``step_version(step)`` names
the version of the step file they came from (:mod:`rollfeed.loaders.step_version`). A batch of
indices the sampler planned carries that version and the planned lengths: this process reads the
step through a file open on that version (an older copy of the index, a forked worker's, is read
again), and a step file that is not that version, or a sample of another length, raises
:class:`StepReplacedError`. A step that has no file raises :class:`StepMissingError` naming the
step and the directory.

Example: steps 3 and 4 of two and one samples -> ``step_indices(4) == [4 * 2**32 + 0]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
from torch.utils.data import Dataset

from rollfeed.collate import ImageRuns, LossRuns, Sample
from rollfeed.loaders.errors import StepReplacedError
from rollfeed.loaders.plan import Planned
from rollfeed.loaders.step_identity import StepIdentity
from rollfeed.loaders.step_source import STEP_STRIDE, SampleSteps, StepSource, StoredSteps
from rollfeed.loaders.step_version import StepVersion
from rollfeed.payload import is_store_url

__all__ = ["STEP_STRIDE", "RolloutDataset"]


class RolloutDataset(Dataset[Sample]):
    """Samples of training steps; see the module doc for the sources and index encoding."""

    def __init__(self, samples: Sequence[Sample] | StepSource) -> None:
        self.source: StepSource = (
            samples if isinstance(samples, SampleSteps | StoredSteps) else SampleSteps(samples)
        )

    @classmethod
    def from_step_dir(
        cls,
        directory: str | os.PathLike[str],
        *,
        cache_steps: int = 2,
        store: Mapping[str, object] | None = None,
    ) -> RolloutDataset:
        """Steps from ``directory``: a local directory, or ``s3://bucket/prefix`` (``store``:
        its endpoint, region and credentials, as :class:`~rollfeed.payload.PayloadRoot` takes
        them; by default the ``AWS_*`` variables). Each process keeps its last ``cache_steps``
        steps.

        A local directory is checked at once (:class:`LoaderConfigError`): it must exist (a
        missing one is far more often a mistyped path than a producer yet to start, and waiting
        for it would only delay the error; create it to start a trainer first), and one that
        holds no step file while a subfolder does -- a run folder given for its ``steps/`` -- is
        refused naming that subfolder. An empty directory is fine: passes wait for the producer.
        """
        source = StoredSteps(directory, cache_steps=cache_steps, store=store)
        if not is_store_url(source.directory):
            source.check()  # an object store is not asked before the first pass
        return cls(source)

    @property
    def directory(self) -> str | None:
        """The step directory or prefix (``None`` for an in-memory list)."""
        return self.source.directory

    @property
    def streams(self) -> bool:
        """True when steps come from a directory that can grow (stream mode possible)."""
        return self.source.streams

    def where(self, step: int) -> str | None:
        """The path or URL of step ``step``'s file (``None`` for an in-memory list)."""
        return self.source.where(step)

    def metrics(self) -> dict[str, int]:
        """This process's counters: ``steps_loaded`` (step files whose index was read) and
        ``samples_read`` (records read)."""
        return self.source.metrics()

    def __len__(self) -> int:
        """In-memory: the list's length. Step directory: samples of the steps cached here."""
        return len(self.source)

    def __getitem__(self, index: int) -> Sample:
        return self.source.sample(*self.source.locate(index), None)

    def __getitems__(self, indices: Sequence[int]) -> list[Sample]:
        """The samples of one batch of indices. A :class:`~rollfeed.loaders.plan.Planned` batch
        is read from the step file version it was planned from, each sample held to its planned
        length (see the module doc), and keeps its planner config, which the collator checks
        against its own."""
        version = getattr(indices, "version", None)
        samples = [self.source.sample(*self.source.locate(i), version) for i in indices]
        lengths = getattr(indices, "lengths", None)
        for i, sample, planned in zip(indices, samples, lengths or (), strict=True):
            if len(sample) != planned:
                step, k = self.source.locate(i)
                raise StepReplacedError(
                    f"sample {k} of step {step} has {len(sample)} tokens, the plan has "
                    f"{planned}: the samples changed after the step was planned; a written step "
                    "must not be replaced",
                    file=self.source.where(step),
                    step=step,
                )
        return Planned.like(indices, samples)

    def steps_from(self, step: int) -> list[int]:
        """Steps from ``step`` on: in-memory ``[step]``; directory: the step files >= step."""
        return self.source.steps_from(step)

    def first_step(self) -> int:
        """Step a fresh stream starts at: the oldest step file present, else 0."""
        return min(self.steps_from(0), default=0)

    def wait_for_step(self, step: int, *, timeout_s: float, exact: bool = True) -> int:
        """Step ``step`` once its file is there (``exact=False``: the first step file from
        ``step`` on); a bounded, logged wait (:mod:`~rollfeed.loaders.step_wait`)."""
        return self.source.wait_for_step(step, timeout_s=timeout_s, exact=exact)

    def step_indices(self, step: int) -> np.ndarray:
        """``[n]`` int64 dataset indices of step ``step``'s samples, in file (list) order."""
        return self.source.indices(step)

    def lengths(self, step: int = 0) -> np.ndarray:
        """``[n]`` int64 token count of each sample of ``step``, aligned with ``step_indices``."""
        return self.source.loaded(step).lengths

    def loss_runs(self, step: int = 0) -> LossRuns:
        """Each sample's loss runs in ``step`` (aligned with ``step_indices``): from the index,
        or from the samples of an in-memory list."""
        return self.source.loaded(step).runs

    def image_runs(self, step: int = 0) -> ImageRuns | None:
        """Each sample's image placeholder runs in ``step`` (aligned with ``step_indices``), or
        ``None`` when no sample of the step holds an image: from the index, or from the samples
        of an in-memory list."""
        return self.source.loaded(step).images

    def policy_versions(self, step: int = 0) -> np.ndarray:
        """``[n]`` int64 oldest policy version of each sample of ``step`` (-1: none), aligned
        with ``step_indices``: from the index, or from the samples of an in-memory list."""
        return self.source.loaded(step).policy_versions

    def step_identity(self, step: int) -> StepIdentity:
        """The identity of step ``step``'s samples (:mod:`~rollfeed.loaders.step_identity`),
        which a saved state's count of micro batches is held to."""
        return self.source.loaded(step).identity

    def step_version(self, step: int) -> StepVersion | None:
        """The version of step ``step``'s file that ``lengths(step)`` describes (``None`` for an
        in-memory list)."""
        return self.source.loaded(step).version
