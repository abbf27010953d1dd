"""Measuring one benchmark variant in its own process, so no variant's allocations hide in
another's peak.

``run_variant("rollfeed.bench.scoring", ["--child", "fused", ...])`` runs the module in a fresh
interpreter and returns the JSON object its child mode prints last. Inside the child,
:func:`resident_bytes` is the current resident set (taken after the inputs exist, so their
transients are not credited to the variant), :func:`reset_peak` sets the high-water mark back to
it, and :func:`peak_bytes` is the high-water mark since; PyTorch's CPU allocator does not cache,
so the difference is what the variant held at once.

The high-water mark is the process's own: ``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs``. ``getrusage``'s ``ru_maxrss`` is not: Linux carries it over ``exec``
from the process that forked the child, so a child of ``bench all`` (whose earlier benchmarks
held a GiB) reported that GiB as its own peak (1,037 MiB against a true 13 MiB).

:func:`busy_core` holds one core busy from another process for a block, for the benchmarks'
contention lines (the same measurement with and without it, interleaved). :func:`cpu_seconds`
(one process, every thread) and :class:`Cores` (the whole machine) say whether a measurement
was bound by this machine's cores rather than by waiting.

Example (a child that allocates 100 MiB after its inputs)::

    base = resident_bytes(); reset_peak(); run(); peak_bytes() - base   -> ~100 MiB
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

_RESET_PEAK = b"5"  # clear_refs: set VmHWM back to the current resident set
# a busy loop that ends with the process that started it (killed without its finally: no orphan);
# the parent's pid is given, not read at the loop's start: the parent may die before that
_SPIN = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent: pass"


def run_variant(
    module: str, argv: list[str], env: dict[str, str] | None = None
) -> dict[str, float]:
    """``env``: variables added to this process's environment for the child."""
    out = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        check=True,
        env=None if env is None else {**os.environ, **env},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Another process holds one core busy (a ``while`` loop) for the block: the contention a
    trainer meets when a loader worker or a peer's job takes a core. The loop also ends when
    this process does, however it ends."""
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())])
    try:
        time.sleep(0.2)  # its interpreter started and spinning
        yield
    finally:
        proc.kill()
        proc.wait()


def resident_bytes() -> int:
    """Current resident set (``/proc/self/statm``), not the high-water mark."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Set this process's high-water mark back to its resident set now."""
    with open("/proc/self/clear_refs", "wb") as f:
        f.write(_RESET_PEAK)


def peak_bytes() -> int:
    """This process's own resident-set high-water mark (``VmHWM``), since :func:`reset_peak`
    or its start (see the module doc)."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: the memory bench needs Linux")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system, every thread) process ``pid`` has used so far
    (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Cores:
    """The machine's CPU time so far (``/proc/stat``): ``busy`` of ``total`` clock ticks over
    every core. ``Cores.now().busy_since(before)``: how many of its cores were busy, on average,
    between the two (``2.0`` on a 2-core machine: none was ever idle)."""

    busy: int
    total: int

    @classmethod
    def now(cls) -> Cores:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle and waiting for I/O
        return cls(busy=sum(ticks) - idle, total=sum(ticks))

    def busy_since(self, before: Cores) -> float:
        total = self.total - before.total
        return (self.busy - before.busy) / total * (os.cpu_count() or 1) if total else 0.0
