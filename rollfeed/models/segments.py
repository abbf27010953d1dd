"""Per-row reductions over ragged pairs, by ordered kernels (the same result bit for bit each run).

A support scorer holds its candidates flat: ``values [P]`` with the row of each, ``rows [P]``, in
``N`` rows (most rows one or two candidates, a few hundreds). A row's sum is an ordered
accumulation into ``[N]``, never a difference of a cumulative sum (which loses the small rows'
precision to the large prefix before them), and never an atomic add whose order the scheduler
sets:

- CPU: ``index_add`` along dim 0 adds the index's entries one after another, in index order
  (``index_put``'s CPU accumulation is the parallel, unordered one);
- elsewhere (CUDA, XPU): ``index_put(accumulate=True)`` sorts the indices and adds each
  destination's contributions in sorted order without atomics (``index_put_with_sort_kernel`` in
  aten/src/ATen/native/cuda/Indexing.cu, the path ``torch.use_deterministic_algorithms`` routes
  ``index_add_`` to), while ``index_add`` there adds with atomics.

A maximum is exact in any order, so :func:`segment_max` is one ``scatter_reduce``. Integer counts
are exact in any order too (:func:`segment_count`).

Example, ``N = 3``, ``rows = [0, 0, 2]``, ``values = [1., 2., 5.]``::

    segment_sum  -> [3., 0., 5.]
    segment_max  -> [2., -inf, 5.]
    segment_count(values > 1) -> [1, 0, 1]
"""

from __future__ import annotations

import torch


def add_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[index[i]] += rows[i]`` in place (``index [k]``, ``rows [k, ...]``), ordered.

    Example: ``out = zeros(3, 2)``, ``index = [2, 0, 2]``, ``rows = [[1, 1], [2, 2], [3, 3]]``
    → ``out = [[2, 2], [0, 0], [4, 4]]``.
    """
    if out.device.type == "cpu":
        out.index_add_(0, index, rows)
    else:
        out.index_put_((index,), rows, accumulate=True)


def segment_sum(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: ``out[r] = Σ_{i: rows[i] = r} values[i]`` (0 for a row without entries), ordered;
    differentiable in ``values`` (the backward is the gather ``grad[rows]``)."""
    out = values.new_zeros(n)
    if out.device.type == "cpu":
        return out.index_add(0, rows, values)
    return out.index_put((rows,), values, accumulate=True)


def segment_max(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: each row's maximum, ``-inf`` for a row without entries (not differentiable: the
    scorers use it as a shift that cancels out)."""
    out = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, rows, values.detach(), "amax", include_self=True)


def segment_count(mask: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` int64: how many entries of each row have ``mask`` set."""
    out = torch.zeros(n, dtype=torch.int64, device=mask.device)
    return out.index_add_(0, rows, mask.to(torch.int64))
