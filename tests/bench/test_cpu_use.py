"""The benchmarks' CPU lines count what a process and the machine really used: a child that
spins for half a CPU-second is charged that half second, and the machine's busy cores over the
same time hold it."""

import os
import subprocess
import sys
import time

from rollfeed.bench._process import Cores, cpu_seconds

SPIN_S = 0.5
# spins for SPIN_S of its own CPU time, says so, then waits (alive: its counters are readable)
CHILD = (
    f"import time\nwhile time.process_time() < {SPIN_S}: pass\nprint('spun', flush=True)\ninput()"
)


def test_a_spinning_child_is_charged_its_cpu_time_and_the_machines_cores_hold_it() -> None:
    before, t0 = Cores.now(), time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        used, elapsed = cpu_seconds(child.pid), time.monotonic() - t0
        busy = Cores.now().busy_since(before)
    finally:
        child.kill()
        child.wait()
    # its own time, the interpreter's start included (a clock tick is 10 ms), never less
    assert SPIN_S - 0.01 <= used <= SPIN_S + 1.0, used
    # the machine was at least that busy on average over the same wall time, and no more
    # than all of its cores
    assert used / elapsed * 0.9 <= busy <= (os.cpu_count() or 1) * 1.01, (used, elapsed, busy)
