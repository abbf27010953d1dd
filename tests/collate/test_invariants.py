"""Planning invariants over a randomized grid; each test also guards against passing vacuously."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rollfeed.collate import IGNORE_INDEX, PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.collate.cp import attention_work, ranges_index, rank_ranges
from tests.collate.gen import inline_batch

GRID = list(
    itertools.product(
        [16, 48],  # seq_len
        [1, 2, 3],  # dp_size
        [1, 2, 4],  # cp_size
        ["contiguous", "zigzag"],
        ["truncate", "drop"],
    )
)


def _plan(seed, seq_len, dp, cp, layout, overlong, pad=None):
    rng = np.random.default_rng(seed)
    n = 1 if seed == 0 else int(rng.integers(2, 20))  # one sample: short ranks get dummies
    samples = inline_batch(rng, n, seq_len if n == 1 else 2 * seq_len)
    config = PlanConfig(
        seq_len=seq_len, cp_size=cp, cp_layout=layout, overlong=overlong, pad_to_multiple_of=pad
    )
    plan = prepare_batch(samples, config, dp_size=dp)
    return samples, plan


@pytest.mark.parametrize(("seq_len", "dp", "cp", "layout", "overlong"), GRID)
def test_plan_invariants(seq_len, dp, cp, layout, overlong):
    seen = dict(truncated=0, dropped=0, dummies=0, multi=0, slot_pad=0, tail_pad=0)
    for seed in range(6):
        samples, plan = _plan(seed, seq_len, dp, cp, layout, overlong)
        unit = 2 * cp if layout == "zigzag" else cp
        m = plan.metrics
        assert len(plan) == dp
        assert len({len(r) for r in plan}) == 1  # equal micro batch counts per DP rank
        placed = sorted(i for r in plan for mb in r for i in mb.indices)
        keep = [i for i, s in enumerate(samples) if overlong == "truncate" or len(s) <= seq_len]
        assert placed == keep  # every kept sample exactly once
        want = sum(min(len(samples[i]), seq_len) for i in keep)
        assert sum(mb.num_tokens for r in plan for mb in r) == want == m["tokens"]
        assert m["truncated_tokens"] == sum(max(len(s) - seq_len, 0) for s in samples) * (
            overlong == "truncate"
        )
        for mb in (mb for r in plan for mb in r):
            assert mb.length % unit == 0 and mb.length <= seq_len
            for s, i in zip(mb.samples, mb.indices, strict=True):
                assert np.array_equal(s.token_ids, samples[i].token_ids[:seq_len])
            slots = np.diff(mb.cu_seqlens)
            assert (slots > 0).all()
            if layout == "zigzag":
                assert (slots % unit == 0).all()
            seen["dummies"] += mb.is_dummy
            seen["multi"] += len(mb.samples) > 1
            seen["slot_pad"] += any(
                b - a > len(s)
                for s, a, b in zip(mb.samples, mb.cu_seqlens, mb.cu_seqlens[1:], strict=False)
            )
            seen["tail_pad"] += len(mb.cu_seqlens) - 1 > len(mb.samples)
        seen["truncated"] += m["truncated"]
        seen["dropped"] += m["dropped"]
    assert seen["truncated" if overlong == "truncate" else "dropped"] > 0
    assert seen["multi"] > 0
    if cp > 1 or layout == "zigzag":
        assert seen["tail_pad"] + seen["slot_pad"] > 0
    if dp > 1:
        assert seen["dummies"] > 0
    if layout == "zigzag" and cp > 1:
        assert seen["slot_pad"] > 0


@pytest.mark.parametrize(("seq_len", "dp", "cp", "layout"), [g[:4] for g in GRID[::2]])
def test_rank_tensors(seq_len, dp, cp, layout):
    """Rows rebuilt from every CP rank: positions, labels, loss mask, cover-once windows."""
    seen = dict(boundaries=0, padding=0, masked=0)
    for seed in range(3):
        _, plan = _plan(seed, seq_len, dp, cp, layout, "truncate")
        for mb in (mb for r in plan for mb in r):
            S = mb.length
            parts = [to_tensor_micro_batch(mb, cp_rank=r) for r in range(cp)]
            pos = torch.cat([p.positions for p in parts])
            assert torch.equal(pos.sort().values, torch.arange(S))  # each position exactly once
            assert all(p.input_ids.numel() == S // cp for p in parts)
            row = {}
            for name in ("input_ids", "position_ids", "labels", "loss_mask", "advantages"):
                full = torch.empty(S, dtype=getattr(parts[0], name).dtype)
                full[pos] = torch.cat([getattr(p, name) for p in parts])
                row[name] = full
            real = torch.zeros(S, dtype=torch.bool)
            for s, a in zip(mb.samples, mb.starts, strict=True):
                T = len(s)
                real[a : a + T] = True
                assert torch.equal(row["position_ids"][a : a + T], torch.arange(T))
                assert torch.equal(row["input_ids"][a : a + T], torch.from_numpy(s.token_ids))
                assert torch.equal(row["labels"][a : a + T - 1], torch.from_numpy(s.token_ids[1:]))
                assert row["labels"][a + T - 1] == IGNORE_INDEX  # no label crosses a boundary
                assert not row["loss_mask"][a + T - 1]
                assert torch.equal(
                    row["loss_mask"][a : a + T - 1], torch.from_numpy(s.loss_mask[1:])
                )
                seen["boundaries"] += 1
                seen["masked"] += int(s.loss_mask[1:].sum())
            for a in mb.cu_seqlens[:-1]:
                assert row["position_ids"][a] == 0  # positions restart in every slot
            pad = ~real
            assert not row["loss_mask"][pad].any()  # padding is loss-masked
            assert (row["labels"][pad] == IGNORE_INDEX).all()
            assert (row["advantages"][pad] == 0).all()
            seen["padding"] += int(pad.sum())
            cu = torch.tensor(mb.cu_seqlens, dtype=torch.int32)
            assert all(torch.equal(p.cu_seqlens, cu) for p in parts)
    assert seen["boundaries"] > 1 and seen["masked"] > 0
    if cp > 1 or layout == "zigzag" or dp > 1:
        assert seen["padding"] > 0


def test_zigzag_windows_and_balance():
    cu = [0, 16, 24, 48]
    got = [rank_ranges(cu, r, 4, "zigzag") for r in range(4)]
    # chunks of 2, 1, 3 tokens per slot; rank 0 takes chunks 0 and 7 of each (adjacent ones merge)
    assert got[0] == [(0, 2), (14, 17), (23, 27), (45, 48)]
    work = {attention_work(cu, g) for g in got}
    assert len(work) == 1  # zigzag: causal attention work equal on every rank
    contiguous = [attention_work(cu, rank_ranges(cu, r, 4, "contiguous")) for r in range(4)]
    assert max(contiguous) > min(contiguous) and sum(contiguous) == 4 * work.pop()
    idx = np.concatenate([ranges_index(g) for g in got])
    assert np.array_equal(np.sort(idx), np.arange(48))
    assert rank_ranges(cu, 3, 4, "contiguous") == [(36, 48)]


def test_dummy_micro_batch_tensors():
    rng = np.random.default_rng(3)
    samples = inline_batch(rng, 1, 8)
    plan = prepare_batch(samples, PlanConfig(seq_len=16, cp_size=2, cp_layout="zigzag"), dp_size=3)
    dummies = [mb for r in plan for mb in r if mb.is_dummy]
    assert len(dummies) == 2 and plan.metrics["dummy_micro_batches"] == 2
    for r in range(2):
        t = to_tensor_micro_batch(dummies[0], cp_rank=r)
        assert t.is_dummy and t.fields == {} and t.input_ids.shape == (2,)
        assert not t.loss_mask.any() and (t.labels == IGNORE_INDEX).all()
        assert torch.equal(t.cu_seqlens, torch.tensor([0, 4], dtype=torch.int32))


def test_deterministic():
    a = _plan(5, 48, 3, 2, "zigzag", "truncate")[1]
    b = _plan(5, 48, 3, 2, "zigzag", "truncate")[1]
    assert [[(m.indices, m.cu_seqlens) for m in r] for r in a] == [
        [(m.indices, m.cu_seqlens) for m in r] for r in b
    ]
    assert a.metrics == b.metrics
