"""NextStep: the step after a pass's, planned on a thread while the pass runs, so its first micro
batches can be made ahead (:mod:`~rollfeed.loaders.read_ahead`) before the trainer asks for them.

Planning a step reads its index (over an object store: a listing, a GET and a HEAD), which the
next pass would otherwise do in ``iter`` before any worker could start on it. Here the step after
the pass's is planned only if its file is already there (never waited for: a producer that is
behind costs nothing), the way the next pass will find it (stream: exactly the next step; else the
first step file from it on). What the thread does is the sampler's own planning, which the next
pass then finds done; it may fail (a bad step file) without a word here, since the pass that
reaches that step raises it, typed, as it would have. The loader joins the thread before
anything else touches the sampler (the next ``iter``, ``len``, ``load_state_dict``, ``close``).

Example: during step 7's pass, ``NextStep(sampler, 7)`` plans step 8 if ``step_000008`` exists;
``ready()`` -> ``(8, [Planned, ...])`` once done, ``None`` before (or when there is none).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)
THREAD_NAME = "rollfeed-next-step"


class NextStep:
    """The plan of the step after ``step`` (see the module doc), made on a thread."""

    def __init__(self, sampler: Any, step: int) -> None:
        self._plan: tuple[int, Sequence[Any]] | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sampler, step), name=THREAD_NAME, daemon=True
        )
        self._thread.start()

    def _run(self, sampler: Any, step: int) -> None:
        try:
            found = sampler.dataset.steps_from(step + 1)[:1]
            if found and (found[0] == step + 1 or not sampler.config.stream):
                self._plan = found[0], sampler.step_micro_batches(found[0])
        except Exception as err:  # raised by the pass that reaches the step, if one does
            logger.debug("planning the step after %d ahead failed: %r", step, err)
        finally:
            self._done.set()

    def ready(self) -> tuple[int, Sequence[Any]] | None:
        """``(step, micro batches)`` once planned; ``None`` before, or when there is none."""
        return self._plan if self._done.is_set() else None

    def join(self) -> None:
        """Wait for the thread (its requests have bounds of their own)."""
        self._thread.join()
