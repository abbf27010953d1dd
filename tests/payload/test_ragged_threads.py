"""The padded form of CPU rows fans out to no intra-op thread: a parallel region ends when its
slowest thread does, and with another process on a core that thread waits out time slices (a
``width=`` read of 16,384 rows took 14.9 ms instead of 1.0 ms).

A process starts its OpenMP team at its first parallel region, so a fresh one counts its threads
before and after: the padded form must start none, and a large op after it must (the count sees
a team when there is one)."""

import subprocess
import sys

import torch

from rollfeed.payload import RaggedRows

CHILD = """
import os
import numpy as np
import torch

from rollfeed.payload import RaggedRows
torch.set_num_threads(2)
from rollfeed.payload import RaggedRows

def threads():
    return len(os.listdir("/proc/self/task"))

rng = np.random.default_rng(0)
lengths = rng.integers(1, 8, 16384)
offsets = np.concatenate([[0], np.cumsum(lengths)])
values = rng.integers(0, 151_936, offsets[-1]).astype(np.int32)
rows = RaggedRows(torch.from_numpy(offsets), torch.from_numpy(values))
before = threads()
padded = rows.padded(64, fill=-1)
after = threads()
torch.ones(1 << 22).add_(1)
print(before, after, threads())
"""


def test_padded_starts_no_intra_op_thread() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    before, after, team = map(int, out.stdout.split())
    assert after == before, "RaggedRows.padded fanned out to intra-op threads"
    assert team > after, "a large op started no team: the count cannot see one"


def test_padded_forms_agree_with_torchs() -> None:
    """The NumPy form equals torch's scatter (the form rows that need a gradient still take),
    dtype by dtype, with rows of 0, 1 and many values and a width beyond the longest."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 9, (47,), generator=g)
    lengths[:3] = torch.tensor([0, 1, 8])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])

    for dtype, fill in ((torch.int32, -1), (torch.int64, 7), (torch.float32, float("nan"))):
        values = torch.randint(-50, 50, (int(offsets[-1]),), generator=g).to(dtype)
        rows = RaggedRows(offsets, values)
        want = torch.full((47, 11), fill, dtype=dtype)
        row_of = torch.repeat_interleave(torch.arange(47), lengths)
        want[row_of, torch.arange(len(values)) - offsets[row_of]] = values
        got = rows.padded(11, fill=fill)
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))
