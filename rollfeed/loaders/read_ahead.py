"""ReadAhead: a loader worker makes the micro batches it will be asked for next while it makes and
hands over the one it was asked for.

A torch DataLoader worker makes one micro batch at a time, so over an object store it waits out
every request of a micro batch in turn (its samples' step records, then its payload ranges): a
worker's micro batch took 107-335 ms where the fetch alone took 22 ms in the trainer's process,
and the trainer waited 61-96 ms per micro batch at a 20 ms step. With read-ahead each worker has
several micro batches in the making at once, on threads of its own: their requests overlap (the
GIL is let go while a request waits), and one made ahead is handed out at once when asked for.

Which micro batches: the loader's DataLoader gives task ``j`` of a pass to worker ``j mod W``
(in order, from worker 0 each pass), so each task carries as a hint the tasks the same worker
gets next: those ``W``, ``2W``, ... after it in the step and, near a step's end, the first ones of
the next step once the loader has planned it (:class:`~rollfeed.loaders.loader.RolloutLoader`).
A hint is only a hint: a task not made ahead is made when asked (a wrong guess costs work, never a
wrong micro batch), and a micro batch made ahead is handed out only for a task of the same step,
indices and planned step version (so the same bytes). Only the hints of the task at hand are
kept: one made for a guess the worker's tasks proved wrong is let go. A micro batch whose making
ahead failed is made again when asked for (a missing file may be there by then), so its error, if
any, is raised by its task's own making, with its type and place.

The dataset's reads and the collator's run concurrently (a step's records are read by several
threads at once, :mod:`rollfeed.loaders.step_held`; the payload root is made for threads); the
threads are daemons, so a worker that exits does not wait for a micro batch nobody asked for.

Example (worker 0 of 2, step 3 of 8 micro batches, two hints a task)::

    asked for micro batch 0, hints (3, mb2), (3, mb4): makes mb0 here, mb2 and mb4 on its threads
    asked for mb2: made already -> handed over at once; hints (3, mb4), (3, mb6)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
THREAD_NAME = "rollfeed-read-ahead"
MAX_THREADS = 4


class ReadAhead(Generic[T]):
    """``make(indices)`` run ahead on up to :data:`MAX_THREADS` threads of this process, for the
    keys it was hinted (see the module doc)."""

    def __init__(self, make: Callable[[Sequence[int]], T]) -> None:
        self._make = make
        self._jobs: queue.SimpleQueue[tuple[Sequence[int], Future]] = queue.SimpleQueue()
        self._made: OrderedDict[Hashable, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def take(self, key: Hashable) -> Future | None:
        """The making of ``key`` if it was hinted (started or done), else ``None``; one not yet
        started is cancelled (the caller makes it itself) and ``None`` returned."""
        with self._lock:
            made = self._made.pop(key, None)
        if made is None or made.cancel():
            return None
        return made

    def hint(self, hints: Sequence[tuple[Hashable, Sequence[int]]]) -> None:
        """Start making each of ``hints`` not made or in the making; let go of every other (a
        guess the worker's tasks proved wrong, or beyond a shorter read-ahead)."""
        with self._lock:
            keys = {key for key, _ in hints}
            for key in [k for k in self._made if k not in keys]:
                self._made.pop(key).cancel()
            for key, indices in hints:
                if key not in self._made:
                    made: Future = Future()
                    self._made[key] = made
                    self._jobs.put((indices, made))
            want = min(len(hints), MAX_THREADS)
            while len(self._threads) < want:
                thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            indices, made = self._jobs.get()
            if not made.set_running_or_notify_cancel():
                continue
            try:
                made.set_result(self._make(indices))
            except BaseException as err:  # its task makes it again, if one asks for it
                logger.debug("a micro batch made ahead failed: %r", err)
                made.set_exception(err)
            del made, indices


def task_key(step: int, indices: Any) -> tuple:
    """What makes two tasks the same micro batch: the step, the indices and the step version
    they were planned from."""
    return step, tuple(int(i) for i in indices), getattr(indices, "version", None)
