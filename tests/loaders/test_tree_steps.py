"""A step file whose samples name their group and shared prefix is planned with trees from its
index alone: every rank's micro batches are those of the same samples planned in memory with the
same claimed prefixes (trees, tree rows and tensors), shuffled or not, and two DataLoader workers
hand over the same micro batches as the trainer's process makes; a step file without groups
plans as before; a state saved before trees were planned still loads. Every group id claims its
prefix whatever its hash; tokens that differ where the index claims them shared are a typed error
naming the step file, the step, the sample's number in it, the field and the position."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rollfeed.collate import (
    PlanConfig,
    Sample,
    SharedPrefixError,
    SharedPrefixes,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepWriter,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.state import SamplerState
from rollfeed.payload.format.step_layout import group_hash
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


def _group_step(tmp_path, groups: list[str], *, differ_at: tuple[int, int] | None = None):
    """Groups of 3 samples (a 10-token prompt, 5 tokens each of their own), written with their
    group and shared prefix; ``differ_at=(sample, pos)``: that sample's token there changed."""
    rng = np.random.default_rng(1)
    with StepWriter(tmp_path / "steps", 0) as w:
        for g in groups:
            prompt = rng.integers(0, 100, 10)
            for _ in range(3):
                ids = np.concatenate([prompt, rng.integers(0, 100, 5)])
                if differ_at is not None and len(w) == differ_at[0]:
                    ids[differ_at[1]] += 1
                sample = Sample(
                    ids,
                    loss_mask=np.arange(15) >= 10,
                    advantages=np.ones(15, np.float32),
                    inference_logprobs=np.zeros(15, np.float32),
                )
                w.append(sample, group=g, shared_prefix=10)
    return RolloutDataset.from_step_dir(tmp_path / "steps")


def test_every_group_hash_claims_its_prefix(tmp_path) -> None:
    """The index holds a group's 64-bit hash as int64 bits: a hash with its top bit set (here
    "f", "g") is a group like any other, not the "no group" of a negative id."""
    groups = ["f", "g", "prompt-0"]
    assert [group_hash(g) >= 2**63 for g in groups] == [True, True, False]
    dataset = _group_step(tmp_path, groups)
    chains = dataset.shared_prefixes(0).chains
    assert all(len(c) == 1 for c in chains) and len(set(chains)) == 3
    config = LoaderConfig(plan=PlanConfig(seq_len=64))
    got = list(build_dataloader(dataset, Topology(dp_rank=0, dp_size=1), config, root=None))
    prompts = [{p for p in t.tree.parents if p >= 0} for t in got if t.tree is not None]
    assert sum(map(len, prompts)) == 3  # a tree a group, its prompt computed once


def test_a_token_its_index_claims_shared_but_differs_names_the_step_file(tmp_path) -> None:
    dataset = _group_step(tmp_path, ["g", "prompt-0"], differ_at=(4, 7))
    config = LoaderConfig(plan=PlanConfig(seq_len=64), shuffle=True, seed=1)
    loader = build_dataloader(dataset, Topology(dp_rank=0, dp_size=1), config, root=None)
    with pytest.raises(SharedPrefixError, match="planned to share") as err:
        list(loader)
    place = err.value.place
    assert (place["file"], place["step"], place["field"], place["pos"]) == (
        dataset.source.where(0),
        0,
        "token_ids",
        7,
    )
    # the samples by their numbers in the step file (the group's are 3, 4 and 5), whichever of
    # the two the micro batch holds first
    other = int(re.search(r"of sample (\d+)", err.value.message).group(1))
    assert 4 in (place["sample"], other) and {place["sample"], other} <= {3, 4, 5}
