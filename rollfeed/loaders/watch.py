"""WorkerWatch: a bounded wait for the workers' next micro batch, telling a stopped worker from a
slow one and naming a dead one.

A DataLoader waits for its workers' next result without bound (``timeout=0``) and notices only a
worker that exited: a stopped one (``SIGSTOP``, job control, a debugger) looks alive for ever, and
its own ``timeout`` ends in an untyped ``RuntimeError``. So the loader's DataLoader waits at most
:data:`TICK_S` at a time, and a monitor thread looks at the workers once a tick while someone
waits for them (each worker writes its pid into a shared array as it starts), by their state in
``/proc/<pid>/stat``:

- a worker seen stopped (state ``T`` or ``t``) at every look for ``stopped_s`` is killed, which
  also ends a handover blocked on it (the receiver of a micro batch fetches its shared memory from
  the worker that made it), and the waiter raises :class:`WorkerStoppedError` naming the worker,
  its pid and the step;
- a worker that exited (gone, or a zombie) raises :class:`WorkerDiedError`, and so does torch's
  own error for it: the ``RuntimeError`` of a dead worker from the DataLoader, a handover cut
  short, or the ``SIGCHLD`` handler's (:mod:`rollfeed.loaders.child_deaths`);
- running workers (slow: reading a far store, swapping) are waited for up to ``timeout_s`` in
  all, then :class:`WorkerTimeoutError`.

After any of these the loader's next pass starts new workers, from the consumed state. Without
``/proc`` (not Linux) a stopped worker cannot be told from a slow one: ``timeout_s`` alone
bounds the wait there.

Example (``stopped_s=5``; worker 1 stopped by ``kill -STOP``): ``next(it)`` raises
``WorkerStoppedError: DataLoader worker 1 (pid 4242) had been stopped (state T) for 5.0 s ...``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from rollfeed.loaders.child_deaths import arm, report
from rollfeed.loaders.errors import (
    WorkerDiedError,
    WorkerError,
    WorkerStoppedError,
    WorkerTimeoutError,
)

TICK_S = 1.0  # how often a waiting loader looks at its workers
MONITOR_THREAD = "rollfeed-watch"
_TICK = "DataLoader timed out after"  # the text of torch's timeout: a tick, not an error
_EXITING_S = 2.0  # how long a cut handover waits for its worker's exit to show in /proc


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``Z``, ...) from
    ``/proc``; ``"gone"`` when there is no such process; ``None`` when ``/proc`` cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :][:1].decode() or None  # the name may hold ")" itself


class WorkerWatch:
    """Watches one DataLoader's workers (``pids[i]``: worker ``i``'s, 0 until it started); a
    monitor thread looks at them while someone waits (see the module doc)."""

    def __init__(self, pids: Any, *, timeout_s: float, stopped_s: float) -> None:
        self.pids, self.timeout_s, self.stopped_s = pids, timeout_s, stopped_s
        self.step: Callable[[], int | None] = lambda: None  # the step being loaded
        self.failure: WorkerStoppedError | None = None  # set by the monitor
        self.waiting = threading.Event()
        self.closed = threading.Event()
        monitor = threading.Thread(
            target=_monitor, args=(weakref.ref(self),), name=MONITOR_THREAD, daemon=True
        )
        monitor.start()

    def close(self) -> None:
        self.closed.set()

    def follow(self, source: Iterator[Any]) -> Iterator[Any]:
        """``source``'s items, each waited for by :meth:`next`."""
        try:
            while True:
                yield self.next(source)
        except StopIteration:
            return
        except BaseException:
            del source  # a traceback keeps its frames' locals: not the DataLoader's iterator
            raise

    def next(self, source: Iterator[Any]) -> Any:
        """``next(source)`` (a DataLoader iterator with ``timeout=TICK_S``) within the bounds.

        A worker error is raised with neither cause nor context: torch's frames, which a
        chained error's traceback would keep, hold the DataLoader's iterator, which the loader
        retires on a thread of its own (``RolloutLoader._retire``)."""
        began = time.monotonic()
        self.waiting.set()
        try:
            while True:
                failure: WorkerError | None = None
                try:
                    return next(source)
                except (RuntimeError, ConnectionError, EOFError) as err:
                    tick = str(err).startswith(_TICK)
                    failure = self.failure or (None if tick else self.died_of(err))
                    if failure is None and not tick:
                        raise
                now = time.monotonic()
                if failure is None and self.timeout_s and now - began >= self.timeout_s:
                    failure = WorkerTimeoutError(
                        f"no micro batch came from the {len(self.pids)} running DataLoader "
                        f"workers (pids {self._pids()}) within LoaderOptions.timeout_s="
                        f"{self.timeout_s}: they are slow (a far payload store, a full "
                        "machine); raise timeout_s",
                        step=self.step(),
                    )
                if failure is not None:
                    del source
                    raise failure
        finally:
            self.waiting.clear()

    def died_of(self, err: BaseException) -> WorkerDiedError | None:
        """The typed error for ``err`` if a worker died, else ``None``."""
        dead = self.dead()
        # a handover cut short: the worker may still be on its way out
        cut = isinstance(err, ConnectionError | EOFError)
        deadline = time.monotonic() + _EXITING_S
        while cut and not dead and time.monotonic() < deadline:
            time.sleep(0.01)
            dead = self.dead()
        return self.died(dead, err) if dead else None

    def look(self, stopped: dict[int, float], now: float) -> None:
        """The monitor's look: a worker stopped for ``stopped_s`` of a wait is killed (which
        ends a handover blocked on it too) and its error left for the waiter."""
        for worker, pid in enumerate(self.pids):
            state = process_state(pid) if pid else None
            if state not in ("T", "t"):
                stopped.pop(worker, None)
                continue
            since = stopped.setdefault(worker, now)
            if now - since >= self.stopped_s and self.failure is None:
                self.failure = WorkerStoppedError(
                    f"DataLoader worker {worker} (pid {pid}) had been stopped (state {state}) "
                    f"for {now - since:.1f} s while the trainer waited for its micro batch "
                    f"(LoaderOptions.stopped_s={self.stopped_s}): find what stops it (raise "
                    "stopped_s to debug a worker). It was killed; the loader's next pass starts "
                    "new workers from the micro batches consumed",
                    worker=worker,
                    step=self.step(),
                )
                report(pid)  # before the kill: its SIGCHLD raises nothing more
                os.kill(pid, signal.SIGKILL)

    def kill_all(self) -> None:
        """Kill every worker still there (the loader retires them), their deaths reported."""
        self.close()
        for pid in self.pids:
            if pid and process_state(pid) not in ("gone", "Z", "X", None):
                report(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def dead(self) -> list[tuple[int, int]]:
        """``(worker, pid)`` of the workers that exited."""
        return [
            (w, pid)
            for w, pid in enumerate(self.pids)
            if pid and process_state(pid) in ("gone", "Z", "X")
        ]

    def died(self, dead: list[tuple[int, int]], err: BaseException) -> WorkerDiedError:
        """The error for ``dead`` workers, whose deaths count as reported from now on."""
        for _, pid in dead:
            report(pid)
        names = ", ".join(f"{w} (pid {pid})" for w, pid in dead)
        return WorkerDiedError(
            f"DataLoader worker {names} exited before delivering its micro batch "
            f"({type(err).__name__}: {err}); a SIGKILL is often the OOM killer: look at the "
            "kernel log. The loader's next pass starts new workers from the micro batches "
            "consumed (state_dict() counts only those)",
            worker=dead[0][0],
            step=self.step(),
        )

    def arm(self) -> None:
        """Have ``SIGCHLD`` raise this watch's worker deaths typed (:mod:`.child_deaths`)."""
        arm(self)

    def _pids(self) -> str:
        return ", ".join(str(p) for p in self.pids)


def _monitor(ref: weakref.ref[WorkerWatch]) -> None:
    """The monitor thread: while its watch lives and someone waits, one look per tick."""
    stopped: dict[int, float] = {}
    while (watch := ref()) is not None and not watch.closed.is_set():
        waiting = watch.waiting.wait(TICK_S)
        if waiting:
            watch.look(stopped, time.monotonic())
        else:
            stopped.clear()
        del watch  # only the weak reference between looks: the watch may go
        time.sleep(TICK_S if waiting else 0)
