"""RolloutLoader: this rank's micro batches, one pass per training step, resumable exactly.

It holds one ``torch.utils.data.DataLoader`` (public API only) that draws
:class:`~rollfeed.loaders.worker.Task`s and makes each micro batch where the reads happen.

- **State.** A task carries the sampler's state right after its micro batch; ``next`` records it
  as it hands the micro batch out, so ``state_dict()`` counts micro batches *consumed*, never
  those in flight or received ahead (a finished pass is ``(step + 1, 0)``: a resume starts the
  next step). A new pass first rewinds the sampler to that state; persistent workers drop what
  they still hold. **Errors** end the pass; a worker's is raised with its type and place and not
  counted; with nothing in flight (no step file in time, an empty step) the sampler's state is
  taken as is.
- **A pass is a step**, with workers or without: it ends when this rank's last micro batch of the
  step is handed out, never waiting for the next step's file. ``len(loader)`` is the length of
  the pass ``iter`` would start now, from the consumed state (waiting for its step file as
  ``iter`` does), so ``for``, ``list()`` and ``len()`` agree.
- **Metrics.** ``loader.metrics``: the current (or last) pass's :mod:`~rollfeed.loaders.metrics`,
  made from what each micro batch's maker measured (carried with it) and the trainer's wait.
- **Workers** start as :meth:`LoaderOptions.start_method` says: forked over local files (they
  inherit the next step's plan and index), from a fork server when the payload root or the step
  directory is ``s3://`` (each then reads the step's index itself, once per step, and holds it
  for the step's micro batches; the plan travels in each task). Each task carries its worker's
  read-ahead hints (:mod:`~rollfeed.loaders.hints`, :mod:`~rollfeed.loaders.read_ahead`): the
  worker makes them on threads while the trainer computes; the next step is planned as a pass
  starts (:mod:`~rollfeed.loaders.next_step`), so its first micro batches are made before the
  next ``iter``.
- **Workers** are watched while the trainer waits (:mod:`~rollfeed.loaders.watch`): a stopped,
  dead or too slow worker is a typed :class:`~rollfeed.loaders.errors.WorkerError` naming it and
  the step, within the bounds of :class:`LoaderOptions`.
- **Lifetime.** An iterator holds its loader, so ``for mb in build_dataloader(...)`` yields every
  micro batch. The next pass, ``load_state_dict``, ``close()``, dropping the iterator or exit
  stops the receive thread (a ``weakref.finalize``: at exit it runs while modules are whole);
  ``close()`` also lets the workers go.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import multiprocessing
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, get_worker_info

from rollfeed.collate import TensorMicroBatch
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.errors import WorkerError
from rollfeed.loaders.handover import Described, Handover
from rollfeed.loaders.metrics import StepMetrics
from rollfeed.loaders.options import LoaderOptions, memfd_available
from rollfeed.loaders.receive import Receiver
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.tasks import Tasks
from rollfeed.loaders.transfer import move_micro_batch
from rollfeed.loaders.warm_up import first_tasks
from rollfeed.loaders.watch import TICK_S, WorkerWatch
from rollfeed.loaders.worker import Delivered, MicroBatchWork, WorkerFailure, as_is
from rollfeed.payload import is_store_url

logger = logging.getLogger(__name__)
RETIRE_THREAD = "rollfeed-retire"  # drops the DataLoader of a worker error
# what a fork server imports once, so that each worker it forks starts without importing them
FORKSERVER_PRELOAD = ("torch", "rollfeed.loaders.worker", "rollfeed.loaders.dataset")


class RolloutIterator(Iterator[TensorMicroBatch]):
    """One pass (one training step); ``step``: the step of the micro batch last returned;
    ``metrics``: the pass's so far (:mod:`rollfeed.loaders.metrics`)."""

    def __init__(self, loader: RolloutLoader, source: Iterator[Any], receiver: Receiver | None):
        self._loader = loader  # the loader lives as long as its pass
        self._receiver, self._source = receiver, None if receiver else source
        self.taken, self._handed = 0, 0.0
        self.step: int | None = None
        self._metrics: StepMetrics | None = None
        if receiver is not None:
            weakref.finalize(self, receiver.stop, wait=False)

    @property
    def metrics(self) -> dict[str, float]:
        return {} if self._metrics is None else self._metrics.as_dict()

    def __next__(self) -> TensorMicroBatch:
        loader, asked = self._loader, time.monotonic()
        try:
            if self._receiver is not None:
                item = self._receiver.get()
            elif self._source is None:
                raise StopIteration
            else:
                item = loader._host(next(self._source))
        except WorkerError as err:  # the pass is over, and the workers
            loader._end(self, err)
            # torch's frames on its way hold the retired DataLoader: not kept by the traceback
            raise err.with_traceback(None) from None
        except BaseException as err:  # the end of the pass, or an error: the pass is over
            loader._end(self, err)
            raise
        if isinstance(item, WorkerFailure):
            loader._end(self)
            item.reraise()
        if self.taken:  # the trainer's time since the last one, and the maker's
            loader._tasks.pace.add(item.facts.make_s, asked - self._handed)
        self.taken += 1
        loader._consumed, self.step = item.task.state, item.task.step
        batch = item.batch
        if loader._device is not None:  # one asynchronous copy from (pinned) host memory
            device = loader._device
            batch = move_micro_batch(batch, lambda t: t.to(device, non_blocking=True))
        if self._metrics is None:
            self._metrics = StepMetrics(item.task.step, item.task.plan)
        self._handed = time.monotonic()
        self._metrics.add(item.facts, asked=asked, handed=self._handed)
        return batch

    def close(self, *, wait: bool = True) -> None:
        """Stop the pass (its thread too, waited for unless ``wait=False``)."""
        self._source = None
        if self._receiver is not None:
            self._receiver.stop(wait=wait)


class RolloutLoader:
    """This rank's ``TensorMicroBatch``es, one pass per training step; see the module doc.

    Built by :func:`~rollfeed.loaders.build.build_dataloader`. ``batch_sampler``: the
    :class:`MicroBatchSampler`; ``len(loader)``: micro batches of the pass ``iter`` would start
    now; ``metrics``: the current or last pass's.
    """

    def __init__(
        self,
        dataset: RolloutDataset,
        sampler: MicroBatchSampler,
        collator: MicroBatchCollator,
        options: LoaderOptions,
    ) -> None:
        self.dataset, self.batch_sampler, self.collator = dataset, sampler, collator
        self.options = options
        self._tasks = Tasks(sampler, options.num_workers, options.read_ahead)
        self._pin = torch.cuda.is_available() if options.pin_memory is None else options.pin_memory
        self._device = None if options.device is None else torch.device(options.device)
        self._loader: DataLoader | None = None
        self._pass: weakref.ref[RolloutIterator] | None = None
        self._receiver: Receiver | None = None  # the pass's thread, joined before the next
        self._consumed = sampler.state_dict()
        self._watch: WorkerWatch | None = None
        self._handover: Handover | None = None  # the current DataLoader's (Linux workers)
        self._last_metrics: dict[str, float] = {}

    @property
    def metrics(self) -> dict[str, float]:
        """The current pass's metrics, or the last pass's once it ended (``{}`` before its
        first micro batch); see :mod:`rollfeed.loaders.metrics`."""
        it = self._pass and self._pass()
        return it.metrics if it is not None else self._last_metrics.copy()

    def _new_loader(self) -> DataLoader:
        workers = self.options.num_workers
        method = self.options.start_method(object_store=self._object_store()) if workers else None
        memfd = workers and self.options.handover != "torch" and memfd_available()
        self._handover = Handover(workers) if memfd else None
        work = MicroBatchWork(self.dataset, self.collator, self._handover)
        if not workers:
            return DataLoader(work, batch_sampler=self._tasks, collate_fn=as_is)
        if method == "fork":  # forked workers inherit the next step's plan and index
            self.batch_sampler.warm()
        context = multiprocessing.get_context(method)
        first = first_tasks(self.batch_sampler, workers)
        if method == "forkserver":  # workers fork from a server that has imported these
            context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        pids = context.Array("q", workers, lock=False)  # each worker's pid, as it starts
        options = self.options
        self._watch = WorkerWatch(pids, timeout_s=options.timeout_s, stopped_s=options.stopped_s)
        self._watch.step = lambda tasks=self._tasks: tasks.step  # no cycle through the loader
        tick = min(TICK_S, options.timeout_s or TICK_S)
        return DataLoader(
            work,
            batch_sampler=self._tasks,
            collate_fn=as_is,
            num_workers=workers,
            multiprocessing_context=context,
            persistent_workers=True,
            worker_init_fn=functools.partial(_start_worker, pids, first),
            timeout=tick,  # a wait of the watch's: it looks at the workers between ticks
        )

    def _object_store(self) -> bool:
        """Whether the payload root or the step directory is in an object store."""
        root = getattr(self.collator, "root", None)
        return is_store_url(self.dataset.directory) or is_store_url(getattr(root, "path", None))

    def _host(self, item: Any) -> Any:
        """A delivered micro batch, received from its handover and pinned when asked (on the
        receive thread if there is one)."""
        if not isinstance(item, Delivered):
            return item
        batch = item.batch
        if isinstance(batch, Described):
            assert self._handover is not None
            batch = self._handover.receive(batch)
        if self._pin:
            batch = move_micro_batch(batch, torch.Tensor.pin_memory)
        return item if batch is item.batch else dataclasses.replace(item, batch=batch)

    def __len__(self) -> int:
        """Micro batches of the pass ``iter`` would start now: from the consumed state, waiting
        for its step file as ``iter`` does (bounded by ``step_timeout_s``)."""
        return self.batch_sampler.pass_length(self._consumed)

    def __iter__(self) -> RolloutIterator:
        self._stop()
        if self.batch_sampler.state_dict() != self._consumed:
            logger.debug("rewinding the sampler to the consumed state %s", self._consumed)
            self.batch_sampler.load_state_dict(self._consumed)
        if self._watch is not None and self._watch.dead():  # a worker died between passes
            self._retire()
        if self._loader is None:
            self._loader = self._new_loader()
        self._tasks.yielded = 0
        self._last_metrics = {}
        try:  # here, in the caller's thread: workers' start, step-file waits, SIGCHLD handler
            source = self._start()
        except BaseException:
            self._settle(0)
            raise
        if self._watch is not None:
            self._watch.arm()
            source = self._watch.follow(source)
        depth = self.options.receive_depth
        if depth is None:
            depth = 2 if self.options.num_workers else 0
        self._receiver = Receiver(source, self._host, depth=depth) if depth else None
        it = RolloutIterator(self, source, self._receiver)
        self._pass = weakref.ref(it)
        return it

    def _start(self) -> Iterator[Any]:
        """``iter`` of the DataLoader; a worker that died while it resumes is a typed error."""
        assert self._loader is not None
        try:
            return iter(self._loader)
        except (RuntimeError, ConnectionError, EOFError, WorkerError) as err:
            watch = self._watch
            failure = err if isinstance(err, WorkerError) else watch and watch.died_of(err)
            if failure is None:
                raise
        self._retire()
        raise failure.with_traceback(None)

    def _retire(self) -> None:
        """Let the DataLoader of a worker error go: its workers killed, then dropped on a
        thread of its own, since torch's shutdown of it blocks for ever on a lock that a killed
        worker held (an event all its workers poll)."""
        old, watch = self._loader, self._watch
        self._loader = self._watch = None
        if watch is not None:
            watch.kill_all()
        if old is not None:
            threading.Thread(target=_let_go, args=(old,), name=RETIRE_THREAD, daemon=True).start()

    def _end(self, it: RolloutIterator, err: BaseException | None = None) -> None:
        it.close(wait=False)
        self._last_metrics = it.metrics
        if isinstance(err, WorkerError):  # the next pass starts new workers
            self._retire()
        if self._pass is not None and self._pass() is it:
            self._pass = None
            self._settle(it.taken)

    def _settle(self, taken: int) -> None:
        """When the pass took every micro batch it drew, nothing is in flight: the sampler's
        state is the consumed one (an empty step moved it on)."""
        if taken == self._tasks.yielded:
            self._consumed = self.batch_sampler.state_dict()

    def _stop(self) -> None:
        it = self._pass and self._pass()
        receiver, self._pass, self._receiver = self._receiver, None, None
        if it is not None:
            self._last_metrics = it.metrics
            it.close(wait=False)
        if receiver is not None:
            receiver.stop(wait=True)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as of the micro batches consumed (see the module doc): a few
        integers and the plan fingerprint (:mod:`~rollfeed.loaders.state`), a copy."""
        return copy.deepcopy(self._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass starts at its step and micro batch."""
        self._stop()
        self.batch_sampler.load_state_dict(state)
        self._consumed = self.batch_sampler.state_dict()

    def close(self) -> None:
        """Stop the running pass and let the workers go, keeping the consumed position."""
        self._stop()
        if self._watch is not None:
            self._watch.close()
        self._loader = self._watch = None  # its iterator shuts the workers down as it goes


def _let_go(loader: DataLoader) -> None:
    """The retire thread's body: the last reference to ``loader`` goes with its arguments."""
    del loader


def _start_worker(pids: Any, first: tuple[Any, ...], worker_id: int) -> None:
    """In each worker as it starts: its pid for the watch; one torch intra-op thread (workers
    decode, the trainer computes); the samples of its first task read
    (:mod:`~rollfeed.loaders.warm_up`)."""
    pids[worker_id] = os.getpid()
    torch.set_num_threads(1)
    info = get_worker_info()
    if info is not None and first[worker_id] is not None:
        info.dataset.warm(first[worker_id])
