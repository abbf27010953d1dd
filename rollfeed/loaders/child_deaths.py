"""ChildDeaths: the process's ``SIGCHLD`` handler, raising a loader worker's death typed, once.

torch installs a ``SIGCHLD`` handler that raises an untyped ``RuntimeError`` in the main thread,
wherever it is, when a DataLoader worker died. :func:`arm` wraps it once per process: the death
of a watched loader's worker (:class:`~rollfeed.loaders.watch.WorkerWatch`) is raised as
:class:`~rollfeed.loaders.errors.WorkerDiedError` instead, and a death already reported (here,
by the watch, or a worker the loader killed itself: :func:`report`) is not raised again, e.g.
when the loader lets the other workers of that DataLoader go. Watches register weakly.
"""

from __future__ import annotations

import re
import signal
import threading
import weakref
from typing import Any

from rollfeed.loaders.errors import WorkerDiedError

_TORCH_PIDS = re.compile(r"\(pid(?:\(s\))? ([\d, ]+)\)")  # the pids torch's death error names


class ChildDeaths:
    """The handler (see the module doc); ``previous``: the one it wraps."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.watches: weakref.WeakSet[Any] = weakref.WeakSet()
        self.reported: set[int] = set()

    def __call__(self, signum: int, frame: Any) -> None:
        try:
            if callable(self.previous):
                self.previous(signum, frame)
            return
        except RuntimeError as err:
            failure = self._typed(err)
            if failure is None and self._only_reported(err):
                return
            if failure is None:
                raise
        # raised here, without the torch error as context and without the interrupted frame
        # (``frame``), which may hold the DataLoader's iterator (see WorkerWatch.next)
        del frame
        raise failure

    def _typed(self, err: RuntimeError) -> WorkerDiedError | None:
        for watch in list(self.watches):
            dead = [(w, pid) for w, pid in watch.dead() if pid not in self.reported]
            if dead:
                return watch.died(dead, err)
        return None

    def _only_reported(self, err: RuntimeError) -> bool:
        named = _TORCH_PIDS.search(str(err))
        pids = {int(p) for p in named.group(1).split(",")} if named else set()
        return bool(pids) and pids <= self.reported


def arm(watch: Any) -> None:
    """Have the ``SIGCHLD`` handler raise ``watch``'s worker deaths typed (from the main thread
    only, where signal handlers are set, as torch's own)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGCHLD)
    if not isinstance(handler, ChildDeaths):
        handler = ChildDeaths(handler)
        signal.signal(signal.SIGCHLD, handler)
    handler.watches.add(watch)


def report(pid: int) -> None:
    """Count the death of worker ``pid`` as reported: the handler raises nothing for it."""
    handler = signal.getsignal(signal.SIGCHLD)
    if isinstance(handler, ChildDeaths):
        handler.reported.add(pid)
