"""The padded form of CPU rows, made by NumPy on the calling thread.

torch's fill and scatter of the padded form of a micro batch (16,384 rows) each fan out to the
intra-op threads, and a parallel region ends when its slowest thread does: with another process
on one of 2 cores, the thread there waits out the scheduler's time slices (milliseconds), and a
``width=`` read took 14.9 ms instead of 1.0 ms while the ragged read was unaffected. The work is a
memset and one scatter, about a millisecond, which a second thread hardly shortens, so
:meth:`~rollfeed.payload.RaggedRows.padded` makes it here for CPU rows that need no gradient.

Example: offsets ``[0, 1, 3]``, values ``[7, 3, 9]``, ``W = 3``, fill ``-1`` -> the values go to
flat positions ``[0, 3, 4]``: ``[[7, -1, -1], [3, 9, -1]]``.
"""

from __future__ import annotations

import numpy as np
import torch

# dtypes NumPy holds as they are (bfloat16 is not one: its rows take torch's path)
_INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
NUMPY_DTYPES = frozenset((*_INTS, torch.float16, torch.float32, torch.float64))


def pad_serially(out: np.ndarray, offsets: np.ndarray, values: np.ndarray, fill: float) -> None:
    """Fill ``out [n, W]`` with the rows of ``offsets [n + 1]``, ``values [nnz]`` left-aligned and
    ``fill`` after them (every row fits ``W``: the caller checked)."""
    n, width = out.shape
    flat = out.reshape(-1)
    flat.fill(fill)
    shift = np.arange(n, dtype=np.int64) * width - offsets[:-1]  # [n]: flat start - offset
    flat[np.arange(len(values), dtype=np.int64) + np.repeat(shift, np.diff(offsets))] = values
