"""Which micro batches a loader worker is told to make ahead, and how many.

Pure planning for :mod:`~rollfeed.loaders.read_ahead`: the loader's DataLoader gives task ``j``
of a pass to worker ``j mod W`` (in order, from worker 0 each pass), so the task at position ``k``
of its step, drawn ``j``-th in the pass, is followed on its worker by positions ``k + W``,
``k + 2W``, ... of the step and then, in the next pass (which starts at position 0 of the next
step), by positions ``w``, ``w + W``, ... of that step, ``w = j mod W``. :func:`worker_hints`
lists the first ``depth`` of them.

How many (:class:`Pace`): a worker keeps up when ``W`` workers, each with ``c`` micro batches in
the making, make one micro batch per trainer step: ``c = ceil(make / (W · busy))``, from the
measured time a worker takes to make one (``make``) and the trainer's time between two ``next``
calls (``busy``); clamped to ``1 .. MAX_DEPTH``; as deep as allowed before anything is measured
(:data:`FIRST_DEPTH`: a first pass does not know how far its store is).
Each micro batch made ahead is held in its worker until asked for: a worker holds ``depth``
more micro batches than without read-ahead.

Example (8 micro batches, 2 workers, depth 3; the task at position 4, drawn 4th, next step of 6
micro batches planned)::

    worker_hints(7, micro, k=4, j=4, workers=2, depth=3, following=(8, nxt))
    -> ((7, micro[6]), (8, nxt[0]), (8, nxt[2]))
    Pace: make 90 ms, busy 20 ms, 2 workers -> depth ceil(90 / 40) = 3
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MAX_DEPTH = 4
FIRST_DEPTH = MAX_DEPTH  # nothing measured yet: how far the store is, is not known
_SMOOTH = 0.3  # weight of the newest measurement in the running means


def worker_hints(
    step: int,
    micro: Sequence[Any],
    *,
    k: int,
    j: int,
    workers: int,
    depth: int,
    following: tuple[int, Sequence[Any]] | None = None,
) -> tuple[tuple[int, Any], ...]:
    """``(step, micro batch)`` of the next ``depth`` tasks the worker of task ``j`` (at position
    ``k`` of ``step``'s ``micro``) is given: the rest of this step's, then ``following``'s (the
    next step and its micro batches) when it is planned."""
    out = [(step, micro[i]) for i in range(k + workers, len(micro), workers)][:depth]
    if following is not None and len(out) < depth:
        nxt, later = following
        room = depth - len(out)
        out += [(nxt, later[i]) for i in range(j % workers, len(later), workers)][:room]
    return tuple(out)


class Pace:
    """Running means of a worker's time to make a micro batch and of the trainer's time between
    two ``next`` calls, and the read-ahead depth they call for (see the module doc)."""

    def __init__(self) -> None:
        self.make_s: float | None = None
        self.busy_s: float | None = None

    def add(self, make_s: float, busy_s: float) -> None:
        self.make_s = _mean(self.make_s, make_s)
        self.busy_s = _mean(self.busy_s, busy_s)

    def depth(self, workers: int) -> int:
        if self.make_s is None or self.busy_s is None:
            return FIRST_DEPTH
        busy = max(self.busy_s, 1e-4)  # a trainer that never waits: as deep as allowed
        return max(1, min(MAX_DEPTH, math.ceil(self.make_s / (workers * busy))))


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTH * (new - old)
