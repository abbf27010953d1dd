"""A function run in a forked child under a hard wall-clock bound (:func:`run_forked`): its
value, its error as plain data, or ``hang`` once the bound passed and the child was killed.

The child reports once, over a pipe, as a length-prefixed pickle: the parent reads that message
and no more, so a grandchild left holding the pipe never keeps it waiting. A child may lead a
process group of its own, killed whole when it ends.

Example::

    run_forked(lambda: 6 * 7, 1.0)             -> ("done", 42)
    run_forked(lambda: time.sleep(9), 1.0)     -> ("hang", 1.0)   # after 1 s, the child killed
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.payload.adversary_tally import typed

_LEN = struct.Struct("<Q")


def _send(fd: int, value: object) -> None:
    data = pickle.dumps(value)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _receive(fd: int, deadline: float) -> object | None:
    """One message from ``fd`` by ``deadline`` (``None`` past it, or at EOF)."""
    buf, need = b"", None
    while need is None or len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buf += chunk
        if need is None and len(buf) >= _LEN.size:
            need = _LEN.size + _LEN.unpack_from(buf)[0]
    return pickle.loads(buf[_LEN.size :])


def run_forked(
    fn: Callable[[], Any],
    bound_s: float,
    *,
    own_group: bool = False,
    then: Callable[[], None] | None = None,
) -> tuple:
    """``fn()`` in a child forked now, killed past ``bound_s`` seconds of wall clock:
    ``("done", value)``, ``("raised", (module, name, message, typed))``, ``("hang", bound_s)``
    or ``("died", status)``. ``own_group``: the child leads a process group of its own, killed
    whole when it ends (what it forked and left behind goes with it). ``then``: what this
    process does right after the fork, while the child runs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports once, never returns
        try:
            os.close(r)
            if own_group:
                os.setpgid(0, 0)
            try:
                out: tuple = ("done", fn())
            except BaseException as err:
                out = ("raised", (type(err).__module__, type(err).__name__, str(err), typed(err)))
            _send(w, out)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(w)
    deadline, got = time.monotonic() + bound_s, None
    try:
        if then is not None:
            then()
        got = _receive(r, deadline)
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            if got is None:
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    if got is not None:
        return got  # type: ignore[return-value]
    return ("hang", bound_s) if os.WIFSIGNALED(status) else ("died", status)
