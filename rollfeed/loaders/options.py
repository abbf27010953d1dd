"""LoaderOptions: how a :class:`~rollfeed.loaders.loader.RolloutLoader` runs, never what it yields.

Example::

    LoaderOptions(num_workers=2)   # workers, a receive thread, bounded waits (600 s; stopped: 5 s)
"""

from __future__ import annotations

import math
import multiprocessing
import sys
from dataclasses import dataclass
from typing import Literal

import torch

from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.handover import Handover as MemfdHandover

Handover = Literal["memfd", "torch"]
HANDOVERS: tuple[Handover, ...] = ("memfd", "torch")
StartMethod = Literal["fork", "forkserver", "spawn"]
START_METHODS: tuple[StartMethod, ...] = ("fork", "forkserver", "spawn")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderOptions:
    """How the loader runs, never what it yields; checked on construction.

    Workers are persistent (they, their open payload files and parsed step files survive from
    step to step), use one torch thread each (the trainer owns the cores) and make micro batches
    ahead (``read_ahead``) so that a far store's requests overlap.

    Args:
        num_workers: worker processes that read the payload (``0``: the trainer's process).
        receive_depth: micro batches a receive thread takes off the workers' queue ahead of
            the trainer (``None``: 2 with workers, none without; ``0``: no thread).
        pin_memory: pin each micro batch (a worker's one buffer, in one page-locked copy)
            before ``next`` hands it out (``None``: when CUDA is available; ``True`` needs it).
        device: copy each micro batch there (its buffer in one asynchronous copy) as ``next``
            hands it out (``None``: stay on the host).
        timeout_s: the longest wait for one micro batch from running workers, then
            :class:`~rollfeed.loaders.errors.WorkerTimeoutError` (default 600 s; ``0``: no
            bound). A dead worker is reported at once, a stopped one after ``stopped_s``.
        handover: how a worker's micro batch reaches the trainer's process: ``"memfd"``, one
            buffer of a pool the worker reuses, its descriptor sent over a socket of the worker's
            own (:mod:`~rollfeed.loaders.handover`; Linux, forked workers), or ``"torch"``, the
            DataLoader's own (a new shared-memory segment each, fetched through the worker's
            resource sharer thread); ``None``: ``"memfd"`` where it is available.
        multiprocessing_context: how workers start (:meth:`start_method`): ``"fork"``,
            ``"forkserver"`` or ``"spawn"``; ``None``: forked on Linux over local files (cheap,
            the dataset and the next step's plan shared copy-on-write), from a fork server when
            the payload root or the step directory is ``s3://`` (the object-store client's
            runtime does not survive ``fork``: a worker forked after the trainer's process made
            a request would hang on its first), torch's default elsewhere.
        read_ahead: micro batches each worker makes ahead of being asked, on threads of its
            own, while it makes and hands over the one asked for
            (:mod:`~rollfeed.loaders.read_ahead`): the next ones of its step and, near the
            step's end, the first of the next step when its file is there (planned as its
            pass starts). ``None``: sized from the measured time to make a micro batch against the
            trainer's time between two (1 to 4; 4 before anything is measured); ``0``: none.
            Each worker holds that many micro batches more.
        stopped_s: how long a worker may stay stopped (``SIGSTOP``, a debugger; its state in
            ``/proc``) while the trainer waits, before
            :class:`~rollfeed.loaders.errors.WorkerStoppedError` (default 5 s). Workers are
            looked at once a second while the trainer waits.
    """

    num_workers: int = 0
    receive_depth: int | None = None
    pin_memory: bool | None = None
    device: torch.device | str | None = None
    timeout_s: float = 600.0
    stopped_s: float = 5.0
    handover: Handover | None = None
    multiprocessing_context: StartMethod | None = None
    read_ahead: int | None = None

    def __post_init__(self) -> None:
        counts = {"num_workers": self.num_workers, "receive_depth": self.receive_depth}
        counts["read_ahead"] = self.read_ahead
        for name, value in counts.items():
            if (value is not None or name == "num_workers") and not _count(value):
                raise LoaderConfigError(f"LoaderOptions.{name} must be an int >= 0, got {value!r}")
        if not (_seconds(self.timeout_s) and _seconds(self.stopped_s) and self.stopped_s > 0):
            raise LoaderConfigError(
                f"LoaderOptions(timeout_s={self.timeout_s!r}, stopped_s={self.stopped_s!r}) must "
                "be finite seconds, timeout_s >= 0 (0: no bound) and stopped_s > 0"
            )
        if self.handover not in (None, *HANDOVERS):
            raise LoaderConfigError(
                f"LoaderOptions.handover must be one of {HANDOVERS} or None, got {self.handover!r}"
            )
        method = self.multiprocessing_context
        if method is not None and method not in multiprocessing.get_all_start_methods():
            raise LoaderConfigError(
                f"LoaderOptions.multiprocessing_context must be one of "
                f"{multiprocessing.get_all_start_methods()} here, or None, got {method!r}"
            )
        if self.handover == "memfd" and not memfd_available():
            raise LoaderConfigError(
                "LoaderOptions(handover='memfd') needs Linux (memfd_create, SCM_RIGHTS); "
                "pass None or 'torch'"
            )
        cuda = self.pin_memory or torch.device(self.device or "cpu").type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise LoaderConfigError(
                f"LoaderOptions(pin_memory={self.pin_memory}, device={self.device!r}) needs "
                "CUDA, which is not available here: pass pin_memory=None (pin when CUDA is "
                "there) or False, and a device that is here"
            )

    def start_method(self, *, object_store: bool) -> StartMethod | None:
        """How this loader's workers start: ``multiprocessing_context`` when given, else
        ``"forkserver"`` when ``object_store`` (the payload root or the step directory is
        ``s3://``), ``"fork"`` on Linux, ``None`` (torch's default) elsewhere.

        ``"fork"`` with an object store is :class:`LoaderConfigError`: the trainer's process
        has made requests (listing, planning) before the workers start, and a child forked
        after that hangs on its first request.

        Example: ``LoaderOptions().start_method(object_store=True) -> "forkserver"``.
        """
        method = self.multiprocessing_context
        if method == "fork" and object_store:
            raise LoaderConfigError(
                "LoaderOptions(multiprocessing_context='fork') with an s3:// payload root or "
                "step directory: the object-store client's runtime does not survive fork (a "
                "worker forked after the trainer's first request hangs on its own first); pass "
                "None (a fork server), 'forkserver' or 'spawn'"
            )
        if method is not None:
            return method
        if object_store and "forkserver" in multiprocessing.get_all_start_methods():
            return "forkserver"
        if object_store:
            return "spawn"
        return "fork" if sys.platform.startswith("linux") else None


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _seconds(value: object) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 <= value < math.inf  # type: ignore[operator]


def memfd_available() -> bool:
    """Whether the memfd handover works here: Linux, ``memfd_create``, descriptors over
    ``AF_UNIX`` sockets (inherited by forked workers, passed to those of a fork server)."""
    return sys.platform.startswith("linux") and MemfdHandover.available()
