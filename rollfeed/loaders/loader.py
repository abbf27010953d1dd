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
- **Lifetime.** An iterator holds its loader, so ``for mb in build_dataloader(...)`` yields every
  micro batch. The next pass, ``load_state_dict``, ``close()``, dropping the iterator or exit
  stops the receive thread (a ``weakref.finalize``: at exit it runs while modules are whole);
  ``close()`` also lets the workers go.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from rollfeed.collate import TensorMicroBatch
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.receive import Receiver
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.transfer import move_micro_batch
from rollfeed.loaders.worker import Delivered, MicroBatchWork, Task, WorkerFailure, as_is

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderOptions:
    """How the loader runs, never what it yields; checked on construction.

    Workers are persistent (they, their open payload files and parsed step files survive from
    step to step), forked on Linux (cheap, the dataset shared copy-on-write; torch's default
    elsewhere) and use one torch thread each (the trainer owns the cores).

    Args:
        num_workers: worker processes that read the payload (``0``: the trainer's process).
        receive_depth: micro batches a receive thread takes off the workers' queue ahead of
            the trainer (``None``: 2 with workers, none without; ``0``: no thread).
        pin_memory: pin each micro batch (a worker's one buffer, in one page-locked copy)
            before ``next`` hands it out (``None``: when CUDA is available; ``True`` needs it).
        device: copy each micro batch there (its buffer in one asynchronous copy) as ``next``
            hands it out (``None``: stay on the host).
        timeout_s: wait bound for one micro batch from the workers (``0``: none; a dead worker
            is detected regardless).
    """

    num_workers: int = 0
    receive_depth: int | None = None
    pin_memory: bool | None = None
    device: torch.device | str | None = None
    timeout_s: float = 0

    def __post_init__(self) -> None:
        counts = {"num_workers": self.num_workers, "receive_depth": self.receive_depth}
        for name, value in counts.items():
            if (value is not None or name == "num_workers") and not _count(value):
                raise LoaderConfigError(f"LoaderOptions.{name} must be an int >= 0, got {value!r}")
        if not self.timeout_s >= 0 or (self.timeout_s and not self.num_workers):
            raise LoaderConfigError(
                f"LoaderOptions.timeout_s={self.timeout_s} must be >= 0, and 0 without workers"
            )
        cuda = self.pin_memory or torch.device(self.device or "cpu").type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise LoaderConfigError(
                f"LoaderOptions(pin_memory={self.pin_memory}, device={self.device!r}) needs "
                "CUDA, which is not available here: pass pin_memory=None (pin when CUDA is "
                "there) or False, and a device that is here"
            )


class _Tasks:
    """The DataLoader's batch sampler: the sampler's index lists as :class:`Task`s."""

    def __init__(self, sampler: MicroBatchSampler) -> None:
        self.sampler, self.yielded = sampler, 0  # yielded: tasks drawn in the current pass

    def __iter__(self) -> Iterator[Task]:
        for indices in self.sampler:
            state = self.sampler.state_dict()
            self.yielded += 1
            # right after micro batch k of step s: (s, k + 1), or (s + 1, 0) after its last
            yield Task(indices, state["step"] - (state["micro_batches"] == 0), state)


class RolloutIterator(Iterator[TensorMicroBatch]):
    """One pass (one training step); ``step``: the step of the micro batch last returned."""

    def __init__(self, loader: RolloutLoader, source: Iterator[Any], receiver: Receiver | None):
        self._loader = loader  # the loader lives as long as its pass
        self._receiver, self._source = receiver, None if receiver else source
        self.taken = 0
        self.step: int | None = None
        if receiver is not None:
            weakref.finalize(self, receiver.stop, wait=False)

    def __next__(self) -> TensorMicroBatch:
        loader = self._loader
        try:
            if self._receiver is not None:
                item = self._receiver.get()
            elif self._source is None:
                raise StopIteration
            else:
                item = loader._host(next(self._source))
        except BaseException:  # the end of the pass, or an error: the pass is over either way
            loader._end(self)
            raise
        if isinstance(item, WorkerFailure):
            loader._end(self)
            item.reraise()
        self.taken += 1
        loader._consumed, self.step = item.task.state, item.task.step
        if loader._device is None:
            return item.batch
        device = loader._device  # one asynchronous copy from (pinned) host memory
        return move_micro_batch(item.batch, lambda t: t.to(device, non_blocking=True))

    def close(self, *, wait: bool = True) -> None:
        """Stop the pass (its thread too, waited for unless ``wait=False``)."""
        self._source = None
        if self._receiver is not None:
            self._receiver.stop(wait=wait)


class RolloutLoader:
    """This rank's ``TensorMicroBatch``es, one pass per training step; see the module doc.

    Built by :func:`~rollfeed.loaders.build.build_dataloader`. ``batch_sampler``: the
    :class:`MicroBatchSampler`; ``len(loader)``: micro batches left in this pass.
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
        self._tasks = _Tasks(sampler)
        self._pin = torch.cuda.is_available() if options.pin_memory is None else options.pin_memory
        self._device = None if options.device is None else torch.device(options.device)
        self._loader: DataLoader | None = None
        self._pass: weakref.ref[RolloutIterator] | None = None
        self._receiver: Receiver | None = None  # the pass's thread, joined before the next
        self._consumed = sampler.state_dict()

    def _new_loader(self) -> DataLoader:
        work, workers = MicroBatchWork(self.dataset, self.collator), self.options.num_workers
        fork = workers and sys.platform.startswith("linux")
        if fork:  # forked workers inherit the next step's plan and index
            self.batch_sampler.warm()
        kw = dict(
            persistent_workers=True, worker_init_fn=_one_thread, timeout=self.options.timeout_s
        )
        return DataLoader(
            work,
            batch_sampler=self._tasks,
            collate_fn=as_is,
            num_workers=workers,
            multiprocessing_context="fork" if fork else None,
            **(kw if workers else {}),
        )

    def _host(self, item: Any) -> Any:
        """A delivered micro batch, pinned when asked (on the receive thread if there is one)."""
        if not self._pin or not isinstance(item, Delivered):
            return item
        return Delivered(move_micro_batch(item.batch, torch.Tensor.pin_memory), item.task)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> RolloutIterator:
        self._stop()
        if self.batch_sampler.state_dict() != self._consumed:
            logger.debug("rewinding the sampler to the consumed state %s", self._consumed)
            self.batch_sampler.load_state_dict(self._consumed)
        if self._loader is None:
            self._loader = self._new_loader()
        self._tasks.yielded = 0
        try:  # here, in the caller's thread: workers' start, step-file waits, SIGCHLD handler
            source = iter(self._loader)
        except BaseException:
            self._settle(0)
            raise
        depth = self.options.receive_depth
        if depth is None:
            depth = 2 if self.options.num_workers else 0
        self._receiver = Receiver(source, self._host, depth=depth) if depth else None
        it = RolloutIterator(self, source, self._receiver)
        self._pass = weakref.ref(it)
        return it

    def _end(self, it: RolloutIterator) -> None:
        it.close(wait=False)
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
            it.close(wait=False)
        if receiver is not None:
            receiver.stop(wait=True)

    def state_dict(self) -> dict[str, int]:
        """The sampler's state as of the micro batches consumed (see the module doc)."""
        return dict(self._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass starts at its step and micro batch."""
        self._stop()
        self.batch_sampler.load_state_dict(state)
        self._consumed = self.batch_sampler.state_dict()

    def close(self) -> None:
        """Stop the running pass and let the workers go, keeping the consumed position."""
        self._stop()
        self._loader = None  # its worker iterator shuts the workers down as it is collected


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _one_thread(worker_id: int) -> None:
    """Workers decode, the trainer computes: one torch intra-op thread per worker."""
    torch.set_num_threads(1)
