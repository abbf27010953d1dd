"""A deadline for a whole request, whatever the server sends: one watchdog thread per client
cuts the connection of an exchange still running at its deadline.

A socket timeout bounds each receive, not a request: a server that sends one byte a second
answers every receive in time and keeps a read going for as long as it likes (a 206 body dripped
byte by byte, headers dripped line by line). The watchdog holds the deadlines of the exchanges in
flight in a heap; at a deadline it shuts the connection's socket down (``shutdown(SHUT_RDWR)``,
which wakes a receive blocked in another thread, TLS included), and the exchange then reads as
timed out. It costs a lock and a heap push per exchange and sleeps while none is due; its thread
starts on first use, in the process that uses it (a client is made per process, so a forked
worker starts its own).

The socket is handed over once connected (``guard.arm``): the connection object lets go of it
as soon as an answer says ``Connection: close`` (the response then reads from it alone), and
connecting is bounded by the socket's own timeout.

Example::

    watch = Watchdog()
    with watch.guard(time.monotonic() + 10.0) as guard:
        conn.connect()
        guard.arm(conn.sock)                           # raises TimeoutError if already past
        conn.request("GET", target, headers=headers)   # cut at the deadline if still going
        body = conn.getresponse().read()
    guard.fired  # True when the deadline cut it
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterator


class Guard:
    """One exchange under a deadline: ``fired`` once the deadline passed (and its socket, once
    armed, was cut)."""

    __slots__ = ("done", "fired", "sock")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.done = self.fired = False

    def arm(self, sock: socket.socket) -> None:
        """Cut ``sock`` at the deadline; ``TimeoutError`` when it has passed already (the
        watchdog sets ``fired`` before it looks for the socket, so one of the two sees the
        other)."""
        self.sock = sock
        if self.fired:
            raise TimeoutError("the deadline passed while connecting")

    def cut(self) -> None:
        """Shut the socket down (a receive blocked on it returns at once)."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing to cut
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the descriptor's, TLS too


class Watchdog:
    """Cuts the connections of exchanges past their deadlines (see the module doc)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Guard]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, deadline: float) -> Iterator[Guard]:
        """A guard whose armed socket is cut if the block is still running at ``deadline``
        (``time.monotonic()`` seconds)."""
        g = Guard()
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="rollfeed-s3-deadline", daemon=True
                )
                self._thread.start()
            heapq.heappush(self._heap, (deadline, next(self._order), g))
            if self._heap[0][2] is g:  # earlier than what the thread sleeps for
                self._cond.notify()
        try:
            yield g
        finally:
            with self._cond:
                g.done = True
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, _, g = heapq.heappop(self._heap)
                g.fired = True  # before reading its socket: see Guard.arm
                g.cut()
