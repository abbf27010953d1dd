"""Step counts: every micro batch carries its step's loss-token counts, equal to a brute-force
count of what ends up True in ``loss_mask`` over every micro batch of every (dp, cp) rank, exact
after truncation and the label shift; dummies carry them too; loss runs are held to the samples."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from rollfeed.collate import (
    LossRuns,
    PlanConfig,
    SampleLengthError,
    SampleValueError,
    place_micro_batch,
    plan_lengths,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.collate.loss_runs import mask_runs
from tests.collate.loss_samples import samples_for


def brute_force(plan, cp_size: int):
    """``(per-sample loss tokens, micro batches without loss, tensors)`` counted from the built
    micro batches: each token of each (dp, cp) rank's ``loss_mask`` assigned to its sample."""
    per_sample: dict[int, int] = {}
    empty, tensors = 0, []
    for rank in plan:
        for mb in rank:
            row = 0
            for cp in range(cp_size):
                tmb = to_tensor_micro_batch(mb, cp_rank=cp)
                tensors.append(tmb)
                cu = tmb.cu_seqlens.long()
                slot = torch.searchsorted(cu, tmb.positions, right=True) - 1
                for s in slot[tmb.loss_mask].tolist():
                    per_sample[mb.indices[s]] = per_sample.get(mb.indices[s], 0) + 1
                row += int(tmb.loss_mask.sum())
            empty += row == 0
            for i in mb.indices:
                per_sample.setdefault(i, 0)
    return per_sample, empty, tensors


GRID = list(
    itertools.product([1, 2, 3], [1, 2], ["contiguous", "zigzag"], [8, 16], ["truncate", "drop"])
)


@pytest.mark.parametrize(("dp", "cp", "layout", "seq_len", "overlong"), GRID)
def test_counts_equal_a_brute_force_count_over_the_built_micro_batches(
    dp, cp, layout, seq_len, overlong
):
    config = PlanConfig(seq_len=seq_len, cp_size=cp, cp_layout=layout, overlong=overlong)
    seen = dict(truncated=0, dummies=0, lossless=0)
    for seed in range(3):
        # seed 0: one sample that fits, so that short ranks get dummies
        samples = samples_for(seed, 9, seq_len) if seed else samples_for(0, 1, seq_len, seq_len)
        plan = prepare_batch(samples, config, dp_size=dp)
        per_sample, empty, tensors = brute_force(plan, cp)
        total = sum(per_sample.values())
        with_loss = sum(v > 0 for v in per_sample.values())
        for tmb in tensors:  # every micro batch, every cp rank, dummies too
            c = tmb.step_counts
            assert (c.loss_tokens, c.samples, c.samples_with_loss) == (
                total,
                len(per_sample),
                with_loss,
            )
            assert c.sample_loss_tokens.dtype == torch.int64
            assert c.sample_loss_tokens.numel() == tmb.num_samples
        for rank in plan:
            for mb in rank:
                want = [per_sample[i] for i in mb.indices]
                assert mb.step_counts.sample_loss_tokens.tolist() == want
        m = plan.metrics
        assert m["loss_tokens"] == total and m["samples_with_loss"] == with_loss
        assert m["samples_without_loss"] == len(per_sample) - with_loss
        assert m["micro_batches_without_loss"] == empty
        seen["truncated"] += m["truncated"]
        seen["dummies"] += m["dummy_micro_batches"]
        seen["lossless"] += m["samples_without_loss"]
    assert seen["lossless"] and (overlong == "drop" or seen["truncated"])
    assert dp == 1 or seen["dummies"]  # the one-sample step gives dummies


def test_loss_runs_of_masks_and_their_label_tokens_worked_example():
    runs = LossRuns.of_masks([np.array([1, 1, 0, 1, 1, 1], bool), np.zeros(2, bool)])
    assert runs.counts.tolist() == [2, 0] and runs.spans.tolist() == [[0, 2], [3, 6]]
    assert runs.label_tokens([6, 2], 4).tolist() == [2, 0]  # the module doc's example
    assert runs.take([1, 0]).spans.tolist() == [[0, 2], [3, 6]]
    assert runs.take([1, 0]).counts.tolist() == [0, 2]
    rng = np.random.default_rng(0)
    for _ in range(200):  # mask_runs against a loop over the mask
        mask = rng.random(int(rng.integers(1, 12))) < 0.5
        back = np.zeros(len(mask), bool)
        for a, b in mask_runs(mask).tolist():
            assert a < b and back[a:b].sum() == 0 and (a == 0 or not mask[a - 1])
            back[a:b] = True
        assert np.array_equal(back, mask)


def test_runs_that_are_not_the_samples_are_refused():
    lengths = [4, 3]
    for counts, spans in (
        ([1, 1], [[0, 5], [0, 1]]),  # past the sample's end
        ([2, 0], [[2, 3], [0, 1]]),  # out of token order
        ([2, 0], [[0, 2], [2, 3]]),  # touching: not maximal (one run)
        ([1, 1], [[1, 1], [0, 1]]),  # empty
    ):
        with pytest.raises(SampleLengthError, match="loss runs of sample 0"):
            plan_lengths(
                lengths,
                PlanConfig(seq_len=8),
                dp_size=1,
                loss_runs=LossRuns(counts=counts, spans=spans),
            )
    with pytest.raises(SampleLengthError, match="one per sample"):
        plan_lengths(lengths, PlanConfig(seq_len=8), dp_size=1, loss_runs=LossRuns.of_masks([]))


def test_a_micro_batch_is_held_to_the_counts_it_was_planned_with():
    samples = samples_for(4, 6, 8)
    plan = prepare_batch(samples, PlanConfig(seq_len=8), dp_size=1)
    mb = next(m for m in plan[0] if m.step_counts.sample_loss_tokens.sum() > 0)
    counts = mb.step_counts
    wrong = dataclasses.replace(counts, sample_loss_tokens=counts.sample_loss_tokens + 1)
    picked = [samples[i] for i in mb.indices]
    with pytest.raises(SampleValueError, match="loss tokens") as err:
        place_micro_batch(picked, mb.config, indices=mb.indices, step_counts=wrong)
    assert err.value.field == "loss_mask" and err.value.sample == mb.indices[0]
    again = place_micro_batch(picked, mb.config, indices=mb.indices, step_counts=counts)
    assert again.step_counts == counts
