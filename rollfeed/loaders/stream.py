"""Stream mode: train step after step as an orchestrator drops step files.

``build_dataloader(RolloutDataset.from_step_dir(d), ..., stream=True)`` gives a loader whose every
pass is the next step: starting a pass waits (bounded by ``step_timeout_s``, then
:class:`~rollfeed.loaders.errors.StepTimeoutError` naming the file) for that step's file, and the
persistent workers, with their open payload files, carry over from step to step.
:func:`stream_micro_batches` is that loop, labelled with step numbers::

    for step, tmb in stream_micro_batches(loader, steps=1000):
        ...                         # loader.state_dict() at any point resumes exactly there
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch.utils.data import DataLoader

from rollfeed.collate import TensorMicroBatch
from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.sampler import MicroBatchSampler


def stream_micro_batches(
    loader: DataLoader, *, steps: int | None = None
) -> Iterator[tuple[int, TensorMicroBatch]]:
    """``(step, micro batch)`` over ``steps`` passes (``None``: until the wait times out)."""
    sampler = loader.batch_sampler
    if not isinstance(sampler, MicroBatchSampler):
        raise LoaderConfigError("stream_micro_batches needs a loader from build_dataloader")
    for _ in itertools.count() if steps is None else range(steps):
        step = sampler.step  # read before the pass: prefetching moves the sampler ahead
        for tmb in loader:
            yield step, tmb
