"""Receive thread: the trainer's ``next`` takes a micro batch that is already in this process.

With workers, handing a batch over (the storage's fd over a socket, ``mmap``, unpickling) costs the
receiving thread milliseconds; a plain ``DataLoader`` pays it inside the trainer's ``next``.
:class:`Receiver` runs that receive (and pinning) on a daemon thread, ``depth`` items ahead, while
the trainer computes -- torch's pin-memory thread, applied to the whole receive. Only the thread
touches the source until :meth:`Receiver.stop`; an error of the source is re-raised by ``get``.
Freeing a received batch (unmapping its shared memory) costs about as much as receiving it, so
``get`` hands the item it returned before to the thread to drop.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

THREAD_NAME = "rollfeed-receive"
_END, _ERROR = object(), object()
_POLL_S = 0.5  # how often a waiting ``get`` checks that the thread is still there


class Receiver:
    """Items of ``source``, each passed through ``prepare``, received ``depth`` ahead."""

    def __init__(self, source: Iterator[Any], prepare: Callable[[Any], Any], *, depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.release: collections.deque[Any] = collections.deque()  # for the thread to drop
        self._last: Any = None
        self.thread = threading.Thread(
            target=self._run, args=(source, prepare), name=THREAD_NAME, daemon=True
        )
        self.thread.start()

    def _run(self, source: Iterator[Any], prepare: Callable[[Any], Any]) -> None:
        try:
            while not self.stopped.is_set():
                while self.release:
                    self.release.popleft()
                self.queue.put((prepare(next(source)), None))
        except StopIteration:
            self.queue.put((_END, None))
        except BaseException as err:  # re-raised by the trainer's get
            self.queue.put((_ERROR, err))

    def get(self) -> Any:
        """The next item; ``StopIteration`` at the source's end or once stopped."""
        if self._last is not None:
            self.release.append(self._last)
            self._last = None
        while not self.stopped.is_set():
            try:
                item, err = self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self.thread.is_alive() or not self.queue.empty():
                    continue
                break  # ended without a word (only if interrupted at exit)
            if item is _ERROR:
                self.stopped.set()
                try:
                    raise err
                finally:
                    del item, err  # the traceback holds this frame: no cycle through the error
            if item is _END:
                break
            self._last = item
            return item
        self.stopped.set()
        raise StopIteration

    def stop(self, *, wait: bool) -> None:
        """Stop the thread; emptying the queue frees one blocked in ``put``."""
        self.stopped.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if wait:
            self.thread.join()
