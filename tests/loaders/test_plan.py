"""Sampler + collator equal prepare_batch + to_tensor_micro_batch bitwise, under one config."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
from torch.utils.data import DataLoader

from rollfeed.collate import BatchConfigError, PlanConfig, RaggedRows
from rollfeed.loaders import (
    LoaderConfig,
    MicroBatchCollator,
    MicroBatchSampler,
    PlanMismatchError,
    RolloutDataset,
    Topology,
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
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=cp_size, cp_layout=cp_layout, overlong=overlong)
    dataset = RolloutDataset(samples)
    seen: list[int] = []
    dummies = 0
    for dp in range(dp_size):
        sampler = None
        for cp in range(cp_size):
            topo = Topology(dp_rank=dp, dp_size=dp_size, cp_rank=cp, cp_size=cp_size)
            sampler = MicroBatchSampler(dataset, topo, LoaderConfig(plan=config))
            # the collate_fn crosses into workers by pickle
            collate = pickle.loads(
                pickle.dumps(MicroBatchCollator(topo, LoaderConfig(plan=config), root=root))
            )
            batches = list(sampler)
            assert batches == [list(mb.indices) for mb in plan[dp]]
            assert len(batches) == len(ref[dp, cp]) == plan.metrics["micro_steps"]
            for k, idx in enumerate(batches):
                got = collate(dataset.__getitems__(idx))  # as a DataLoader fetches them
                assert_bitwise(got, ref[dp, cp][k], (dp, cp, k))
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


def test_a_collator_with_another_config_than_the_sampler_is_refused(data):
    root, samples = data
    dataset = RolloutDataset(samples)
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    planned = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")
    sampler = MicroBatchSampler(dataset, topo, LoaderConfig(plan=planned))
    equal = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")  # another, equal object
    same = MicroBatchCollator(topo, LoaderConfig(plan=equal), root=root)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=same)
    assert [t.cp_layout for t in loader] == ["zigzag"] * len(sampler)
    # a worker receives the yielded indices by pickle: the config travels with them
    (first, *_) = sampler.step_micro_batches(0)
    assert pickle.loads(pickle.dumps(first)).config == planned
    for other, named in (
        (PlanConfig(seq_len=SEQ_LEN, cp_size=2), r"cp_layout: 'zigzag' != 'contiguous'"),
        (PlanConfig(seq_len=2 * SEQ_LEN, cp_size=2, cp_layout="zigzag"), r"seq_len: 48 != 96"),
        (replace(planned, overlong="drop"), "overlong: 'truncate' != 'drop'"),
    ):
        collate = MicroBatchCollator(topo, LoaderConfig(plan=other), root=root)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
        with pytest.raises(PlanMismatchError, match=named):
            next(iter(loader))


def test_a_topology_on_another_cp_axis_than_the_plan_is_refused():
    dataset = RolloutDataset(inline_batch(np.random.default_rng(0), 4, 8))
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=0, cp_size=2)
    config = PlanConfig(seq_len=16, cp_size=4)
    with pytest.raises(BatchConfigError, match=r"topology\.cp_size=2 but plan\.cp_size=4"):
        MicroBatchSampler(dataset, topo, LoaderConfig(plan=config))
    with pytest.raises(BatchConfigError, match=r"topology\.cp_size=2 but plan\.cp_size=4"):
        MicroBatchCollator(topo, LoaderConfig(plan=config), root=None)


def test_shuffle_is_seeded_same_on_every_rank_and_covers_once():
    samples = inline_batch(np.random.default_rng(1), 30, 20)
    ds = RolloutDataset(samples)

    def rank_batches(seed, dp, step=0):
        topo = Topology(dp_rank=dp, dp_size=2)
        config = PlanConfig(seq_len=24)
        s = MicroBatchSampler(
            ds, topo, LoaderConfig(plan=config, seed=seed, shuffle=True, start_step=step)
        )
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
    tensors = [shared.input_ids, shared.loss_mask, shared.cu_seqlens, *shared.tensors()]
    assert any(isinstance(v, RaggedRows) for v in shared.fields.values())
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(ptrs) == 1 and shared.input_ids.is_shared()
