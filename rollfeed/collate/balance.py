"""DP balance: split sequences over ranks so that every rank does about the same work.

Cost model: ``cost(L) = L + quadratic * L**2``. The linear term stands for the per-token matmuls,
the quadratic one for causal attention; for a dense transformer of hidden size ``h`` the ratio of
attention to matmul FLOPs per sequence is about ``L / (12 h)``;
the default is ``1 / (12 * 4096)``.

Partition: Karmarkar–Karp's largest differencing method for k-way partitioning (Karmarkar & Karp,
1982; k-way form as in Korf, "Multi-Way Number Partitioning", IJCAI 2009), then a local refinement
that moves or swaps single items between the most and the least loaded rank while that lowers the
maximum.

Worked example (costs, 2 ranks)::

    partition_costs([8, 7, 6, 5, 4], 2) -> [[2, 3, 4], [0, 1]]   # sums 15 / 15
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

DEFAULT_QUADRATIC = 1.0 / (12 * 4096)


def sequence_cost(lengths: np.ndarray | Sequence[int], quadratic: float = DEFAULT_QUADRATIC):
    """``[n]`` float64 cost of each sequence (see module doc)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths + quadratic * lengths * lengths


def _kk(costs: np.ndarray, k: int) -> list[list[int]]:
    # A state is k (sum, head, tail) subsets sorted by sum, descending; a subset's items form a
    # linked list through `link`, so merging subsets is O(1) and allocates no per-subset list
    # (thousands of small lists make the garbage collector, not the algorithm, dominate).
    # Merging two states pairs the heaviest subset of one with the lightest of the other.
    n = len(costs)
    link = [-1] * n
    empty = ((0.0, -1, -1),) * (k - 1)
    heap = [(-c, i, ((c, i, i), *empty)) for i, c in enumerate(costs.tolist())]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = []
        for (sa, ha, ta), (sb, hb, tb) in zip(a, reversed(b), strict=True):
            if ha < 0:
                merged.append((sa + sb, hb, tb))
            elif hb < 0:
                merged.append((sa + sb, ha, ta))
            else:
                link[ta] = hb
                merged.append((sa + sb, ha, tb))
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, tuple(merged)))
    parts = []
    for _, head, _ in heap[0][2] if heap else ((0.0, -1, -1),) * k:
        items = []
        while head >= 0:
            items.append(head)
            head = link[head]
        parts.append(items)
    return parts


def _refine(parts: list[list[int]], costs: np.ndarray, rounds: int) -> None:
    sums = np.array([costs[p].sum() if p else 0.0 for p in parts])
    for _ in range(rounds):
        hi, lo = int(np.argmax(sums)), int(np.argmin(sums))
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            return
        a = np.array(parts[hi], dtype=np.int64)
        b = np.array(parts[lo], dtype=np.int64)
        # Moving cost d from hi to lo lowers the pair's maximum iff 0 < d < gap; best at gap / 2.
        ca, cb = costs[a], costs[b]
        score = np.where((ca > 0) & (ca < gap), np.abs(ca - gap / 2), np.inf)
        j = int(np.argmin(score))
        best, move = score[j], (False, j)
        if len(b):
            # Swap: for each x in hi, the y in lo whose cost is nearest to cost(x) - gap / 2.
            order = np.argsort(cb, kind="stable")
            sb = cb[order]
            at = np.searchsorted(sb, ca - gap / 2).clip(0, len(sb) - 1)
            for near in (at, (at - 1).clip(0)):
                d = ca - sb[near]
                score = np.where((d > 0) & (d < gap), np.abs(d - gap / 2), np.inf)
                x = int(np.argmin(score))
                if score[x] < best:
                    best, move = score[x], (True, x * len(b) + int(order[near[x]]))
        if not np.isfinite(best) or best >= gap / 2:
            return
        is_swap, j = move
        if is_swap:
            x, y = divmod(j, len(b))
            ia, ib = int(a[x]), int(b[y])
            parts[hi][parts[hi].index(ia)], parts[lo][parts[lo].index(ib)] = ib, ia
            delta = costs[ia] - costs[ib]
        else:
            ia = int(a[j])
            parts[hi].remove(ia)
            parts[lo].append(ia)
            delta = costs[ia]
        sums[hi] -= delta
        sums[lo] += delta


def partition_costs(costs: np.ndarray | Sequence[float], k: int, *, rounds: int = 64):
    """Item indices per part (``k`` parts, indices ascending), balancing the sum of costs."""
    costs = np.asarray(costs, dtype=np.float64)
    parts = _kk(costs, k)
    _refine(parts, costs, rounds)
    return [sorted(p) for p in parts]
