"""Planning is a pure function of token counts; placement a pure function of one planned micro
batch's samples; what a plan records (CP size and layout) is read, never asked for again."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollfeed.collate import (
    BatchConfigError,
    LossRuns,
    OverlongError,
    PlanConfig,
    Sample,
    SampleLengthError,
    place_micro_batch,
    plan_lengths,
    prepare_batch,
    to_tensor_micro_batch,
)
from tests.collate.gen import inline_batch

SEQ_LEN = 48  # a multiple of 16, which is a multiple of every unit below (zigzag cp 4: 8)
GRID = list(
    itertools.product(
        ["truncate", "drop"],
        [1, 2, 3, 4, 5],  # dp_size
        [1, 2, 4],  # cp_size
        ["contiguous", "zigzag"],
        [None, 16],  # pad_to_multiple_of
    )
)


@pytest.mark.parametrize(("overlong", "dp", "cp", "layout", "pad"), GRID)
def test_plan_from_lengths_is_the_plan_prepare_batch_places(overlong, dp, cp, layout, pad):
    config = PlanConfig(
        seq_len=SEQ_LEN, cp_size=cp, cp_layout=layout, overlong=overlong, pad_to_multiple_of=pad
    )
    seen = dict(overlong=0, dummies=0, multi=0)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        n = 1 if seed == 0 else int(rng.integers(2, 24))  # one sample: short ranks get dummies
        samples = inline_batch(rng, n, SEQ_LEN if n == 1 else 2 * SEQ_LEN)
        # the counts as a loader has them: a step index's JSON ints, no sample in sight
        lengths = [int(n) for n in np.array([len(s) for s in samples]).tolist()]
        runs = LossRuns.of_samples(samples)
        runs = LossRuns(counts=runs.counts.tolist(), spans=runs.spans.ravel().tolist())
        planned = plan_lengths(lengths, config, dp_size=dp, loss_runs=runs)
        plan = prepare_batch(samples, config, dp_size=dp)
        assert [[mb.indices for mb in rank] for rank in plan] == planned
        assert planned.metrics == plan.metrics
        assert planned.loss.per_sample.tolist() == plan.loss.per_sample.tolist()
        bare = plan_lengths(lengths, config, dp_size=dp)  # without runs: no loss counts
        assert bare == planned and bare.loss is None
        assert {k: v for k, v in planned.metrics.items() if k in bare.metrics} == bare.metrics
        for rank in plan:
            for mb in rank:
                # the collator's view: the samples in packing order, nothing else
                alone = place_micro_batch([samples[i] for i in mb.indices], config)
                for name in ("starts", "cu_seqlens", "length", "config", "num_tokens"):
                    assert getattr(alone, name) == getattr(mb, name), name
                for a, b in zip(alone.samples, mb.samples, strict=True):
                    assert np.array_equal(a.token_ids, b.token_ids)
                assert mb.length % config.pad == 0 and mb.config is config
        # the metrics planned from counts describe the micro batches placed from samples
        placed = [mb for rank in plan for mb in rank]
        tokens = sum(mb.num_tokens for mb in placed)
        assert plan.metrics["tokens"] == tokens
        assert plan.metrics["padding_tokens"] == sum(mb.length for mb in placed) - tokens
        assert plan.metrics["dummy_micro_batches"] == sum(mb.is_dummy for mb in placed)
        assert {len(rank) for rank in plan} == {plan.metrics["micro_steps"]}
        seen["overlong"] += plan.metrics["truncated" if overlong == "truncate" else "dropped"]
        seen["dummies"] += plan.metrics["dummy_micro_batches"]
        seen["multi"] += any(len(mb.indices) > 1 for mb in placed)
    assert seen["overlong"] and seen["multi"]  # non-vacuity: truncation/dropping and packing
    if dp > 1:
        assert seen["dummies"]


def test_worked_example_of_plan_lengths():
    config = PlanConfig(seq_len=8)
    assert plan_lengths([5, 3, 6, 2], config, dp_size=2) == [[(2, 3)], [(0, 1)]]
    # FFD: 6 opens a bin, 5 a second, 3 joins the 5, 2 the 6; the heavier (6, 2) goes first
    assert plan_lengths(np.array([5, 3, 6, 2]), config, dp_size=1) == [[(2, 3), (0, 1)]]
    assert plan_lengths([], config, dp_size=2) == [[], []]
    assert plan_lengths([9, 3], PlanConfig(seq_len=8, overlong="drop"), dp_size=2) == [[(1,)], [()]]


def test_lengths_that_cannot_be_samples_are_typed_errors():
    config = PlanConfig(seq_len=8)
    with pytest.raises(SampleLengthError, match=r"at least one token, got 0.*sample=2"):
        plan_lengths([3, 4, 0], config, dp_size=1)
    with pytest.raises(SampleLengthError, match="integers"):
        plan_lengths([[3, 4]], config, dp_size=1)
    with pytest.raises(SampleLengthError, match="integers"):
        plan_lengths([3.5], config, dp_size=1)
    with pytest.raises(OverlongError, match=r"9 tokens > seq_len=8.*sample=1"):
        plan_lengths([3, 9], PlanConfig(seq_len=8, overlong="error"), dp_size=1)
    with pytest.raises(BatchConfigError, match="dp_size"):
        plan_lengths([3], config, dp_size=True)


def test_placement_refuses_a_sample_the_plan_would_not_keep():
    (sample,) = inline_batch(np.random.default_rng(0), 1, 2)
    long = Sample(
        np.arange(12),
        loss_mask=np.ones(12, bool),
        advantages=np.zeros(12),
        inference_logprobs=np.zeros(12),
    )
    assert place_micro_batch([long], PlanConfig(seq_len=8)).num_tokens == 8  # truncated
    for overlong in ("drop", "error"):
        with pytest.raises(OverlongError, match=r"12 tokens > seq_len=8.*sample=1"):
            place_micro_batch([sample, long], PlanConfig(seq_len=8, overlong=overlong))
    dummy = place_micro_batch([], PlanConfig(seq_len=8, cp_size=2, cp_layout="zigzag"))
    assert dummy.is_dummy and dummy.cu_seqlens == (0, 4) and dummy.length == 4


def _zigzag_cp2():
    samples = inline_batch(np.random.default_rng(4), 6, 16)
    config = PlanConfig(seq_len=32, cp_size=2, cp_layout="zigzag")
    return next(mb for mb in prepare_batch(samples, config, dp_size=1)[0] if len(mb.samples) > 1)


def test_cp_size_and_layout_are_read_from_the_micro_batch():
    mb = _zigzag_cp2()
    parts = [to_tensor_micro_batch(mb, cp_rank=r) for r in range(2)]
    assert all((t.cp_size, t.cp_layout) == (2, "zigzag") for t in parts)
    assert [len(t.positions) for t in parts] == [mb.length // 2] * 2
    # zigzag: rank 0 holds the first and the last chunk of every slot, not the row's first half
    assert parts[0].positions.tolist() != list(range(mb.length // 2))
    # there is no argument to read it as contiguous, or with another CP size
    for wrong in (dict(cp_layout="contiguous"), dict(cp_size=4), dict(cp_size=1)):
        with pytest.raises(TypeError, match="unexpected keyword"):
            to_tensor_micro_batch(mb, cp_rank=0, **wrong)
    with pytest.raises(TypeError, match="cp_rank"):
        to_tensor_micro_batch(mb)  # a forgotten rank is not rank 0


@pytest.mark.parametrize("cp_rank", [2, 3, -1, True, 1.0, None])
def test_a_cp_rank_outside_the_planned_cp_size_is_refused(cp_rank):
    with pytest.raises(
        BatchConfigError, match=r"cp_rank .* outside \[0, 2\).*cp_size=2 \(zigzag\)"
    ):
        to_tensor_micro_batch(_zigzag_cp2(), cp_rank=cp_rank)


def test_per_token_arrays_of_a_sample_are_keyword_only():
    T = 3
    ids, mask, zeros = np.arange(T), np.ones(T, bool), np.zeros(T, np.float32)
    with pytest.raises(TypeError, match="positional"):
        Sample(ids, mask, zeros, zeros)
    with pytest.raises(TypeError, match="positional"):
        Sample(ids, mask, advantages=zeros, inference_logprobs=zeros)
    s = Sample(ids, loss_mask=mask, advantages=zeros, inference_logprobs=zeros)
    assert len(s) == T and Sample.from_json(s.to_json()).loss_mask.tolist() == mask.tolist()
