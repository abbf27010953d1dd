"""Whether this process may make object-store requests: obstore's runtime and ``fork``.

obstore runs every request of every client on one runtime per process (tokio's, through
pyo3-async-runtimes: a process-wide value, started by the first request, with worker threads).
``fork`` copies only the calling thread, so a child forked after that first request holds a
runtime whose threads are gone; its own first request then waits for ever, whatever client it
is made on (the parent's, or one built in the child: the runtime is the process's, and nothing
reachable from Python rebuilds it), and the configured timeouts do not help, since they are
timers of that same runtime (measured with obstore 0.12: a new root in such a child, with
``timeout_s=2`` and ``retry_timeout_s=4``, gave no answer in 40 s). A child forked *before*
the first request starts a runtime of its own at its first request and works.

So a fresh client in such a child cannot be made safe: it is refused instead, at once, with
:class:`~rollfeed.payload.errors.PayloadInputError` naming the ways out (start the process with
the ``spawn`` or ``forkserver`` method, or fork before the first request). :func:`before_request`
notes the pid of the process whose first request it is (before the request runs: a fork during
that request inherits a runtime that is starting), and an ``os.register_at_fork`` hook marks
every child forked after that, and the children's children; a pid that differs from the noted
one catches a fork that skipped the hook (a C library's own ``fork``). Building a client
(:func:`check_usable`) and every request (:func:`before_request`) ask first. Requests made by
other code of the process (obstore used directly) are not seen here.

The state is per process and module-level on purpose: it mirrors obstore's one runtime per
process, which no object of ours owns.

Example (a process that read ``s3://rollouts/run7``, then ``os.fork()``)::

    parent:  PayloadRoot("s3://rollouts/run7").read(...)     # the runtime starts here
    child:   PayloadRoot("s3://rollouts/run7")               -> PayloadInputError (at once)
    a child forked before the parent's first read: reads, with a runtime of its own
"""

from __future__ import annotations

import os

from rollfeed.payload.errors import PayloadInputError


class _Runtime:
    """What this process knows of obstore's runtime: ``started_in``, the pid whose request
    started it (``None``: not started by us); ``inherited``, forked after it started."""

    __slots__ = ("inherited", "started_in")

    def __init__(self) -> None:
        self.started_in: int | None = None
        self.inherited = False

    def after_fork_in_child(self) -> None:
        self.inherited = self.inherited or self.started_in is not None


_HERE = _Runtime()
os.register_at_fork(after_in_child=_HERE.after_fork_in_child)


def forked_error(where: str) -> PayloadInputError | None:
    """The refusal for a request of ``where`` in this process, or ``None`` when its runtime
    can serve one."""
    started = _HERE.started_in
    if not _HERE.inherited and started in (None, os.getpid()):
        return None
    return PayloadInputError(
        f"{where}: this process was forked from one that used the object store (it had made "
        "requests), and obstore's runtime (one per process; its threads do not survive fork) "
        "would never answer a request here, on any client, old or new. Start this process with "
        "the 'spawn' or 'forkserver' method (multiprocessing.get_context('forkserver'); a "
        "loader's LoaderOptions(multiprocessing_context='forkserver')), or fork it before the "
        "first object-store request"
    )


def check_usable(where: str) -> None:
    """Raise :func:`forked_error` for ``where`` if there is one (a client about to be built)."""
    err = forked_error(where)
    if err is not None:
        raise err


def before_request(where: str) -> None:
    """Before each request of ``where``: refused in a forked child (see the module doc), else
    this process is noted as the one whose runtime runs."""
    check_usable(where)
    _HERE.started_in = os.getpid()
