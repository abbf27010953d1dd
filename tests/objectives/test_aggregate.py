"""aggregate: each micro batch's share of the step's loss; the shares of every (dp, cp) rank and
micro batch add up to the loss of the whole step computed in one process, for every mode, after
truncation; typed errors for an unknown mode and a micro batch without counts."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
from rollfeed.objectives import (
    AGGREGATIONS,
    ObjectiveInputError,
    ObjectiveMissingInputError,
    aggregate,
)
from tests.collate.loss_samples import samples_for


def term(sample: int, token: int) -> float:
    """The loss term of token ``token`` of sample ``sample`` (any value that tells them apart)."""
    return math.sin(1.7 * sample + 0.3 * token) + 0.1 * token


def reference(samples: list[Sample], config: PlanConfig, mode: str) -> float:
    """The step's loss in one process, straight from the samples: truncate, label-shift, reduce."""
    sums, counts = [], []
    for i, s in enumerate(samples):
        if len(s) > config.seq_len and config.overlong == "drop":
            continue
        mask = s.loss_mask[: config.seq_len]
        tokens = [t for t in range(1, len(mask)) if mask[t]]  # token 0 is never a label
        sums.append(sum(term(i, t) for t in tokens))
        counts.append(len(tokens))
    total, seqs = sum(counts), sum(c > 0 for c in counts)
    if mode == "token_mean":
        return sum(sums) / max(total, 1)
    if mode == "seq_mean_token_sum":
        return sum(sums) / max(seqs, 1)
    return sum(s / c for s, c in zip(sums, counts, strict=True) if c) / max(seqs, 1)


def terms_of(tmb, indices) -> torch.Tensor:
    """``[N]`` float64: each of this rank's positions' term (label coordinates: position ``j`` of
    a sample predicts its token ``j + 1``); NaN off the loss tokens, which count for nothing."""
    cu = tmb.cu_seqlens.long()
    slot = (torch.searchsorted(cu, tmb.positions, right=True) - 1).tolist()
    out = torch.full((tmb.positions.numel(),), math.nan, dtype=torch.float64)
    for n, (p, s) in enumerate(zip(tmb.positions.tolist(), slot, strict=True)):
        if tmb.loss_mask[n]:
            out[n] = term(indices[s], p - int(cu[s]) + 1)
    return out


GRID = list(itertools.product([1, 2, 3], [1, 2], ["contiguous", "zigzag"], ["truncate", "drop"]))


@pytest.mark.parametrize(("dp", "cp", "layout", "overlong"), GRID)
def test_shares_add_up_to_the_single_process_loss_of_the_step(dp, cp, layout, overlong):
    config = PlanConfig(seq_len=16, cp_size=cp, cp_layout=layout, overlong=overlong)
    for seed in range(2):
        samples = samples_for(seed + 40, 10, 16)
        plan = prepare_batch(samples, config, dp_size=dp)
        tmbs = [
            (to_tensor_micro_batch(mb, cp_rank=r), mb.indices)
            for rank in plan
            for mb in rank
            for r in range(cp)
        ]
        assert plan.metrics["truncated"] or plan.metrics["dropped"]
        for mode in AGGREGATIONS:
            shares = []
            for tmb, idx in tmbs:
                terms = terms_of(tmb, idx).requires_grad_()
                share = aggregate(terms, tmb, mode=mode)
                share.backward()
                assert torch.isfinite(terms.grad).all()  # NaN off the loss tokens: no effect
                assert not terms.grad[~tmb.loss_mask].any()
                shares.append(share.item())
            want = reference(samples, config, mode)
            assert math.fsum(shares) == pytest.approx(want, abs=1e-12, rel=1e-12), mode


def _two_samples():
    """The module doc's example: loss terms ``[1, 2, 3]`` and ``[4]``, one per dp rank."""
    a = Sample(
        np.arange(4), loss_mask=[0, 1, 1, 1], advantages=[0.0] * 4, inference_logprobs=[0.0] * 4
    )
    b = Sample(np.arange(2), loss_mask=[0, 1], advantages=[0.0] * 2, inference_logprobs=[0.0] * 2)
    plan = prepare_batch([a, b], PlanConfig(seq_len=8), dp_size=2)
    out = []
    for rank in plan:
        (mb,) = rank
        tmb = to_tensor_micro_batch(mb, cp_rank=0)
        values = [1.0, 2.0, 3.0] if mb.indices == (0,) else [4.0]
        terms = torch.zeros(tmb.loss_mask.numel(), dtype=torch.float64)
        terms[tmb.loss_mask] = torch.tensor(values, dtype=torch.float64)
        out.append((terms, tmb))
    return out


def test_worked_example_of_the_module_doc():
    parts = _two_samples()
    got = {m: sum(aggregate(t, mb, mode=m).item() for t, mb in parts) for m in AGGREGATIONS}
    assert got == pytest.approx(
        {"token_mean": 2.5, "seq_mean_token_mean": 3.0, "seq_mean_token_sum": 5.0}
    )


def test_a_step_without_loss_tokens_gives_zero_and_no_gradient():
    s = Sample(
        np.arange(5), loss_mask=[1, 0, 0, 0, 0], advantages=[0.0] * 5, inference_logprobs=[0.0] * 5
    )
    (mb,) = prepare_batch([s], PlanConfig(seq_len=8), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    assert tmb.step_counts.loss_tokens == 0 and tmb.step_counts.samples_with_loss == 0
    for mode in AGGREGATIONS:
        terms = torch.randn(tmb.loss_mask.numel(), dtype=torch.float64, requires_grad=True)
        share = aggregate(terms, tmb, mode=mode)
        share.backward()
        assert share.item() == 0.0 and not terms.grad.any()


def test_unknown_mode_missing_counts_and_bad_terms_are_typed_errors():
    terms, mb = _two_samples()[0]
    with pytest.raises(ObjectiveInputError, match="token_mean"):
        aggregate(terms, mb, mode="seq-mean-token-mean")
    with pytest.raises(ObjectiveMissingInputError, match="step counts") as err:
        aggregate(terms, dataclasses.replace(mb, step_counts=None))
    assert err.value.tensor == "step_counts"
    with pytest.raises(ObjectiveInputError, match="terms_loss") as err:
        aggregate(terms[:-1], mb)
    assert err.value.tensor == "terms_loss"
