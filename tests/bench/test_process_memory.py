"""A benchmark child measures its own peak memory, whatever its parent held when it started it
(``bench all`` runs the scoring children from a process that held a GiB)."""

import numpy as np

from rollfeed.bench._process import run_variant

PARENT_MIB, CHILD_MIB = 512, 32


def test_child_peak_is_its_own_not_its_parents() -> None:
    held = np.ones(PARENT_MIB << 20, np.uint8)  # this process's resident set, at the fork
    try:
        got = run_variant("tests.bench.memory_child", [str(CHILD_MIB)])["extra_bytes"] / 2**20
    finally:
        del held
    # the child's 32 MiB and its interpreter's few MiB of transients; never the parent's 512
    assert CHILD_MIB - 4 < got < CHILD_MIB + 16, got
