"""A token with zero weight adds exactly nothing, whatever its ratio; a token without a sampler
logprob leaves the loss, counted; an unbounded weight that overflows is refused, typed."""

from __future__ import annotations

import math

import pytest
import torch

from rollfeed.objectives import (
    MaskedIS,
    NoSamplerLogprobError,
    ObjectiveOverflowError,
    PPOClip,
    ScoreCentering,
    TrustRegion,
    Unweighted,
    finish_metrics,
    policy_loss,
)
from tests.objectives.rows import Row, batch, kept_of

NORMAL = [Row(lp=-0.5, lq=-0.6, adv=1.0), Row(lp=-1.2, lq=-1.1, adv=-0.5, width=4)]


def _run(b, loss_mask=None, kept_options=None, **options):  # type: ignore[no-untyped-def]
    _, kept, lp = kept_of(b, loss_mask, **(kept_options or {}))
    terms = policy_loss(kept, lp, b.advantages, **options)
    coef = torch.linspace(0.5, 1.5, len(b.rows), dtype=b.z.dtype)
    grads = torch.autograd.grad((coef * terms.loss).sum(), (b.z, b.extra), allow_unused=True)
    leaves = (b.z, b.extra)
    return terms, [
        torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True)
    ]


def _rows_of(b, j: int) -> slice:  # type: ignore[no-untyped-def]
    off = b.support.offsets
    return slice(int(off[j]), int(off[j + 1]))


@pytest.mark.parametrize(
    ("weight", "clip", "dtype", "lq"),
    [
        # float32: a valid label mask logprob of -100 makes r = e^99.5, inf in float32
        (MaskedIS(low=0.5, high=2.0), PPOClip(), torch.float32, -100.0),
        (MaskedIS(low=0.5, high=2.0), None, torch.float32, -100.0),
        (MaskedIS(low=0.5, high=2.0), PPOClip(), torch.float64, -9990.0),
        (TrustRegion(eps=0.2, cap=2.0), PPOClip(), torch.float64, -9990.0),
        (TrustRegion(eps=0.2), None, torch.float32, -9990.0),
    ],
)
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_masked_token_adds_exactly_nothing_whatever_its_ratio(weight, clip, dtype, lq, adv):
    rows = [*NORMAL, Row(lp=-0.5, lq=lq, adv=adv)]
    terms, (gz, _) = _run(batch(rows, dtype), weight=weight, clip=clip)
    assert torch.isfinite(terms.loss).all() and torch.isfinite(gz).all()
    assert terms.policy[2] == 0 and terms.weight[2] == 0
    b = batch(rows, dtype)
    assert (gz[_rows_of(b, 2)] == 0).all()
    # The same batch with the token out of the loss mask: the same terms and gradients.
    out, (gz_out, _) = _run(b, torch.tensor([True, True, False]), weight=weight, clip=clip)
    assert torch.equal(out.loss, terms.loss) and torch.equal(gz_out, gz)
    assert int(terms.metrics["masked"]) == 1


@pytest.mark.parametrize("label", [-9999.0, -1e5, -math.inf, None])  # None: no mask logprobs
@pytest.mark.parametrize("inference", [-9999.0, -math.inf])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_token_without_a_sampler_logprob_leaves_the_loss_counted(label, inference, adv):
    # The trainer's label logprob is 0: as a ratio against -9999 it would be e^9999.
    bad = Row(lp=0.0, lq=-0.5, lq_label=label, mask=label is not None, inference=inference, adv=adv)
    rows = [*NORMAL, bad]
    options = dict(clip=PPOClip(), centering=ScoreCentering(weight=Unweighted(), missing="skip"))
    terms, (gz, _) = _run(batch(rows), **options)
    assert torch.isfinite(terms.loss).all() and torch.isfinite(gz).all()
    assert terms.loss[2] == 0 and terms.centering[2] == 0
    assert (gz[_rows_of(batch(rows), 2)] == 0).all()
    assert int(terms.metrics["no_sampler_logprob"]) == 1 and int(terms.metrics["tokens"]) == 2
    out, (gz_out, _) = _run(batch(rows), torch.tensor([True, True, False]), **options)
    assert torch.equal(out.loss, terms.loss) and torch.equal(gz_out, gz)
    got, want = finish_metrics(terms.metrics), finish_metrics(out.metrics)
    assert got.pop("no_sampler_logprob") == 1 and want.pop("no_sampler_logprob") == 0
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert value == got[key] if isinstance(value, tuple) else torch.equal(value, got[key])
    with pytest.raises(NoSamplerLogprobError, match="no_sampler_logprob='drop'") as err:
        _run(batch(rows), kept_options=dict(no_sampler_logprob="error"), **options)
    assert err.value.pos == 2 and err.value.tensor == "inference_logprobs"


def test_the_label_slot_or_inference_logprob_alone_is_a_sampler_logprob():
    rows = [
        Row(lp=-0.5, lq=-0.4, inference=-9999.0),  # the label's mask slot holds it
        Row(lp=-0.5, lq=-0.4, lq_label=-9999.0, inference=-0.4),  # inference_logprobs holds it
    ]
    terms, _ = _run(batch(rows), clip=PPOClip(), kept_options=dict(no_sampler_logprob="error"))
    assert int(terms.metrics["no_sampler_logprob"]) == 0 and (terms.loss != 0).all()


@pytest.mark.parametrize(
    ("weight", "clip", "dtype", "log_r"),
    [
        (Unweighted(), PPOClip(), torch.float32, 100.0),  # e^100 > float32 max
        (MaskedIS(), None, torch.float32, 100.0),  # w = r unbounded
        (Unweighted(), PPOClip(), torch.float64, 800.0),
    ],
)
def test_an_unbounded_weight_past_the_dtype_is_refused(weight, clip, dtype, log_r):
    rows = [*NORMAL, Row(lp=-0.1, lq=-0.1 - log_r, adv=-1.0)]
    with pytest.raises(ObjectiveOverflowError) as err:
        _run(batch(rows, dtype), weight=weight, clip=clip)
    assert err.value.pos == 2
    # One dtype up, the same term fits and is the formula's: -A·r (clip) or -A·r·log p.
    if dtype == torch.float32:
        terms, (gz, _) = _run(batch(rows, torch.float64), weight=weight, clip=clip)
        want = math.exp(log_r) * (1.0 if clip else -0.1)
        assert terms.policy[2].item() == pytest.approx(want, rel=1e-9)
        assert torch.isfinite(gz).all()
