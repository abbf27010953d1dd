"""Which micro batch each loader worker warms up on as it starts, before its first task.

A worker's first task is made cold: over an object store it connects, reads the step's index
and the blocks its records lie in, while its read-ahead (:mod:`~rollfeed.loaders.read_ahead`)
makes its next micro batches on threads beside it, which all wait for the same index and
contend for the same interpreter lock: a worker's first micro batch took 250-900 ms where a
warm one takes ~30 ms. So each worker, as it starts and on its one thread, reads the samples of
the task it will be given first (:meth:`~rollfeed.loaders.worker.MicroBatchWork.warm`): the
step's index, its file and those records' blocks are then held when the task comes. Over
``python -m rollfeed.bench object_store`` this took a worker's reading of samples from 29-66 ms
a micro batch (the first task's, read by five threads at once, averaged over the pass) to 3-6 ms.

The loader's DataLoader gives the ``w``-th task of a pass to worker ``w``, and a pass starts at
the sampler's position, so worker ``w`` first makes micro batch ``start + w`` of the step the
pass starts at. That step is planned here only if its file is already there (never waited
for: the pass waits, bounded, as it always does); a worker whose first task lies beyond the
step, or a step that cannot be planned now, warms nothing (the pass meets any error itself,
typed). A warm-up is only a read ahead of time: the task reads its samples through the same
per-process cache, checked against its plan as every read is.

Example (step 3 of 5 micro batches, 3 consumed, 4 workers)::

    first_tasks(sampler, 4) -> (micro[3], micro[4], None, None)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def first_tasks(sampler: Any, workers: int) -> tuple[Sequence[int] | None, ...]:
    """The indices of each worker's first task of the pass the sampler would start now (see the
    module doc), ``None`` for a worker with none known now."""
    none: tuple[Sequence[int] | None, ...] = (None,) * workers
    try:
        state = sampler.state_dict()
        step, start = state["step"], state["micro_batches"]
        if step not in sampler.dataset.steps_from(step)[:1]:
            return none
        micro = sampler.step_micro_batches(step)
    except Exception as err:  # raised, typed, by the pass that reaches the step
        logger.debug("planning the first tasks of step %s for warm-up failed: %r", step, err)
        return none
    return tuple(micro[k] if k < len(micro) else None for k in range(start, start + workers))
