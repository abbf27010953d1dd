"""A contention line's busy loop ends with the benchmark that started it, however that ends (a
bench killed inside ``busy_core`` once left its loop spinning, and every later measurement on
the machine ran with a core taken)."""

import os
import signal
import subprocess
import sys
import time

CHILD = "from rollfeed.bench._process import busy_core\nwith busy_core():\n    input()"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_busy_loop_ends_when_its_bench_is_killed() -> None:
    bench = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not (spinner := _children(bench.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spinner, "busy_core started no loop"
    finally:
        os.kill(bench.pid, signal.SIGKILL)  # no finally of the bench's runs
        bench.wait()
    deadline = time.monotonic() + 5
    while not _gone(spinner[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = not _gone(spinner[0])
    if alive:
        os.kill(spinner[0], signal.SIGKILL)
    assert not alive, "the busy loop outlived the bench that started it"
