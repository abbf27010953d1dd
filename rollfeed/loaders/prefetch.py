"""Receive thread: the trainer's ``next`` takes a micro batch that is already in this process.

With workers, handing a batch to the main process (the storage's fd over a socket, ``mmap``,
unpickling) costs the receiving thread milliseconds per batch on some machines; a plain
``DataLoader`` pays it inside the trainer's ``next``. :class:`PrefetchStepDataLoader` runs that
receive (and pinning, when CUDA is there) on a daemon thread, ``depth`` batches ahead, while the
trainer computes; ``next`` is then a queue get. The idea is the one of torch's own pin-memory
thread, applied to the whole receive.

Exact state. The thread reads the source iterator's ``state_dict()`` right after each batch (and
after the pass's end) and hands it over with the batch, so the loader's ``state_dict()`` is the
state as of the batches the trainer *consumed*, never as of those prefetched::

    it = iter(loader)       # thread starts: b0, b1 received ahead
    next(it)                # b0; loader.state_dict() == source state right after b0

Only the thread touches the source iterator while a pass runs. Starting the next pass, or
``load_state_dict``, first stops the thread and waits for it; a pass abandoned with batches
received ahead is rewound to the consumed state, so those batches come again in the next pass.
Errors raised by the source (a worker's typed error, a dead worker) are re-raised by ``next``
unchanged.

Lifetime. The iterator holds its loader, so ``for mb in build_dataloader(...)``, where no name
holds the loader, yields every micro batch. ``close()``, dropping the iterator (a ``break`` out
of a ``for`` loop, ``del``) or interpreter exit stops the thread; the stop is a
``weakref.finalize`` of the iterator, which runs at exit while modules are still whole.

Freeing a received batch (unmapping its shared memory) costs about as much as receiving it. The
iterator keeps the batch it handed out until the next ``next`` and then gives it to the thread
to drop, so when the trainer no longer holds it, that free happens on the thread as well.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.step_loader import StepDataLoader

logger = logging.getLogger(__name__)
THREAD_NAME = "rollfeed-receive"
_END, _ERROR = object(), object()
_POLL_S = 0.5  # how often a waiting ``next`` checks that the thread is still there


class _Pump:
    """The receive thread, its bounded queue and the counts that say how far ahead it is."""

    def __init__(
        self,
        source: Iterator[Any],
        state_fn: Callable[[], dict[str, Any]] | None,
        *,
        depth: int,
        pin: bool,
    ) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopped = threading.Event()
        self.consumed_state = None if state_fn is None else state_fn()
        self.fetched = self.taken = 0
        self.release: collections.deque[Any] = collections.deque()  # batches for the thread to drop
        self.thread = threading.Thread(
            target=self._run, args=(source, state_fn, pin), name=THREAD_NAME, daemon=True
        )
        self.thread.start()

    def _run(self, source: Iterator[Any], state_fn: Callable | None, pin: bool) -> None:
        try:
            while not self.stopped.is_set():
                self._drop_released()
                try:
                    batch = next(source)
                except StopIteration:
                    self.queue.put((_END, None if state_fn is None else state_fn()))
                    return
                state = None if state_fn is None else state_fn()
                if pin:
                    batch = batch.pin_memory()
                self.fetched += 1
                self.queue.put((batch, state))
        except BaseException as err:  # re-raised by the trainer's next
            self.queue.put((_ERROR, err))

    def _drop_released(self) -> None:
        while self.release:
            self.release.popleft()

    def get(self) -> tuple[Any, Any]:
        while True:
            if self.stopped.is_set():
                return _END, self.consumed_state
            try:
                return self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    self.stopped.set()  # ended without a word (only if interrupted at exit)

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


class PrefetchIterator(Iterator[Any]):
    """One pass over the source, received ``depth`` batches ahead on a thread; see module doc.

    ``loader``: the loader whose pass this is, kept alive as long as the iterator is."""

    def __init__(self, pump: _Pump, loader: _PrefetchLoader) -> None:
        self._pump, self._loader = pump, loader
        self._last: Any = None
        weakref.finalize(self, pump.stop, wait=False)

    def __next__(self) -> Any:
        pump = self._pump
        if self._last is not None:
            pump.release.append(self._last)
            self._last = None
        item, state = pump.get()
        if item is _ERROR:
            pump.stopped.set()
            try:
                raise state
            finally:
                del item, state  # the traceback holds this frame: no cycle through the error
        if item is _END:
            pump.consumed_state = state
            pump.stopped.set()
            raise StopIteration
        pump.consumed_state = state
        pump.taken += 1
        self._last = item
        return item

    def close(self) -> None:
        """Stop the thread and wait for it; later ``next`` calls end the pass."""
        self._pump.stop(wait=True)


class _PrefetchLoader:
    """``__iter__`` for a DataLoader subclass: a :class:`PrefetchIterator` over its own."""

    def _init_prefetch(self, depth: int, pin: bool) -> None:
        if depth < 1:
            raise LoaderConfigError(f"prefetch depth must be >= 1, got {depth}; 2 is typical")
        self.prefetch_depth, self.pin_in_thread = depth, pin
        self._pump: _Pump | None = None

    def _halt(self) -> _Pump | None:
        """Stop and join the running thread, if any; the stopped pump."""
        pump, self._pump = getattr(self, "_pump", None), None
        if pump is not None:
            pump.stop(wait=True)
        return pump

    def __iter__(self) -> PrefetchIterator:
        pump = self._halt()
        if pump is not None and pump.fetched > pump.taken and pump.consumed_state is not None:
            ahead = pump.fetched - pump.taken
            logger.debug("pass left %d batches received ahead; rewinding to the consumed", ahead)
            self.load_state_dict(pump.consumed_state)
        source = super().__iter__()  # in this thread: resets, step-file waits, SIGCHLD handler
        state_fn = getattr(source, "state_dict", None)
        self._pump = _Pump(source, state_fn, depth=self.prefetch_depth, pin=self.pin_in_thread)
        return PrefetchIterator(self._pump, self)

    def close(self) -> None:
        """Stop the receive thread and release the workers (a later pass starts new ones)."""
        self._halt()
        self._iterator = None


class PrefetchStepDataLoader(_PrefetchLoader, StepDataLoader):
    """:class:`StepDataLoader` whose passes are received on a thread; ``state_dict()`` is the
    state of the consumed micro batches. ``depth``: batches received ahead; ``pin``: pin them
    on the thread (the source loader itself must not pin)."""

    def __init__(self, *args: Any, depth: int = 2, pin: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_prefetch(depth, pin)

    def state_dict(self) -> dict[str, Any]:
        pump = self._pump
        return super().state_dict() if pump is None else pump.consumed_state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._halt()
        super().load_state_dict(state_dict)

    def close(self) -> None:
        """Stop the receive thread and release the workers, keeping the consumed position."""
        pump = self._halt()
        if pump is not None:
            state = pump.consumed_state
        elif self._iterator is not None:
            state = self._iterator.state_dict()
        else:
            return
        super().load_state_dict(state)  # drops the source iterator and with it the workers


class PrefetchDataLoader(_PrefetchLoader, DataLoader):
    """Plain ``DataLoader`` (``stateful=False``) whose passes are received on a thread."""

    def __init__(self, *args: Any, depth: int = 2, pin: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_prefetch(depth, pin)
