"""The mismatch metrics near on-policy: ten significant digits in float64 against an exact
reference (``decimal``, 50 digits, both distributions renormalised exactly), never negative in
float32, and "not computed" absent, the same in float32 and float64."""

from __future__ import annotations

import decimal
import itertools
import math

import pytest
import torch

from rollfeed.collate import RaggedRows
from rollfeed.objectives import (
    MaskedIS,
    TruncatedIS,
    finish_metrics,
    policy_loss,
    support_distribution,
)
from tests.objectives.rows import Row, batch, kept_of

D = decimal.Context(prec=50)
CU_SEQLENS = [0, 4, 9, 12]  # 12 rows in three samples


def _near_on_policy(delta: float, dtype: torch.dtype, seed: int, invalid: bool = True) -> dict:
    """12 rows of 2-7 kept ids; the sampler is the trainer with noise ``delta`` in its logits;
    rows 3 and 8 have an invalid slot (-inf, -9999)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 8, (12,), generator=g)
    z = torch.randn(int(lengths.sum()), generator=g, dtype=torch.float64) * 2
    noise = torch.randn(z.shape, generator=g, dtype=torch.float64) * delta
    support = RaggedRows.from_lengths(lengths, torch.cat([torch.arange(n) for n in lengths]))
    row = support.row_index()
    lse = lambda x: torch.zeros(12, dtype=x.dtype).index_add(0, row, x.exp()).log()[row]  # noqa: E731
    lp = (z - lse(z)).to(dtype)
    lq = (z + noise - lse(z + noise)).to(dtype)
    if invalid:
        lq[int(support.offsets[3]) + 1] = -math.inf
        lq[int(support.offsets[8]) + 1] = -9999.0
    leaf = lp.clone().requires_grad_()
    kept = support_distribution(
        support,
        support.with_values(leaf),
        support.with_values(lq),
        labels=torch.zeros(12, dtype=torch.int64),
        loss_mask=torch.ones(12, dtype=torch.bool),
        inference_logprobs=torch.full((12,), -0.5, dtype=dtype),
    )
    terms = policy_loss(
        kept,
        leaf[support.offsets[:-1]],
        torch.ones(12, dtype=dtype),
        positions=torch.arange(12),
        cu_seqlens=torch.tensor(CU_SEQLENS),
    )
    return dict(support=support, lp=lp, lq=lq, terms=terms)


def _exact(case: dict) -> dict[str, decimal.Decimal]:
    """The metrics from the formulas, exactly: ``p̂`` over the members, ``q̂`` over the valid
    slots, ``χ²`` of ``p̂`` renormalised over the valid slots (``q̂``'s support)."""
    off = case["support"].offsets.tolist()
    kl, chi2, k3, seq = [], [], [], []
    for i in range(12):
        lp = [D.create_decimal(x) for x in case["lp"][off[i] : off[i + 1]].double().tolist()]
        lq = [x for x in case["lq"][off[i] : off[i + 1]].double().tolist()]
        valid = [k for k, x in enumerate(lq) if x > -9999]
        p = [D.exp(x) for x in lp]
        q = {k: D.exp(D.create_decimal(lq[k])) for k in valid}
        p_sum, q_sum = D.add(sum(p), 0), D.add(sum(q.values()), 0)
        p_hat = [D.divide(x, p_sum) for x in p]
        q_hat = {k: D.divide(x, q_sum) for k, x in q.items()}
        p_valid = D.add(sum(p_hat[k] for k in valid), 0)
        kl.append(sum(q_hat[k] * D.ln(D.divide(q_hat[k], p_hat[k])) for k in valid))
        chi2.append(sum(D.divide((p_hat[k] / p_valid) ** 2, q_hat[k]) for k in valid) - 1)
        r = D.exp(lp[0] - D.ln(q_hat[0]))  # the label: the scorer's log p^S(a) over q̂(a)
        k3.append(r - 1 - D.ln(r))
    for a, b in itertools.pairwise(CU_SEQLENS):
        prod = decimal.Decimal(1)
        for i in range(a, b):
            prod *= 1 + chi2[i]
        seq.append(prod - 1)
    return dict(kl=sum(kl) / 12, chi2=sum(chi2) / 12, k3=sum(k3) / 12, seq_chi2=sum(seq) / 3)


@pytest.mark.parametrize("delta", [1e-4, 1e-3])
def test_near_on_policy_the_metrics_keep_ten_digits(delta):
    for seed in range(3):
        case = _near_on_policy(delta, torch.float64, seed)
        got = finish_metrics(case["terms"].metrics)
        for name, want in _exact(case).items():
            rel = abs(decimal.Decimal(float(got[name])) - want) / abs(want)
            assert rel < 1e-10, (name, seed, float(got[name]), float(want), float(rel))


def test_divergences_are_never_negative_in_float32():
    for seed in range(40):
        case = _near_on_policy(1e-7, torch.float32, seed, invalid=seed % 2 == 0)
        m = case["terms"].metrics
        for name in ("kl", "chi2", "k3", "seq_chi2"):
            assert float(m[name]) >= 0, (name, seed, float(m[name]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_not_computed_is_absent_and_named_the_same_in_both_dtypes(dtype):
    bounds = dict(positions=torch.arange(3), cu_seqlens=torch.tensor([0, 2, 4]))
    cases = {
        # every token masked (w = 0): no weight to take an ESS of
        "all masked": ([Row(lp=-0.1, lq=-3.0)] * 3, MaskedIS(low=0.5, high=2.0), {"ess"}),
        # no loss token: no mean at all
        "no loss": (
            [Row(loss=False)] * 3,
            TruncatedIS(cap=2.0),
            {"ess", "k1", "k3", "log_ratio_mean", "log_ratio_std", "kl", "chi2", "log_mass"}
            | {"seq_chi2", "truncated_frac", "masked_frac", "seq_truncated_frac"}
            | {"seq_masked_frac", "seq_vetoed_frac"},
        ),
        # no mask logprobs (the sampler's kept-set distribution unknown)
        "no mask": (
            [Row(mask=False)] * 3,
            TruncatedIS(cap=2.0),
            {"kl", "chi2", "log_mass", "seq_chi2"},
        ),
    }
    for name, (rows, weight, absent) in cases.items():
        _, kept, lp = kept_of(batch(rows, dtype))
        terms = policy_loss(kept, lp, batch(rows, dtype).advantages, weight=weight, **bounds)
        m = finish_metrics(terms.metrics)
        assert set(m["not_computed"]) == absent, name
        assert not absent & m.keys(), name
        for key, value in m.items():
            if key != "not_computed":
                assert not torch.isnan(value).any(), (name, key)
