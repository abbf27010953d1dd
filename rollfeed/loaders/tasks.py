"""Tasks: the loader's DataLoader's batch sampler, the sampler's index lists as worker tasks.

Each :class:`~rollfeed.loaders.worker.Task` carries its micro batch's indices, its step, the
sampler's state right after it (what the loader reports once the trainer consumed it), the step's
plan metrics and, with workers, the hints of its worker's read-ahead
(:mod:`~rollfeed.loaders.hints`): the tasks the same worker is given next, in this step and, as
the next step is planned when a pass starts (:mod:`~rollfeed.loaders.next_step`), in that one.
``pace`` measures what sizes the read-ahead (the loader feeds it as it hands micro batches out).

Example (8 micro batches, 2 workers, depth 2): the task at position 0 -> hints positions 2, 4.
"""

from __future__ import annotations

from collections.abc import Iterator

from rollfeed.loaders.hints import Pace, worker_hints
from rollfeed.loaders.next_step import plan_following
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.worker import Task


class Tasks:
    """The DataLoader's batch sampler: the sampler's index lists as :class:`Task`s, each with
    the hints of its worker's read-ahead (:mod:`~rollfeed.loaders.hints`) when ``workers``."""

    def __init__(self, sampler: MicroBatchSampler, workers: int, depth: int | None) -> None:
        self.sampler, self.yielded = sampler, 0  # yielded: tasks drawn in the current pass
        self.step: int | None = None  # the step of the tasks drawn in the current pass
        self.workers, self.depth, self.pace = workers, depth, Pace()

    def __iter__(self) -> Iterator[Task]:
        plan, micro, following = None, [], None
        for indices in self.sampler:
            state = self.sampler.state_dict()
            self.yielded += 1
            # right after micro batch k of step s: (s, k + 1), or (s + 1, 0) after its last
            step = state["step"] - (state["micro_batches"] == 0)
            if plan is None:
                self.step, plan = step, self.sampler.plan_metrics(step)
                if self._depth():
                    micro = self.sampler.step_micro_batches(step)
                    following = plan_following(self.sampler, step)
            hints = self._hints(step, state, micro, following)
            yield Task(indices, step, state, plan, hints)

    def _depth(self) -> int:
        if not self.workers:
            return 0
        return self.pace.depth(self.workers) if self.depth is None else self.depth

    def _hints(self, step: int, state: dict, micro: list, following) -> tuple:
        depth = self._depth()
        if not depth or not micro:
            return ()
        k = state["micro_batches"] - 1 if state["micro_batches"] else len(micro) - 1
        j, w = self.yielded - 1, self.workers
        return worker_hints(step, micro, k=k, j=j, workers=w, depth=depth, following=following)
