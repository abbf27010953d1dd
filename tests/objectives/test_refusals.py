"""What no objective can use exactly is a typed error naming the tensor and the position: a NaN
where a logprob should be, positions outside the micro batch, and the inputs score centering
needs but did not get (named with how to write them)."""

from __future__ import annotations

import math

import pytest
import torch

from rollfeed.objectives import (
    ObjectiveInputError,
    ObjectiveMissingInputError,
    PPOClip,
    ScoreCentering,
    SequenceWeight,
    TruncatedIS,
    finish_metrics,
    policy_loss,
)
from tests.objectives.rows import Row, batch, kept_of

NAN = float("nan")
ROWS = [Row(lp=-0.5, lq=-0.6), Row(lp=-1.0, lq=-0.9, adv=-1.0), Row(lp=-0.3, lq=-0.2)]


def _loss(b, **options):  # type: ignore[no-untyped-def]
    _, kept, lp = kept_of(b)
    return policy_loss(kept, lp, b.advantages, **options)


@pytest.mark.parametrize(
    ("row", "tensor"),
    [
        # the label's mask slot and its inference logprob both NaN: once a silent NaN loss
        (Row(lq_label=NAN, inference=NAN), "mask_logprobs"),
        (Row(lq_label=-math.inf, inference=NAN), "inference_logprobs"),
        (Row(lq_label=math.inf), "mask_logprobs"),
    ],
)
def test_a_nan_sampler_logprob_is_refused_naming_its_row(row, tensor):
    with pytest.raises(ObjectiveInputError, match=r"not a logprob|where a logprob should be") as e:
        _loss(batch([*ROWS[:1], row, *ROWS[1:]]), clip=PPOClip())
    assert (e.value.tensor, e.value.pos) == (tensor, 1)


def test_a_nan_off_the_loss_is_no_logprob_the_loss_reads():
    rows = [*ROWS, Row(loss=False, lq=-0.5, mask=False, inference=NAN)]
    assert torch.isfinite(_loss(batch(rows), clip=PPOClip()).loss).all()


def test_a_nan_trainer_logprob_or_advantage_is_refused_naming_its_token():
    b = batch(ROWS)
    kept_lp, kept, lp = kept_of(b)
    for name, lp_in, adv in (
        ("logprobs", torch.where(torch.arange(3) == 2, NAN, lp), b.advantages),
        ("advantages", lp, torch.tensor([1.0, math.inf, 0.5], dtype=torch.float64)),
    ):
        with pytest.raises(ObjectiveInputError) as err:
            policy_loss(kept, lp_in, adv)
        assert err.value.tensor == name and err.value.pos == (2 if name == "logprobs" else 1)
    values = kept_lp.values.detach().clone()
    values[4] = NAN  # row 1's second slot
    with pytest.raises(ObjectiveInputError) as err:
        from rollfeed.objectives import support_distribution

        support_distribution(
            b.support,
            kept_lp.with_values(values),
            b.mask,
            labels=b.labels,
            loss_mask=b.loss_mask,
            inference_logprobs=b.inference,
        )
    assert (err.value.tensor, err.value.pos) == ("support_logprobs", 1)


@pytest.mark.parametrize(
    ("positions", "cu_seqlens", "tensor"),
    [
        ([0, 1, 9], [0, 5, 8], "positions"),  # past cu_seqlens[-1]: sums from no sample
        ([0, 1, -1], [0, 5, 8], "positions"),
        ([0, 3, 3], [0, 5, 8], "positions"),  # one position twice
        ([1, 2, 3], [1, 5, 8], "cu_seqlens"),
        ([0, 1, 2], [0, 5, 4], "cu_seqlens"),
    ],
)
def test_inconsistent_positions_are_refused(positions, cu_seqlens, tensor):
    with pytest.raises(ObjectiveInputError) as err:
        _loss(
            batch(ROWS),
            sequence=SequenceWeight(cap=2.0),
            positions=torch.tensor(positions),
            cu_seqlens=torch.tensor(cu_seqlens),
        )
    assert err.value.tensor == tensor
    if tensor == "positions":
        assert err.value.pos == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_centering_without_mask_logprobs_names_the_field_and_how_to_write_it(dtype):
    # The quick start's step before it wrote mask logprobs: kept sets, no sampler logprobs.
    rows = [Row(lp=-0.5, lq=-0.6, mask=False), Row(lp=-1.0, lq=-0.9, mask=False, adv=-1.0)]
    with pytest.raises(ObjectiveMissingInputError) as err:
        _loss(batch(rows, dtype), centering=ScoreCentering())
    text = str(err.value)
    assert (err.value.tensor, err.value.pos) == ("mask_logprobs", 0)
    for words in ("sampling_mask_logprobs", "PayloadWriter.write", "CaptureConfig(mask_logprobs"):
        assert words in text
    # Named: left uncentered and counted, the mismatch over the kept set not computed.
    terms = _loss(
        batch(rows, dtype),
        weight=TruncatedIS(cap=2.0),
        centering=ScoreCentering(missing="skip"),
        positions=torch.tensor([0, 1]),
        cu_seqlens=torch.tensor([0, 3]),
    )
    assert (terms.centering == 0).all() and int(terms.metrics["rows_no_mask_logprobs"]) == 2
    m = finish_metrics(terms.metrics)
    assert m["not_computed"] == ("chi2", "kl", "log_mass", "seq_chi2")
    assert not {"kl", "chi2", "log_mass", "seq_chi2"} & m.keys()
    assert 0.9 < m["ess"].item() <= 1 and m["tokens"] == 2


def test_centering_without_a_kept_set_names_sampling_mask():
    rows = [Row(lp=-0.5, lq=-0.6), Row(width=0, lp=-1.0, lq=-0.9)]
    with pytest.raises(ObjectiveMissingInputError, match="'sampling_mask'") as err:
        _loss(batch(rows), centering=ScoreCentering())
    assert (err.value.tensor, err.value.pos) == ("support", 1)
    terms = _loss(batch(rows), centering=ScoreCentering(missing="skip"))
    assert int(terms.metrics["rows_no_support"]) == 1 and terms.centering[1] == 0
    # A singleton's correction is 0 with or without its mask logprobs: not missing.
    _loss(batch([Row(lp=0.0, lq=0.0, width=1, mask=False)]), centering=ScoreCentering())
