"""The step after a pass's, planned as the pass starts, so that its first micro batches can be
made ahead (:mod:`~rollfeed.loaders.read_ahead`) while the trainer takes the pass's last ones.

Planning a step reads its index (over an object store: a listing, a GET and a HEAD), which the
next pass would otherwise do in ``iter`` before any worker could start on it. Here the step after
the pass's is planned when the pass's first task is drawn (in ``iter``, where the pass's own step
was planned), and only if its file is already there (never waited for: a producer that is behind
costs nothing), the way the next pass will find it (stream: exactly the next step; else the first
step file from it on). It is the sampler's own planning, which the next pass then finds done, so
in a run of steps it moves the planning of each step one pass earlier rather than adding any. It
may fail (a bad step file) without a word here: the pass that reaches that step raises it, typed,
as it would have.

Example: as step 7's pass starts, ``plan_following(sampler, 7)`` -> ``(8, [Planned, ...])`` if
``step_000008`` exists, else ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def plan_following(sampler: Any, step: int) -> tuple[int, Sequence[Any]] | None:
    """``(step, micro batches)`` of the step after ``step`` if its file is there (see the module
    doc), else ``None``."""
    try:
        found = sampler.dataset.steps_from(step + 1)[:1]
        if found and (found[0] == step + 1 or not sampler.config.stream):
            return found[0], sampler.step_micro_batches(found[0])
    except Exception as err:  # raised by the pass that reaches the step, if one does
        logger.debug("planning the step after %d ahead failed: %r", step, err)
    return None
