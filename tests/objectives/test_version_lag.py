"""Policy versions in the objectives: on-policy data (every version the trained step) gives the
terms, gradients and metrics of the objective without versions bit for bit; stale tokens fall in
their lag bucket, and a per-lag weight scales their whole term (0: an exact 0)."""

from __future__ import annotations

import math

import pytest
import torch

from rollfeed.objectives import (
    MaskedIS,
    PPOClip,
    ScoreCentering,
    SequenceWeight,
    TruncatedIS,
    TrustRegion,
    Unweighted,
    VersionLag,
    finish_metrics,
    policy_loss,
)
from tests.objectives.cases import CU_SEQLENS, ROWS, make_case, scored

STEP = 7
BOUNDS = dict(positions=torch.arange(len(ROWS)), cu_seqlens=torch.tensor(CU_SEQLENS))
WEIGHTS = {
    "one": Unweighted(),
    "tis": TruncatedIS(cap=1.5),
    "mis": MaskedIS(low=0.5, high=2.0),
    "trust": TrustRegion(cap=2.0, eps=0.15),
}
FIELDS = ("loss", "policy", "centering", "weight", "sequence_weight")


def _terms(weight, clip, sequence, **lag):
    case = make_case(seed=11)
    out, kept = scored(case)
    terms = policy_loss(
        kept,
        out.logprobs,
        case["advantages"],
        weight=weight,
        clip=PPOClip(eps_low=clip) if clip is not None else None,
        sequence=sequence,
        centering=ScoreCentering(weight=weight, missing="skip"),
        **BOUNDS,
        **lag,
    )
    (grad,) = torch.autograd.grad(terms.loss.sum(), case["logits"])
    return terms, grad


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("sequence", [None, SequenceWeight(statistic="sum", cap=2.0)])
@pytest.mark.parametrize("lag_weights", [None, (1.0, 0.5, 0.0)])
def test_on_policy_versions_change_nothing(name, clip, sequence, lag_weights):
    weight = WEIGHTS[name]
    plain, plain_grad = _terms(weight, clip, sequence)
    versions = torch.full((len(ROWS),), STEP, dtype=torch.int32)
    lag = VersionLag(step=STEP, lags=2, weights=lag_weights)
    got, grad = _terms(weight, clip, sequence, versions=versions, lag=lag)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(plain, f)), f
    assert torch.equal(grad, plain_grad)
    want, have = finish_metrics(plain.metrics), finish_metrics(got.metrics)
    for key, value in want.items():
        if key == "not_computed":
            assert set(value) <= set(have[key])
        else:
            assert torch.equal(have[key], value), key
    loss_tokens = int(want["tokens"])
    assert int(have["lag0_tokens"]) == loss_tokens and int(have["lag_none_tokens"]) == 0
    assert int(have["lag1_tokens"]) == int(have["lag_older_tokens"]) == 0
    torch.testing.assert_close(have["lag0_k3"], want["k3"], rtol=0, atol=1e-12)


def test_stale_tokens_fall_in_their_bucket_and_their_weight_scales_the_whole_term():
    # rows by lag: 0, 1, 2 (older than lags=2), none (-1), a version ahead of the step
    pattern = [STEP, STEP - 1, STEP - 5, -1, STEP + 1]
    versions = torch.tensor([pattern[i % 5] for i in range(len(ROWS))], dtype=torch.int64)
    scale = {STEP: 1.0, STEP - 1: 0.5, STEP - 5: 0.0, -1: 1.0, STEP + 1: 1.0}
    weight = TruncatedIS(cap=math.inf)
    plain, plain_grad = _terms(weight, None, None)
    lag = VersionLag(step=STEP, lags=2, weights=(1.0, 0.5, 0.0))
    got, grad = _terms(weight, None, None, versions=versions, lag=lag)
    want = torch.tensor([scale[int(v)] for v in versions], dtype=torch.float64)
    torch.testing.assert_close(got.loss, want * plain.loss, rtol=1e-12, atol=1e-15)
    zero = want == 0
    assert torch.equal(got.loss[zero], torch.zeros(int(zero.sum()), dtype=got.loss.dtype))
    have = finish_metrics(got.metrics)
    loss = torch.tensor([r[2] for r in ROWS])
    for bucket, v in (("lag0", STEP), ("lag1", STEP - 1), ("lag_older", STEP - 5)):
        assert int(have[f"{bucket}_tokens"]) == int((loss & (versions == v)).sum()), bucket
    none = loss & ((versions < 0) | (versions > STEP))
    assert int(have["lag_none_tokens"]) == int(none.sum()) > 0
    assert not torch.equal(grad, plain_grad)  # the weights took part in the gradient
