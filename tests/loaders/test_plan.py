"""Sampler + collator in one process equal prepare_batch + to_tensor_micro_batch, bitwise."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from rollfeed.collate import prepare_batch
from rollfeed.loaders import (
    MicroBatchCollator,
    MicroBatchSampler,
    PlanSpec,
    RolloutDataset,
    Topology,
    plan_step,
    rebuild_micro_batch,
)
from tests.collate.gen import inline_batch
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("payload")
    return root, write_batch(root, 23, seed=3)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("dp_size", "cp_size"), [(1, 1), (2, 2), (3, 1), (1, 4), (5, 2)])
def test_sampler_and_collator_equal_reference(data, dp_size, cp_size, cp_layout, overlong):
    root, samples = data
    ref, plan = reference(
        samples, dp_size=dp_size, cp_size=cp_size, cp_layout=cp_layout, root=root, overlong=overlong
    )
    dataset = RolloutDataset(samples)
    seen: list[int] = []
    dummies = 0
    for dp in range(dp_size):
        sampler = None
        for cp in range(cp_size):
            topo = Topology(dp_rank=dp, dp_size=dp_size, cp_rank=cp, cp_size=cp_size)
            kw = dict(seq_len=SEQ_LEN, cp_layout=cp_layout, overlong=overlong)
            sampler = MicroBatchSampler(dataset, topo, **kw)
            # the collate_fn crosses into workers by pickle
            collate = pickle.loads(pickle.dumps(MicroBatchCollator(topo, root=root, **kw)))
            batches = list(sampler)
            assert batches == [list(mb.indices) for mb in plan[dp]]
            assert len(batches) == len(ref[dp, cp]) == plan.metrics["micro_steps"]
            for k, idx in enumerate(batches):
                assert_bitwise(collate([dataset[i] for i in idx]), ref[dp, cp][k], (dp, cp, k))
        assert sampler is not None
        for idx in sampler.step_micro_batches(0):
            seen += idx
            dummies += not idx
    # every kept sample exactly once over the DP ranks; dummies where the plan has them
    assert dummies == plan.metrics["dummy_micro_batches"]
    kept = [i for i, s in enumerate(samples) if overlong == "truncate" or len(s) <= SEQ_LEN]
    assert sorted(seen) == kept
    if overlong == "drop":
        assert len(kept) < len(samples)  # the grid does exercise dropping


def test_plan_step_is_prepare_batch_indices():
    samples = inline_batch(np.random.default_rng(5), 40, 70)
    spec = PlanSpec(seq_len=32, cp_size=2, cp_layout="zigzag")
    for dp_size in (1, 2, 3, 7):
        plan = prepare_batch(samples, seq_len=32, dp_size=dp_size, cp_size=2, cp_layout="zigzag")
        got = plan_step([len(s) for s in samples], spec, dp_size=dp_size)
        assert got == [[mb.indices for mb in rank] for rank in plan]
        for rank in plan:
            for mb in rank:
                again = rebuild_micro_batch([samples[i] for i in mb.indices], spec)
                for name in ("starts", "cu_seqlens", "length", "cost", "label_fields"):
                    assert getattr(again, name) == getattr(mb, name), name


def test_worked_example_of_plan_step():
    spec = PlanSpec(seq_len=8)
    assert plan_step([5, 3, 6, 2], spec, dp_size=2) == [[(2, 3)], [(0, 1)]]
    assert plan_step([], spec, dp_size=2) == [[], []]


def test_shuffle_is_seeded_same_on_every_rank_and_covers_once():
    samples = inline_batch(np.random.default_rng(1), 30, 20)
    ds = RolloutDataset(samples)

    def rank_batches(seed, dp, step=0):
        topo = Topology(dp_rank=dp, dp_size=2)
        s = MicroBatchSampler(ds, topo, seq_len=24, seed=seed, shuffle=True, start_step=step)
        return s.step_micro_batches(step)

    a = rank_batches(0, 0) + rank_batches(0, 1)
    assert sorted(i for b in a for i in b) == list(range(30))
    assert rank_batches(0, 0) == rank_batches(0, 0)
    assert rank_batches(0, 0) != rank_batches(1, 0)
    assert rank_batches(0, 0, step=0) != rank_batches(0, 0, step=1)  # new order per step


def test_share_as_one_storage_keeps_values_in_one_buffer(data):
    from rollfeed.loaders.collator import share_as_one_storage

    root, samples = data
    ref, _ = reference(samples, dp_size=2, cp_size=2, cp_layout="zigzag", root=root)
    tmb = ref[1, 0][0]
    assert tmb.fields  # by-handle fields present
    shared = share_as_one_storage(tmb)
    assert_bitwise(shared, tmb, "shared")
    tensors = [shared.input_ids, shared.loss_mask, shared.cu_seqlens, *shared.fields.values()]
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(ptrs) == 1 and shared.input_ids.is_shared()
