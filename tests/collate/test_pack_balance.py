"""First-Fit-Decreasing packing and Karmarkar–Karp balancing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollfeed.collate.balance import partition_costs, sequence_cost
from rollfeed.collate.pack import pack_ffd


def test_pack_worked_example():
    assert pack_ffd([5, 3, 6, 2, 2], 8) == [[2, 3], [0, 1], [4]]


@pytest.mark.parametrize("seed", range(5))
def test_pack_first_fit_property(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 65, 200)
    bins = pack_ffd(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    free = [64 - int(lengths[b].sum()) for b in bins]
    assert min(free) >= 0
    # First fit: an item sits in a later bin only because it did not fit any earlier one.
    for i, j in itertools.combinations(range(len(bins)), 2):
        assert lengths[bins[j]].min() > free[i]
    assert len(bins) > int(lengths.sum()) // 64  # non-vacuity: many bins, several items each


def test_partition_worked_example_and_brute_force():
    assert partition_costs([8, 7, 6, 5, 4], 2) == [[2, 3, 4], [0, 1]]
    rng = np.random.default_rng(0)
    worse = 0
    for _ in range(16):
        costs = rng.integers(1, 100, 8).astype(float)
        parts = partition_costs(costs, 3)
        assert sorted(i for p in parts for i in p) == list(range(8)) and len(parts) == 3
        got = max(costs[p].sum() for p in parts)
        best = min(
            max(costs[[i for i in range(8) if a[i] == r]].sum() for r in range(3))
            for a in itertools.product(range(3), repeat=8)
        )
        assert got <= 1.15 * best
        worse += got > best
    assert worse < 8  # mostly optimal on small sets


def test_partition_large_balanced():
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(7.0, 1.0, 2000).astype(int) + 1, 16384)
    costs = sequence_cost(lengths)
    parts = partition_costs(costs, 8)
    sums = np.array([costs[p].sum() for p in parts])
    assert sums.max() / sums.mean() < 1.001
    assert partition_costs([3.0], 4) == [[0], [], [], []]


def test_sequence_cost():
    assert np.allclose(sequence_cost([10, 100], quadratic=0.01), [11.0, 200.0])
