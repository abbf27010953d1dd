"""A step file whose samples name their group and shared prefix is planned with trees from its
index alone: every rank's micro batches are those of the same samples planned in memory with the
same claimed prefixes (trees, tree rows and tensors), shuffled or not, and two DataLoader workers
hand over the same micro batches as the trainer's process makes; a step file without groups
plans as before; a state saved before trees were planned still loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig, SharedPrefixes, prepare_batch, to_tensor_micro_batch
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepWriter,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.state import SamplerState
from tests.collate.tree_cases import conversation, group, make_tree_samples

CASES = [group(9, [3, 5, 4]), group(6, [2, 7]), conversation(5, [3, 2])]


def _step(tmp_path, *, groups: bool):
    samples, _ = make_tree_samples(np.random.default_rng(0), CASES)
    # the index's one level: a group id and the tokens shared with it (the root prompt)
    ids, shared = [], []
    for c, case in enumerate(CASES):
        n = len(ids)
        leaves = sum(1 for s in samples[n:] if s.uid.startswith(f"c{c}s"))
        ids += [f"prompt-{c}"] * leaves
        shared += [case.length] * leaves
    with StepWriter(tmp_path / "steps", 0) as w:
        for s, g, n in zip(samples, ids, shared, strict=True):
            w.append(s, group=g if groups else None, shared_prefix=n if groups else 0)
    return samples, SharedPrefixes.of_groups(ids, shared)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_step_with_groups_is_planned_as_trees_from_its_index(tmp_path, shuffle: bool) -> None:
    samples, prefixes = _step(tmp_path, groups=True)
    dataset = RolloutDataset.from_step_dir(tmp_path / "steps")
    read = dataset.shared_prefixes(0).chains  # keyed by the index's group hashes
    assert [[n for _, n in c] for c in read] == [[n for _, n in c] for c in prefixes.chains]
    assert len({c for c in read}) == len({c for c in prefixes.chains}) == 3
    plan = PlanConfig(seq_len=64, cp_size=2, cp_layout="zigzag")
    config = LoaderConfig(plan=plan, shuffle=shuffle, seed=3)
    order = np.arange(len(samples))
    if shuffle:
        order = np.random.default_rng([3, 0]).permutation(len(samples))
    shuffled = SharedPrefixes(chains=tuple(prefixes.chains[i] for i in order))
    want = prepare_batch([samples[i] for i in order], plan, dp_size=2, prefixes=shuffled)
    assert want.metrics["trees"] == 3
    for dp in range(2):
        for cp in range(2):
            topo = Topology(dp_rank=dp, dp_size=2, cp_rank=cp, cp_size=2)
            got = list(build_dataloader(dataset, topo, config, root=None))
            assert len(got) == len(want[dp])
            for tmb, mb in zip(got, want[dp], strict=True):
                ref = to_tensor_micro_batch(mb, cp_rank=cp)
                assert (tmb.tree is None) == (mb.tree is None)
                for a, b in zip(tmb.tensors(), ref.tensors(), strict=True):
                    assert torch.equal(a, b)


def test_a_step_without_groups_plans_flat_and_older_states_load(tmp_path) -> None:
    _step(tmp_path, groups=False)
    dataset = RolloutDataset.from_step_dir(tmp_path / "steps")
    assert dataset.shared_prefixes(0) is None
    topo = Topology(dp_rank=0, dp_size=1)
    got = list(
        build_dataloader(dataset, topo, LoaderConfig(plan=PlanConfig(seq_len=64)), root=None)
    )
    assert got and all(t.tree is None for t in got)
    old = {"seq_len": 64, "cp_layout": "contiguous", "pad_to_multiple_of": None}
    old |= {"overlong": "truncate", "quadratic_cost": 0.0, "shuffle": False}
    state = {"version": 3, "step": 1, "micro_batches": 0, "seed": 0, "dp_size": 1, "cp_size": 1}
    state |= {"plan": old, "data": {"samples": 0, "tokens": 0, "digest": ""}}
    loaded = SamplerState.from_dict(state)
    assert loaded.plan["trees"] is True and loaded.plan["tree_min_saving"] == 0.2


@pytest.mark.parametrize("shuffle", [False, True])
def test_tree_micro_batches_from_two_workers_equal_those_made_in_process(
    tmp_path, shuffle: bool
) -> None:
    """Two workers hand tree micro batches over by shared memory: every rank gets the micro
    batches it gets with no workers, tree tokens and the tree row's spans included."""
    _step(tmp_path, groups=True)
    dataset = RolloutDataset.from_step_dir(tmp_path / "steps")
    plan = PlanConfig(seq_len=64, cp_size=2, cp_layout="zigzag")
    config = LoaderConfig(plan=plan, shuffle=shuffle, seed=3)
    for dp, cp in ((0, 0), (1, 1)):
        topo = Topology(dp_rank=dp, dp_size=2, cp_rank=cp, cp_size=2)
        here = list(build_dataloader(dataset, topo, config, root=None))
        loader = build_dataloader(
            dataset, topo, config, root=None, options=LoaderOptions(num_workers=2)
        )
        try:
            there = list(loader)
        finally:
            loader.close()
        assert any(t.tree is not None for t in there)
        for a, b in zip(here, there, strict=True):
            assert (a.tree is None) == (b.tree is None)
            if a.tree is not None:
                host = ("seq_len", "starts", "depths", "lengths", "parents", "flat_counts")
                assert all(getattr(a.tree, k) == getattr(b.tree, k) for k in host)
            for x, y in zip(a.tensors(), b.tensors(), strict=True):
                assert isinstance(y, torch.Tensor) and torch.equal(x, y)
