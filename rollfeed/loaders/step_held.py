"""HeldSteps: what one process holds of a step directory (its cached steps, their open files, its
counters), shared by the process's threads.

A loader worker reads a step's records from several threads at once (its read-ahead,
:mod:`rollfeed.loaders.read_ahead`), so the reads must not queue behind one another: a record is
a positional read of the step file (``pread`` on a local file, a block of a pinned object on a
store), which threads may run together. What they share is guarded by one lock, taken only to
look a step up, open or load it, and count: never across a record's read. A step file evicted
from the cache while a thread still reads from it is closed when the last such read ends
(:meth:`HeldSteps.release`), so a read never meets a closed (or, locally, a reused) descriptor.

One :class:`HeldSteps` per process: a forked worker starts its own with a copy of the parent's
cached indexes (copy-on-write memory) but no open files, lock or counts of the parent's (a lock
the parent's planner thread held at the fork would stay held in the child).

Example (a worker's read-ahead threads A and B, step 3 cached, its file open)::

    A: with held.lock: f = held.take(3)       B: with held.lock: g = held.take(3)
    A: f.read(index, 5)                       B: g.read(index, 9)    # at once, no lock held
    A: held.release(f)                        B: held.release(g)
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any

from rollfeed.payload import StepRecordFile


class HeldSteps:
    """One process's cached steps (``cache``: step -> its loaded step, oldest first), their open
    files (``files``), counters (``counts``) and the ``lock`` guarding them (see the module
    doc); re-entrant, since loading a step evicts others."""

    def __init__(self, cache: OrderedDict[int, Any] | None = None) -> None:
        self.lock = threading.RLock()
        self.cache: OrderedDict[int, Any] = OrderedDict(cache or {})
        self.files: dict[int, StepRecordFile] = {}
        self.counts: Counter[str] = Counter()
        self._reads: Counter[StepRecordFile] = Counter()  # reads in flight, per open file
        self._retired: set[StepRecordFile] = set()  # evicted while read: closed by the last read

    def forget(self, step: int) -> None:
        """Drop step ``step`` and its file (closed now, or when its last read in flight ends).
        The caller holds ``lock``."""
        self.cache.pop(step, None)
        f = self.files.pop(step, None)
        if f is None:
            return
        if self._reads[f]:
            self._retired.add(f)
        else:
            f.close()

    def take(self, step: int) -> StepRecordFile:
        """Step ``step``'s open file for one read, kept open until :meth:`release` (the caller
        holds ``lock``, having just loaded the step; the read itself runs without it)."""
        f = self.files[step]
        self._reads[f] += 1
        return f

    def release(self, f: StepRecordFile) -> None:
        """One read of ``f`` has ended: close it if it was evicted meanwhile and this was its
        last read."""
        with self.lock:
            self._reads[f] -= 1
            if not self._reads[f]:
                del self._reads[f]
                if f in self._retired:
                    self._retired.discard(f)
                    f.close()
