"""Short ops on the calling thread alone: no cliff when another process holds a core.

An OpenMP parallel region ends when its slowest thread does. With another process on one of the
cores, the intra-op thread there runs in the scheduler's time slices (milliseconds), so a region
of a fraction of a millisecond takes a slice whenever that thread is off its core. The fused
scorer's chunk loops are hundreds of such regions (gathers, products, scatter-adds of ``[chunk,
H]``; about 0.3 ms each at ``H = 512``): measured on 2 cores with one held busy, they made the
scorer 2.6-3.2x slower, against 1.1-1.2x when they ran on one thread, which loses only the core
that was taken. A second thread shortens ops that short by less than it risks, so
:func:`serial_below` runs them on the calling thread when each is under
:data:`SERIAL_ELEMENTS`; long ops (the fallback rows' products, whole-buffer fills) keep every
thread, since a stall of one slice is small beside them.

``torch.set_num_threads`` sets the calling thread's team size (and the count threads that start
later take up): the block sets 1 and puts the caller's count back when it ends, on CPU only.

Example::

    with serial_below(chunk * hidden, device):   # chunk 2048, H 512: 1 thread
        for chunk in ...: gather, multiply, add
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SERIAL_ELEMENTS = 1 << 22  # ops under this many elements (16 MiB of fp32) run on one thread


@contextlib.contextmanager
def serial_below(elements: int, device: torch.device) -> Iterator[None]:
    """Run the block on the calling thread alone when its ops hold fewer than
    :data:`SERIAL_ELEMENTS` elements each and run on the CPU (see the module doc)."""
    before = torch.get_num_threads()
    if device.type != "cpu" or elements >= SERIAL_ELEMENTS or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
