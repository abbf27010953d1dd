"""The objectives equal the formulas computed directly on a tiny vocabulary (float64, 1e-12)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rollfeed.collate import RaggedRows
from rollfeed.objectives import (
    MaskedIS,
    ObjectiveCompositionError,
    ObjectiveInputError,
    PPOClip,
    ScoreCentering,
    SequenceWeight,
    TruncatedIS,
    TrustRegion,
    Unweighted,
    finish_metrics,
    policy_loss,
    support_distribution,
)
from tests.objectives.cases import CU_SEQLENS, INVALID_SLOTS, ROWS, make_case, samples_of, scored
from tests.objectives.reference import reference_terms

WEIGHTS = {
    "one": (Unweighted(), ("one",)),
    "tis": (TruncatedIS(cap=1.5), ("tis", 1.5)),
    "tis_inf": (TruncatedIS(cap=math.inf), ("tis", math.inf)),
    "mis": (MaskedIS(low=0.5, high=2.0), ("mis", 0.5, 2.0)),
    "icepop": (MaskedIS(low=0.8, high=1.25), ("mis", 0.8, 1.25)),
    "trust": (TrustRegion(cap=2.0, eps=0.15), ("tr", 2.0, 0.15)),
}
SEQUENCES = {
    "none": (None, None),
    "sum_cap": (SequenceWeight(statistic="sum", cap=2.0), {"stat": "sum", "cap": 2.0}),
    "mean_band": (
        SequenceWeight(statistic="mean", band=(0.8, 1.25)),
        {"stat": "mean", "band": (0.8, 1.25)},
    ),
    "veto": (SequenceWeight(veto=0.3), {"stat": "sum", "veto": 0.3}),
}
SKIP = ScoreCentering(missing="skip")
BOUNDS = dict(positions=torch.arange(len(ROWS)), cu_seqlens=torch.tensor(CU_SEQLENS))


def _grad(values: list[torch.Tensor] | torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    total = torch.stack(values) if isinstance(values, list) else values
    coef = torch.linspace(0.5, 1.5, total.numel(), dtype=torch.float64)
    (g,) = torch.autograd.grad((coef * total).sum(), leaf, retain_graph=True)
    return g


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("seq", sorted(SEQUENCES))
@pytest.mark.parametrize("clip", [None, 0.2])
def test_terms_and_gradients_equal_the_formulas(name: str, seq: str, clip: float | None) -> None:
    weight, ref_weight = WEIGHTS[name]
    sequence, ref_sequence = SEQUENCES[seq]
    case = make_case(seed=3)
    out, kept = scored(case)
    # Centering names its weight whenever the clip or a sequence weight takes part; the case
    # holds rows without mask logprobs and without a kept set, left uncentered by name.
    named = clip is not None or sequence is not None
    centering = ScoreCentering(weight=weight if named else None, missing="skip")
    terms = policy_loss(
        kept,
        out.logprobs,
        case["advantages"],
        weight=weight,
        clip=PPOClip(eps_low=clip) if clip is not None else None,
        sequence=sequence,
        centering=centering,
        **BOUNDS,
    )
    ref = reference_terms(
        case["logits"],
        case["rows"],
        weight=ref_weight,
        centering=ref_weight,
        clip=clip,
        sequence=ref_sequence,
        samples=samples_of(len(ROWS)),
    )
    for got, want in ((terms.loss, ref["loss"]), (terms.centering, ref["correction"])):
        torch.testing.assert_close(got, torch.stack(want).detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        terms.sequence_weight,
        torch.tensor(
            [s if r["loss"] else 0.0 for s, r in zip(ref["seq"], case["rows"], strict=True)],
            dtype=torch.float64,
        ),
        rtol=0,
        atol=1e-12,
    )
    leaf = case["logits"]
    torch.testing.assert_close(
        _grad(terms.loss, leaf), _grad(ref["loss"], leaf), rtol=0, atol=1e-12
    )
    assert _grad(terms.centering, leaf).abs().max() > 1e-3 or name in ("tis_inf", "mis")


def test_centering_with_a_ratio_weight_has_zero_gradient_on_fully_valid_rows() -> None:
    rows = [r for r in ROWS if not r[3] and not r[4] and r[5] and len(set(r[0])) == len(r[0])]
    case = make_case(seed=5, rows=[(*r[:4], {}, True) for r in rows])
    for ratio in (TruncatedIS(cap=math.inf), MaskedIS(low=0.0, high=math.inf)):
        out, kept = scored(case)
        terms = policy_loss(
            kept, out.logprobs, case["advantages"], centering=ScoreCentering(weight=ratio)
        )
        (g,) = torch.autograd.grad(terms.centering.sum(), case["logits"])
        assert g.abs().max() <= 1e-12
    out, kept = scored(case)  # the sampler's own q does pull: the check above can fail
    terms = policy_loss(kept, out.logprobs, case["advantages"], centering=ScoreCentering())
    (g,) = torch.autograd.grad(terms.centering.sum(), case["logits"])
    assert g.abs().max() > 1e-3


def test_invalid_slots_get_zero_weight_and_zero_gradient() -> None:
    case = make_case(seed=7)
    out, _ = scored(case)
    leaf = out.support_logprobs.values.detach().clone().requires_grad_()
    kept = support_distribution(
        case["support"],
        out.support_logprobs.with_values(leaf),
        case["mask"],
        labels=case["labels"],
        loss_mask=case["loss_mask"],
        inference_logprobs=case["inference"],
    )
    terms = policy_loss(kept, out.logprobs, case["advantages"], centering=SKIP)
    (g,) = torch.autograd.grad(terms.loss.sum(), leaf)
    assert torch.isfinite(g).all() and torch.isfinite(terms.loss).all()
    offsets = case["support"].offsets
    for row, slot in INVALID_SLOTS:
        at = int(offsets[row]) + slot
        assert not kept.valid[at] and g[at] == 0
    assert (g[kept.valid & case["loss_mask"][kept.row]] != 0).sum() >= 15
    # The row's q is renormalised over its valid slots only: row 2 keeps 3 of its 4.
    q = kept.log_q.exp()
    row2 = slice(int(offsets[2]), int(offsets[3]))
    torch.testing.assert_close(q[row2].sum(), torch.tensor(1.0, dtype=torch.float64))


def test_counters_name_each_kind_of_row() -> None:
    case = make_case(seed=1)
    out, kept = scored(case)
    got = {k: int(v) for k, v in kept.counts.items()}
    assert got == {
        "rows_centered": 9,  # rows 0-5, 11, 12, 13
        "rows_singleton": 1,
        "rows_unscored": 2,  # the fallback rows 7 and 8
        "rows_no_support": 1,  # row 8
        "rows_missing_label": 1,
        "rows_no_mask_logprobs": 1,
        "rows_inference_q": 5,  # rows 6, 7, 8, 9, 11
        "slots_invalid": 4,
        "duplicate_ids": 1,
        "no_sampler_logprob": 0,
    }
    terms = policy_loss(kept, out.logprobs, case["advantages"], centering=SKIP)
    for row in (1, 6, 7, 8, 9, 10):  # singleton, no mask logprobs, fallback, missing, no loss
        assert terms.centering[row] == 0
    assert terms.loss[10] == 0


def test_metrics_equal_the_formulas() -> None:
    case = make_case(seed=9)
    out, kept = scored(case)
    terms = policy_loss(
        kept, out.logprobs, case["advantages"], weight=TruncatedIS(cap=1.2), **BOUNDS
    )
    ref = reference_terms(case["logits"], case["rows"], weight=("one",), centering=None)
    m = terms.metrics
    for name in ("kl", "chi2", "k1", "k3"):
        assert abs(float(m[name]) - ref["metrics"][name]) <= 1e-12, name
    assert int(m["tokens"]) == ref["metrics"]["tokens"] == 13
    assert int(m["rows_centered"]) == ref["metrics"]["centered"]
    fin = finish_metrics(m)
    assert fin.pop("not_computed") == ()
    assert all(v.dim() == 0 for v in fin.values())
    w = terms.weight[case["loss_mask"]]
    torch.testing.assert_close(fin["ess"], w.sum() ** 2 / (13 * w.square().sum()))
    assert float(fin["truncated_frac"]) == float((w == 1.2).sum()) / 13 > 0
    # log-mass: the sampler's mass on the valid slots before renormalising
    mass = []
    for i, r in enumerate(case["rows"]):
        if bool(kept.centered[i]):
            first = dict(reversed(list(zip(r["ids"], r["sampler"], strict=True))))
            good = [math.exp(s) for s in first.values() if not math.isnan(s) and s > -9999]
            mass.append(math.log(sum(good)))
    assert abs(float(fin["log_mass"]) - sum(mass) / len(mass)) <= 1e-12
    # sequence chi2: per sample, prod(1 + chi2_t) - 1 over its centered tokens
    per_row = []
    for i, r in enumerate(case["rows"]):
        one = reference_terms(case["logits"][i : i + 1], [r], weight=("one",), centering=None)
        per_row.append(one["metrics"]["chi2"])
    seq = [
        math.prod(1 + per_row[i] for i in range(a, b)) - 1
        for a, b in itertools.pairwise(CU_SEQLENS)
    ]
    assert abs(float(fin["seq_chi2"]) - sum(seq) / 3) <= 1e-12


def test_centering_with_the_clip_or_a_sequence_weight_needs_its_weight_named() -> None:
    case = make_case(seed=2)
    out, kept = scored(case)
    args = (kept, out.logprobs, case["advantages"])
    with pytest.raises(ObjectiveCompositionError, match="PPO clip"):
        policy_loss(*args, clip=PPOClip(), centering=ScoreCentering())
    with pytest.raises(ObjectiveCompositionError, match="sequence-level"):
        policy_loss(*args, sequence=SequenceWeight(cap=2.0), centering=ScoreCentering(), **BOUNDS)
    with pytest.raises(ObjectiveInputError, match="sample boundaries"):
        policy_loss(*args, sequence=SequenceWeight(cap=2.0))
    policy_loss(
        *args, clip=PPOClip(), centering=ScoreCentering(weight=Unweighted(), missing="skip")
    )


def test_misaligned_rows_are_refused_naming_the_row() -> None:
    case = make_case(seed=2)
    out, _ = scored(case)
    short = case["mask"].rows(0, len(ROWS))
    lengths = short.lengths().clone()
    lengths[3] -= 1
    bad = RaggedRows.from_lengths(lengths, short.values[: int(lengths.sum())])
    with pytest.raises(ObjectiveInputError, match="row 3 holds 2 values") as err:
        support_distribution(
            case["support"],
            out.support_logprobs,
            bad,
            labels=case["labels"],
            loss_mask=case["loss_mask"],
            inference_logprobs=case["inference"],
        )
    assert err.value.pos == 3 and err.value.tensor == "mask_logprobs"
    with pytest.raises(ObjectiveInputError, match="cap must be > 0"):
        TruncatedIS(cap=0.0)


def test_weighted_q_never_exponentiates_an_unbounded_ratio() -> None:
    log_p = torch.tensor([0.0, -1.0], dtype=torch.float64)
    log_q = torch.tensor([-800.0, -1.0], dtype=torch.float64)  # r = e^800 overflows
    for weight, want in (
        (TruncatedIS(cap=2.0), [2 * math.exp(-800), math.exp(-1)]),
        (MaskedIS(low=0.5, high=2.0), [0.0, math.exp(-1)]),
        (TrustRegion(eps=0.5, cap=2.0), [0.0, math.exp(-1)]),
    ):
        got = weight.log_weighted_q(log_p, log_q).exp()
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=0)
