"""The exchange plan of image rows over cp, rank by rank in one process: every placeholder token
gets the row of its image that its owner encoded, whatever the layout, sharing and deal."""

from __future__ import annotations

import math

import numpy as np
import torch

from rollfeed.collate.cp import ranges_index, rank_ranges
from rollfeed.collate.image_owners import deal_images
from rollfeed.models.vision_exchange import exchange_plan

CPU = torch.device("cpu")


def _simulate(spans, grids, owner, merge, cu, cp, layout):
    """Each rank's received rows (as (image, token) ids) after the all-to-all, done by hand."""
    order = np.concatenate([ranges_index(rank_ranges(cu, r, cp, layout)) for r in range(cp)])
    plans = [
        exchange_plan(spans=spans, grids=grids, owner=owner, merge=merge, order=order,
                      cp_rank=r, cp_size=cp, device=CPU)
        for r in range(cp)
    ]  # fmt: skip
    # each rank's encoder output: its images' rows, as (image, row within the image)
    outputs = []
    for r in range(cp):
        rows = [(u, j) for u in range(len(grids)) if owner[u] == r
                for j in range(math.prod(grids[u]) // merge**2)]  # fmt: skip
        outputs.append(rows)
    sent = [np.split(np.array([outputs[r][i] for i in p.send.tolist()]).reshape(-1, 2),
                     np.cumsum(p.send_counts)[:-1]) for r, p in enumerate(plans)]  # fmt: skip
    got = {}
    for d, p in enumerate(plans):
        arrived = np.concatenate([sent[s][d] for s in range(cp)]).reshape(-1, 2)
        assert [len(sent[s][d]) for s in range(cp)] == p.recv_counts
        got[d] = arrived[p.local.numpy()]
    return order, got


def test_every_placeholder_gets_its_images_row_from_its_owner():
    rng = np.random.default_rng(0)
    for _ in range(60):
        cp = int(rng.integers(1, 5))
        layout = str(rng.choice(["contiguous", "zigzag"]))
        unit = 2 * cp if layout == "zigzag" else cp
        grids = [(1, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))) for _ in range(3)]
        spans, at = [], int(rng.integers(0, 3))
        for _ in range(int(rng.integers(1, 6))):
            u = int(rng.integers(0, 3))
            n = math.prod(grids[u]) // 4
            spans.append((at, n, u))
            at += n + int(rng.integers(0, 4))
        used = sorted({u for *_, u in spans})
        remap = {u: k for k, u in enumerate(used)}  # the row's distinct images, in first use
        spans = [(a, n, remap[u]) for a, n, u in spans]
        grids = [grids[u] for u in used]
        S = -(-at // unit) * unit
        cu = [0, S]
        owner = np.array(deal_images([math.prod(g) for g in grids], cp))
        order, got = _simulate(np.array(spans), np.array(grids), owner, 2, cu, cp, layout)
        per = S // cp
        for d in range(cp):
            held = order[d * per : (d + 1) * per]
            want = [(u, p - a) for p in held for a, n, u in spans if a <= p < a + n]
            assert got[d].tolist() == [list(w) for w in want], (cp, layout, d)


def test_the_worked_example():
    plan = [
        exchange_plan(spans=np.array([[2, 4, 0]]), grids=np.array([[1, 4, 4]]),
                      owner=np.array([0]), merge=2, order=np.arange(8), cp_rank=r, cp_size=2,
                      device=CPU)
        for r in range(2)
    ]  # fmt: skip
    assert plan[0].send.tolist() == [0, 1, 2, 3] and plan[0].send_counts == [2, 2]
    assert plan[0].recv_counts == [2, 0] and plan[0].local.tolist() == [0, 1]
    assert plan[1].send.tolist() == [] and plan[1].send_counts == [0, 0]
    assert plan[1].recv_counts == [2, 0] and plan[1].local.tolist() == [0, 1]
