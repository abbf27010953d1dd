"""The oracle of the ``objectives`` attack family (:mod:`tests.objectives.adversary_objectives`):
what a batch's terms must satisfy, predicted from the rows in float64 without the library.

For a loss token with sampler logprob ``log q̂(a)`` (its mask slot renormalised over the row's
valid slots, else ``inference_logprobs``; none at ``<= -9999`` or ``-inf``: dropped) and trainer
logprob ``log p(a)``, ``log r = log p(a) − log q̂(a)``; the weight's zero set (MIS outside its
band, the trust region outside its region, a sequence weight of 0) and the log of the factor the
term applies (``log s + log w``, with the clip ``log s + log k + log clip-chosen r``) decide:

- ``overflow``: the term ``A·factor(·log p)`` or the factor is beyond the dtype: the call must
  raise :class:`~rollfeed.objectives.ObjectiveOverflowError` naming a token that overflows;
- ``zero``: the token's policy term and its gradient are exactly 0;
- ``ambiguous``: within ``1e-6`` of an edge or 3 nats of the dtype's range: not asserted.
"""

from __future__ import annotations

import math

import torch

from tests.objectives.rows import Row

EDGE = 1e-6


def _lse(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def sampler_logprob(row: Row, dtype: torch.dtype) -> float | None:
    """``log q̂(a)`` as the library must read it (``None``: no sampler logprob)."""
    cast = lambda x: float(torch.tensor(x, dtype=dtype))  # noqa: E731
    ok = lambda x: math.isfinite(x) and x > -9999  # noqa: E731
    if row.mask and row.width:
        label = cast(row.lq if row.lq_label is None else row.lq_label)
        rest = 1 - math.exp(row.lq)
        other = cast(max(math.log(rest / (row.width - 1)), -9000.0) if rest > 0 else -9000.0)
        slots = [label] + [other] * (row.width - 1)
        valid = [x for x in slots if ok(x)]
        if ok(label) and row.width > 1:
            return label - _lse(valid)
        if ok(label):
            return label - label
    inference = cast(row.lq if row.inference is None else row.inference)
    return inference if ok(inference) else None


def trainer_logprob(row: Row, dtype: torch.dtype) -> float:
    if not row.width or row.width == 1:
        return 0.0 if row.width == 1 else float(torch.tensor(row.lp, dtype=dtype))
    rest = -math.expm1(row.lp)
    other = max(math.log(rest / (row.width - 1)), -1e5) if rest > 0 else -1e5
    z = [float(torch.tensor(x, dtype=dtype)) for x in [row.lp] + [other] * (row.width - 1)]
    return z[0] - _lse(z)


def predict(rows, dtype, weight, clip, sequence) -> list[dict]:  # type: ignore[no-untyped-def]
    """Per row: ``dropped``, ``log_r``, ``log_f`` (the log factor), ``zero``, ``overflow``,
    ``amb`` (module doc); every row is a sample of its own."""
    big = math.log(torch.finfo(dtype).max)
    out = []
    for row in rows:
        lq = sampler_logprob(row, dtype)
        if not row.loss or lq is None:
            out.append(
                dict(dropped=row.loss, log_r=0.0, log_f=-math.inf, zero=True, overflow=False)
                | dict(amb=False)
            )
            continue
        lp = trainer_logprob(row, dtype)
        log_r = lp - lq
        edges, zero, amb, log_w, log_k = [], False, False, 0.0, 0.0
        name = type(weight).__name__
        if name == "TruncatedIS":
            log_w = min(log_r, math.log(weight.cap))
            log_k = min(0.0, math.log(weight.cap) - log_r)
        elif name == "MaskedIS":
            lo = math.log(weight.low) if weight.low > 0 else -math.inf
            hi = math.log(weight.high)
            edges += [lo, hi]
            zero = not lo <= log_r <= hi
            log_w = log_r
        elif name == "TrustRegion":
            gap = abs(math.exp(lp) - math.exp(lq))
            zero = gap > weight.eps
            amb = abs(gap - weight.eps) < EDGE
            log_w = min(log_r, math.log(weight.cap))
            log_k = min(0.0, math.log(weight.cap) - log_r)
        log_s = 0.0
        if sequence is not None and sequence.cap is not None:
            log_s = min(log_r, math.log(sequence.cap))
        elif sequence is not None:
            lo, hi = (math.log(x) for x in sequence.band)
            edges += [lo, hi, math.log(sequence.veto)]
            zero = zero or not lo <= log_r <= hi or log_r < math.log(sequence.veto)
        amb = amb or any(abs(log_r - e) < EDGE for e in edges if math.isfinite(e))
        adv = math.log(abs(row.adv)) if row.adv else -math.inf
        if clip is None:
            log_f = log_s + log_w
            term = log_f + adv + (math.log(abs(lp)) if lp else -math.inf)
        else:
            low, high = math.log1p(-clip.eps_low), math.log1p(clip.high)
            amb = amb or any(abs(log_r - e) < EDGE for e in (low, high))
            follow = log_r <= high if row.adv >= 0 else log_r >= low
            log_f = log_s + log_k + (log_r if follow else min(max(log_r, low), high))
            term = log_f + adv
        worst = max(log_f, term)
        overflow = not zero and worst > big
        amb = amb or (not zero and abs(worst - big) < 3)
        out.append(
            dict(dropped=False, log_r=log_r, log_f=-math.inf if zero else log_f, zero=zero)
            | dict(overflow=overflow, amb=amb)
        )
    return out


def ess_computed(pred: list[dict], dtype: torch.dtype) -> bool | None:
    """Whether the ESS is computed: some applied weight above 0 in ``dtype`` and ``Σ w²`` a
    positive float64 number (``None`` within 3 nats of either edge)."""
    # log of the smallest subnormal: below it a weight is 0 in the dtype
    zero_below = math.log(torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    logs = [p["log_f"] for p in pred if not p["dropped"] and p["log_f"] > -math.inf]
    edges = [zero_below, 709.78 / 2, -744.44 / 2]
    if any(abs(x - e) < 3 for x in logs for e in edges):
        return None
    logs = [x for x in logs if x > zero_below]
    return bool(logs) and max(logs) < 709.78 / 2 and max(logs) > -744.44 / 2
