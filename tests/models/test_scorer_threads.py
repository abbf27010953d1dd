"""The fused scorer's chunk loops fan out to no intra-op thread at a chunk of ``2048 x 256``:
hundreds of sub-millisecond parallel regions each wait out a time slice when another process
holds a core (the scorer went 2.6-3.2x slower with one of 2 cores busy, against 1.1-1.2x on one
thread; :mod:`rollfeed.models.threads`).

A process starts its OpenMP team at its first parallel region, so a fresh one counts its threads
around the projection's forward and backward, with hidden states, weight and their gradients
under torch's grain (each op outside the loops runs inline anyway): none may start, and a large
op after them must (the count sees a team when there is one)."""

import subprocess
import sys

import torch

from rollfeed.models.threads import SERIAL_ELEMENTS, serial_below

CHILD = """
import os
import torch
torch.set_num_threads(2)
from rollfeed.models.fused import DEFAULT_CHUNK_SIZE, _FusedHeadProjection

def threads():
    return len(os.listdir("/proc/self/task"))

g = torch.Generator().manual_seed(0)
n, v, h, pairs = 100, 100, 256, 6000
hidden = torch.randn(n, h, generator=g, requires_grad=True)
weight = torch.randn(v, h, generator=g, requires_grad=True)
rows = torch.arange(n).repeat_interleave(pairs // n)
ids = torch.randint(0, v, (pairs,), generator=g)
none = torch.zeros(0, dtype=torch.long)
before = threads()
dots, _, _ = _FusedHeadProjection.apply(
    hidden, weight, rows, ids, none, torch.zeros(0), DEFAULT_CHUNK_SIZE, False
)
forward = threads()
dots.sum().backward()
backward = threads()
torch.ones(1 << 22).add_(1)
print(before, forward, backward, threads())
"""


def test_chunk_loops_start_no_intra_op_thread() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    before, forward, backward, team = map(int, out.stdout.split())
    assert forward == before, "the forward's chunk loop fanned out to intra-op threads"
    assert backward == before, "the backward's chunk loop fanned out to intra-op threads"
    assert team > backward, "a large op started no team: the count cannot see one"


def test_serial_below_puts_the_count_back_and_keeps_long_ops_parallel() -> None:
    before = torch.get_num_threads()
    cpu = torch.device("cpu")
    with serial_below(SERIAL_ELEMENTS - 1, cpu):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with serial_below(SERIAL_ELEMENTS, cpu):
        assert torch.get_num_threads() == before
    try:
        with serial_below(1, cpu):
            raise KeyError("inside")
    except KeyError:
        pass
    assert torch.get_num_threads() == before
