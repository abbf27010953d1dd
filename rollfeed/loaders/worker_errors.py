"""Errors raised in a DataLoader worker reach the trainer with their type and their place.

torch sends a worker's error to the main process as its type and formatted text
(``torch._utils.ExceptionWrapper``) and builds a new error from the text, so the attributes that
place a typed error (``.file``, ``.field``, ``.offset``, ``.pos``, ``.line``, ``.sample``) come
back ``None``. :func:`~rollfeed.loaders.build.build_dataloader` wraps its ``collate_fn`` in
:class:`CarryErrors`: inside a worker, an error that pickles to its own type (the typed errors do,
attributes included) is returned as a :class:`WorkerFailure`, an ``ExceptionWrapper`` that holds
the error itself. The DataLoader re-raises it where it re-raises any worker error -- before it
counts the micro batch as handed out, so ``state_dict()`` stays exact and a resume reads that
micro batch again -- and its ``reraise`` raises the original error, the worker's traceback added
as a note::

    next(it)  # PayloadMissingFileError: ... [file=b/w0.rfp, field=sampling_mask]
              #   err.file == "b/w0.rfp"; err.__notes__: "raised in DataLoader worker process 1 ..."

An error that does not pickle to its own type takes torch's way (type and text only).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, NoReturn

from torch._utils import ExceptionWrapper
from torch.utils.data import get_worker_info


class WorkerFailure(ExceptionWrapper):
    """A worker's error, sent in place of a micro batch; ``reraise`` raises the error itself.

    Create it inside the ``except`` block (it formats the traceback being handled)."""

    def __init__(self, error: Exception, worker: int) -> None:
        super().__init__(where=f"in DataLoader worker process {worker}")
        self.error: Exception | None = error.with_traceback(None)  # the text has the traceback

    def reraise(self) -> NoReturn:
        err, self.error = self.error, None  # raised once; no cycle through this frame
        assert err is not None, "a WorkerFailure is re-raised once"
        err.add_note(f"raised {self.where}; the traceback there:\n{self.exc_msg}")
        try:
            raise err
        finally:
            del err


def _round_trips(err: Exception) -> bool:
    """Whether ``err`` comes back from pickle as its own type (what the main process will do)."""
    try:
        return type(pickle.loads(pickle.dumps(err))) is type(err)
    except Exception:  # any failure to pickle means: leave the error to torch
        return False


class CarryErrors:
    """``collate_fn`` wrapper: in a worker, an error comes back as a :class:`WorkerFailure`.

    In the main process (``num_workers=0``) errors are raised as they are. Picklable as long as
    ``collate`` is."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        try:
            return self.collate(samples)
        except Exception as err:
            info = get_worker_info()
            if info is None or not _round_trips(err):
                raise
            return WorkerFailure(err, info.id)
