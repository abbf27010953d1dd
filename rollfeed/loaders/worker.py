"""One micro batch's work, where it runs (a DataLoader worker, or the trainer's process).

The loader's DataLoader draws :class:`Task`s: the sampler's index list for a micro batch, its step,
the sampler's state right after it (reported once the trainer consumes that micro batch) and the
step's plan metrics. :class:`MicroBatchWork` is the dataset it fetches from: ``__getitems__`` reads
the samples (``dataset.__getitems__``, else ``dataset[i]``), collates them and returns a
:class:`Delivered`: the micro batch, its task, and what was measured making it
(:class:`~rollfeed.loaders.metrics.MicroBatchFacts`), in one object.

Errors keep their type and place. torch rebuilds a worker's error from its type and text, so
``.file``, ``.line``, ``.field``, ``.offset``, ``.pos`` would come back ``None``. In a worker, an
error of the dataset (a ``StepFileError``: file, line) or of the collator (a ``PayloadError``)
that pickles to its own type comes back as a :class:`WorkerFailure` in place of the micro batch;
the loader raises the error itself, the worker's traceback as a note, and does not count that
micro batch (a resume reads it again). Other errors are left to torch (type and text).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from torch.utils.data import Dataset, get_worker_info

from rollfeed.collate import TensorMicroBatch
from rollfeed.loaders.handover import Described, Handover
from rollfeed.loaders.metrics import MicroBatchFacts, measure
from rollfeed.loaders.read_ahead import ReadAhead, task_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Task:
    indices: Sequence[int]
    step: int
    state: dict[str, Any]  # SamplerState.to_dict()
    plan: dict[str, float]  # the step's plan metrics
    # (step, indices) of the tasks the same worker is likely given next (read_ahead's hints)
    ahead: tuple[tuple[int, Sequence[int]], ...] = ()


@dataclass(frozen=True, slots=True)
class Delivered:
    batch: TensorMicroBatch | Described  # Described: on its way through a Handover
    task: Task
    facts: MicroBatchFacts


class WorkerFailure:
    """The error worker ``worker`` raised making a micro batch, and its traceback as text."""

    def __init__(self, error: Exception, worker: int) -> None:
        self.trace = traceback.format_exc()  # of the error being handled
        self.error: Exception | None = error.with_traceback(None)
        self.worker = worker

    def reraise(self) -> NoReturn:
        err, self.error = self.error, None  # raised once; no cycle through this frame
        assert err is not None, "a WorkerFailure is re-raised once"
        err.add_note(f"raised in DataLoader worker process {self.worker}; there:\n{self.trace}")
        try:
            raise err
        finally:
            del err


class MicroBatchWork(Dataset):
    """The dataset a loader's DataLoader fetches :class:`Task`s from (picklable, fd-free).

    With a :class:`~rollfeed.loaders.handover.Handover` (Linux workers), a worker sends each
    micro batch's buffer over its socket and delivers its :class:`Described` tensors."""

    def __init__(self, dataset: Any, collator: Any, handover: Handover | None = None) -> None:
        self.dataset, self.collator, self.handover = dataset, collator, handover
        self._sent = 0  # micro batches this process handed over
        self._ahead: ReadAhead | None = None  # a worker's, made in it

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in ("dataset", "collator", "handover")}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def warm(self, indices: Sequence[int]) -> None:
        """Read the samples of ``indices`` now, on this worker's one thread, before its first
        task (:mod:`~rollfeed.loaders.warm_up`); a failure is left to that task's own read."""
        getitems = getattr(self.dataset, "__getitems__", None)
        try:
            getitems(indices) if getitems else [self.dataset[i] for i in indices]
        except Exception as err:
            logger.debug("warming up on %d samples failed: %r", len(indices), err)

    def __getitems__(self, task: Task) -> Delivered | WorkerFailure:
        info = get_worker_info()
        try:
            if self.handover is None or info is None:
                batch, facts = self._made(task, info is not None)
                return Delivered(batch, task, facts)
            made, facts = self._made(task, True)
            self._sent += 1
            described = self.handover.send(made, worker=info.id, token=self._sent)
            return Delivered(described, task, facts)
        except Exception as err:
            if info is None or not _round_trips(err):
                raise
            return WorkerFailure(err, info.id)

    def _made(self, task: Task, worker: bool) -> tuple[TensorMicroBatch, MicroBatchFacts]:
        """The task's micro batch and its facts: made ahead when it was, else here; in a
        worker, the task's hints start their making first (:mod:`.read_ahead`)."""
        if not worker or not (task.ahead or self._ahead):
            return self._make(task.indices)
        if self._ahead is None:
            self._ahead = ReadAhead(self._make)
        made = self._ahead.take(task_key(task.step, task.indices))
        self._ahead.hint([(task_key(step, ix), ix) for step, ix in task.ahead])
        if made is None or made.exception() is not None:  # a failure is met afresh, here
            return self._make(task.indices)
        batch, facts = made.result()
        return batch, dataclasses.replace(facts, ahead=True)

    def _make(self, indices: Sequence[int]) -> tuple[TensorMicroBatch, MicroBatchFacts]:
        started = time.monotonic()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        read = time.monotonic() - started
        if self.handover is None or get_worker_info() is None:  # one storage in a worker
            batch = self.collator(samples)
        else:  # made where it is: the handover writes it into its own buffer
            batch = self.collator.make(samples)
        return batch, measure(batch, samples, started=started, samples_s=read)


def _round_trips(err: Exception) -> bool:
    """Whether ``err`` comes back from pickle as its own type (what the trainer will see)."""
    try:
        return type(pickle.loads(pickle.dumps(err))) is type(err)
    except Exception:  # any failure to pickle means: leave the error to torch
        return False


def as_is(item: Any) -> Any:
    """The DataLoader's ``collate_fn``: :meth:`MicroBatchWork.__getitems__` did the work."""
    return item
