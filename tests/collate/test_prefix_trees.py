"""The tree planner: prefix chains -> trees (split to fit, kept where they save enough), balanced
over DP by the tokens they compute, deterministic, and off when asked."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollfeed.collate import (
    BatchConfigError,
    PlanConfig,
    SharedPrefixError,
    SharedPrefixes,
    plan_lengths,
)
from rollfeed.collate.image_runs import ImageRuns
from rollfeed.collate.prefix_trees import plan_units


def _random_chains(rng, n_groups: int, seq_len: int):
    """GRPO groups and two-level conversations with random lengths (some over seq_len)."""
    lengths, chains = [], []
    for g in range(n_groups):
        prompt = int(rng.integers(seq_len // 4, seq_len))
        size = int(rng.integers(1, 9))
        nested = rng.random() < 0.4
        turns = rng.integers(1, 12, 2).tolist()
        for j in range(size):
            chain = [((g, "p"), prompt)]
            at = prompt
            if nested:
                turn = turns[j % 2]
                chain.append(((g, "t", j % 2), prompt + turn))
                at += turn
            chains.append(tuple(chain))
            lengths.append(at + int(rng.integers(1, seq_len // 2)))
    return np.array(lengths), SharedPrefixes(chains=tuple(chains))


def _tree_tokens_of_plan(plan) -> int:
    return sum(t.tokens for r in plan.trees for mb in r for _, t in mb)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cp", [(1, "contiguous"), (2, "zigzag")])
def test_every_kept_sample_once_and_rows_fit(seed: int, cp) -> None:
    rng = np.random.default_rng(seed)
    seq_len = 64
    lengths, prefixes = _random_chains(rng, 6, seq_len)
    config = PlanConfig(seq_len=seq_len, cp_size=cp[0], cp_layout=cp[1], tree_min_saving=0.1)
    plan = plan_lengths(lengths, config, dp_size=2, prefixes=prefixes)
    seen = sorted(i for r in plan for mb in r for i in mb)
    assert seen == list(range(len(lengths)))  # truncate keeps every sample
    cuts = np.minimum(lengths, seq_len)
    for rank, rank_trees in zip(plan, plan.trees, strict=True):
        for mb, trees in zip(rank, rank_trees, strict=True):
            in_tree = set()
            row = 0
            for first, tree in trees:
                members = mb[first : first + tree.members]
                in_tree.update(members)
                # leaves end at the member's cut, spans continue their parent
                for span in tree.spans:
                    parent_end = 0 if span.parent < 0 else tree.spans[span.parent].end
                    assert span.start == parent_end < span.end
                    if span.sample >= 0:
                        assert span.end == cuts[members[span.sample]]
                flat = sum(int(cuts[i]) for i in members)
                assert flat - tree.tokens >= 0.1 * flat  # saves what it must
                slot = (
                    -(-tree.tokens // config.pad) * config.pad if cp[1] == "zigzag" else tree.tokens
                )
                row += slot
            row += sum(
                -(-int(cuts[i]) // (2 * cp[0])) * (2 * cp[0]) if cp[1] == "zigzag" else int(cuts[i])
                for i in mb
                if i not in in_tree
            )
            assert row <= seq_len
    assert plan.metrics["tokens"] == int(cuts.sum()) - plan.metrics["shared_tokens_saved"]
    assert plan.metrics["shared_tokens_saved"] > 0
    again = plan_lengths(lengths, config, dp_size=2, prefixes=prefixes)
    assert list(again) == list(plan) and again.trees == plan.trees  # deterministic


def test_group_of_eight_is_one_tree_and_saves_the_prompt() -> None:
    lengths = [2048 + 512] * 8
    prefixes = SharedPrefixes.of_groups([3] * 8, [2048] * 8)
    plan = plan_lengths(lengths, PlanConfig(seq_len=8192), dp_size=1, prefixes=prefixes)
    assert len(plan[0]) == 1
    ((first, tree),) = plan.trees[0][0]
    assert first == 0 and tree.tokens == 2048 + 8 * 512
    assert plan.metrics["tokens"] == 6144 and plan.metrics["shared_tokens_saved"] == 7 * 2048
    assert plan.metrics["trees"] == 1 and plan.metrics["tree_samples"] == 8


def test_tree_longer_than_seq_len_splits_into_pieces_repeating_the_prompt() -> None:
    # prompt 40 + 8 completions of 10 = 120 tokens > 64: pieces of prompt + 2 completions
    lengths = [50] * 8
    prefixes = SharedPrefixes.of_groups([0] * 8, [40] * 8)
    plan = plan_lengths(lengths, PlanConfig(seq_len=64), dp_size=1, prefixes=prefixes)
    pieces = [t for r in plan.trees for mb in r for _, t in mb]
    assert len(pieces) == 4 and all(t.tokens == 60 and t.members == 2 for t in pieces)
    assert sorted(i for r in plan for mb in r for i in mb) == list(range(8))


def test_trees_below_the_minimum_saving_stay_flat_and_the_option_turns_trees_off() -> None:
    # a 4-token prompt shared by two 100-token samples saves 4 of 200 tokens: 2%
    lengths, prefixes = [100, 100], SharedPrefixes.of_groups([0, 0], [4, 4])
    config = PlanConfig(seq_len=256)
    assert plan_lengths(lengths, config, dp_size=1, prefixes=prefixes).trees == [[()]]
    low = PlanConfig(seq_len=256, tree_min_saving=0.01)
    assert plan_lengths(lengths, low, dp_size=1, prefixes=prefixes).metrics["trees"] == 1
    off = PlanConfig(seq_len=256, trees=False, tree_min_saving=0.01)
    plan = plan_lengths(
        [40, 40], off, dp_size=1, prefixes=SharedPrefixes.of_groups([0, 0], [30, 30])
    )
    flat = plan_lengths([40, 40], off, dp_size=1)
    assert plan.trees == [[()]] and list(plan) == list(flat) and plan.metrics == flat.metrics


def test_plan_without_prefixes_is_unchanged() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 100, 50)
    for layout in ("contiguous", "zigzag"):
        config = PlanConfig(seq_len=128, cp_size=2, cp_layout=layout)
        none = SharedPrefixes(chains=((),) * 50)
        a = plan_lengths(lengths, config, dp_size=3)
        b = plan_lengths(lengths, config, dp_size=3, prefixes=none)
        assert list(a) == list(b)
        assert {k: v for k, v in b.metrics.items() if k in a.metrics} == a.metrics


def test_dp_balance_counts_the_tokens_a_tree_computes() -> None:
    # Two groups of 8 x (prompt 100 + 20) and 8 flat samples of 120: by flat tokens the groups
    # weigh 960 each, by computed tokens 260; two ranks then split 2 x 260 + 8 x 120 evenly.
    lengths = [120] * 24
    groups = [0] * 8 + [1] * 8 + [-1] * 8
    prefixes = SharedPrefixes.of_groups(groups, [100] * 16 + [0] * 8)
    plan = plan_lengths(lengths, PlanConfig(seq_len=512), dp_size=2, prefixes=prefixes)
    per_rank = []
    for rank, trees in zip(plan, plan.trees, strict=True):
        tokens = 0
        for mb, mb_trees in zip(rank, trees, strict=True):
            in_tree = sum(t.members for _, t in mb_trees)
            tokens += sum(t.tokens for _, t in mb_trees) + 120 * (len(mb) - in_tree)
        per_rank.append(tokens)
    assert sum(per_rank) == 2 * 260 + 8 * 120
    assert max(per_rank) - min(per_rank) <= 120


def test_a_truncated_sample_keeps_its_cut_and_a_cut_inside_the_prefix_leaves_the_tree() -> None:
    # seq_len 64. Group 0 (prompt 20): samples of 30 and 28 tokens share it; sample 2 is cut at
    # 64, and a tree holding a whole row's worth of its own tokens plus another branch cannot fit,
    # so it is planned flat, cut. Group 1's prompt (70) is longer than the cut: nothing to share.
    chains = (((0, 20),),) * 3 + (((1, 70),), ((1, 70),))
    prefixes = SharedPrefixes(chains=chains)
    plan = plan_lengths([30, 28, 90, 80, 75], PlanConfig(seq_len=64), dp_size=1, prefixes=prefixes)
    trees = [
        (mb, t)
        for r, rt in zip(plan, plan.trees, strict=True)
        for mb, ts in zip(r, rt, strict=True)
        for _, t in ts
    ]
    ((mb, tree),) = trees
    assert tree.members == 2 and tree.tokens == 20 + 10 + 8
    assert sorted(mb[:2]) == [0, 1]
    assert plan.metrics["truncated"] == 3 and plan.metrics["tree_samples"] == 2
    units = plan_units(np.array([30, 28, 64]), chains[:3], seq_len=128, min_saving=0.2)
    assert [s.end for s in units[0].tree.spans if s.sample >= 0] == [30, 28, 64]


def test_nested_chains_make_a_tree_of_depth_three() -> None:
    # a 3-turn conversation with 2 branches per turn: 8 samples
    chains, lengths = [], []
    for a, b, _ in itertools.product(range(2), repeat=3):
        chains.append((("r", 10), (("t1", a), 15), (("t2", a, b), 20)))
        lengths.append(25)
    units = plan_units(
        np.array(lengths), SharedPrefixes(chains=tuple(chains)).chains, seq_len=256, min_saving=0.2
    )
    (unit,) = units
    assert unit.members == tuple(range(8))
    depth = {}
    for k, s in enumerate(unit.tree.spans):
        depth[k] = 0 if s.parent < 0 else depth[s.parent] + 1
    assert max(depth.values()) == 3
    assert unit.tokens == 10 + 2 * 5 + 4 * 5 + 8 * 5


def test_of_tokens_finds_the_nested_prefixes() -> None:
    base = [1, 2, 3]
    toks = [[*base, 4, 5, 6], [*base, 4, 5, 7], [*base, 8, 9], [*base, 8, 10], [1, 2]]
    prefixes = SharedPrefixes.of_tokens(toks, ["g"] * 4 + [None])
    lengths = [[n for _, n in c] for c in prefixes.chains]
    assert lengths == [[3, 5], [3, 5], [3, 4], [3, 4], []]
    assert prefixes.chains[0][1][0] != prefixes.chains[2][1][0]


@pytest.mark.parametrize(
    ("chains", "match"),
    [
        ((((0, 5),), ((0, 6),)), "claims 5 tokens"),
        ((((0, 5), (1, 3)),), "must increase"),
        ((((0, 0),),), "must increase"),
        ((((None, 3),),), "hashable"),
        ((((0, 2.5),),), "must be an int"),
        ((((0, 3), (1, 5)), ((2, 3), (1, 5))), "after"),
    ],
)
def test_contradicting_prefix_keys_are_refused(chains, match) -> None:
    with pytest.raises(SharedPrefixError, match=match):
        SharedPrefixes(chains=chains)


def test_prefixes_must_fit_the_samples_and_images_do_not_share() -> None:
    config = PlanConfig(seq_len=64)
    with pytest.raises(SharedPrefixError, match="one chain per sample"):
        plan_lengths([5, 5], config, dp_size=1, prefixes=SharedPrefixes.of_groups([0], [2]))
    images = ImageRuns(counts=np.array([1, 0]), spans=np.array([[1, 3]]))
    with pytest.raises(SharedPrefixError, match="images") as err:
        plan_lengths(
            [5, 5],
            config,
            dp_size=1,
            image_runs=images,
            prefixes=SharedPrefixes.of_groups([0, 0], [3, 3]),
        )
    assert err.value.sample == 0
    with pytest.raises(BatchConfigError, match="tree_min_saving"):
        PlanConfig(seq_len=8, tree_min_saving=1.5)


def test_samples_with_images_are_packed_apart_from_trees() -> None:
    # samples 0-2 share a prompt; sample 3 has an image; 4 is plain text
    images = ImageRuns(counts=np.array([0, 0, 0, 1, 0]), spans=np.array([[1, 3]]))
    prefixes = SharedPrefixes.of_groups([0, 0, 0, -1, -1], [10, 10, 10, 0, 0])
    plan = plan_lengths(
        [12, 12, 12, 6, 4], PlanConfig(seq_len=64), dp_size=1, image_runs=images, prefixes=prefixes
    )
    for mb, trees in zip(plan[0], plan.trees[0], strict=True):
        assert not (trees and 3 in mb)
    assert plan.metrics["trees"] == 1


def test_of_groups_takes_the_step_index_columns() -> None:
    prefixes = SharedPrefixes.of_groups(["p7", "p7", None, "p9", "p7"], [4, 4, 3, 5, 6])
    assert [len(c) for c in prefixes.chains] == [1, 1, 0, 1, 1]
    # the same group claiming another length shares nothing with the first two
    assert prefixes.chains[0] == prefixes.chains[1] != prefixes.chains[4]
    assert SharedPrefixes.of_groups(np.array([2, -1]), np.array([3, 3])).chains[1] == ()
    with pytest.raises(SharedPrefixError, match="one per sample"):
        SharedPrefixes.of_groups([1, 2], [3])
    with pytest.raises(SharedPrefixError, match=">= 0"):
        SharedPrefixes.of_groups([1], [-2])


@pytest.mark.parametrize(("prompt", "tree"), [(20, True), (19, False)])
def test_the_default_minimum_saving_is_a_fifth_of_the_flat_tokens(prompt: int, tree: bool) -> None:
    # two samples of 50 sharing `prompt` tokens: the tree saves prompt / 100 of them
    prefixes = SharedPrefixes.of_groups([0, 0], [prompt, prompt])
    plan = plan_lengths([50, 50], PlanConfig(seq_len=128), dp_size=1, prefixes=prefixes)
    assert plan.metrics["trees"] == int(tree)
    assert plan.metrics["shared_tokens_saved"] == (prompt if tree else 0)


def test_a_cut_at_the_end_of_a_shared_turn_branches_above_it() -> None:
    # a prompt (10) and a turn (to 20) shared by three samples; sample 2 is cut at 20, the end
    # of the turn: it shares the prompt only and keeps the turn's tokens as its own branch
    chains = ((("p", 10), (("t",), 20)),) * 3
    units = plan_units(np.array([30, 26, 20]), chains, seq_len=128, min_saving=0.0)
    (unit,) = units
    spans = unit.tree.spans
    own = {unit.members[s.sample]: (s.parent, s.start, s.end) for s in spans if s.sample >= 0}
    turn = next(k for k, s in enumerate(spans) if s.sample < 0 and s.end == 20)
    assert spans[turn].parent == 0 and (spans[0].start, spans[0].end) == (0, 10)
    assert own == {0: (turn, 20, 30), 1: (turn, 20, 26), 2: (0, 10, 20)}
    assert unit.tokens == 10 + 10 + 10 + 6 + 10
