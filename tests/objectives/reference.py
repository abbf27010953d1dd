"""Plain float64 reference of the loss objectives, straight from the formulas.

Each row's kept set is a Python set over a tiny vocabulary, ``p^S`` is a softmax of the row's
logits over it, ``q^S`` the sampler's valid logprobs exponentiated and divided by their sum, and
every weight is the formula written out (``min(r, c)``, ``r·1[lo ≤ r ≤ hi]``, ...): no code is
shared with the library and nothing is computed in log space.
"""

from __future__ import annotations

import math

import torch


def weight_of(kind: tuple, p: float, q: float) -> float:
    """The detached weight ``w`` of ``r = p / q`` for ``kind``: ``("one",)``, ``("tis", c)``,
    ``("mis", lo, hi)`` or ``("tr", c, eps)``."""
    r = p / q
    if kind[0] == "one":
        return 1.0
    if kind[0] == "tis":
        return min(r, kind[1])
    if kind[0] == "mis":
        return r if kind[1] <= r <= kind[2] else 0.0
    if kind[0] == "tr":
        return min(r, kind[1]) if abs(p - q) <= kind[2] else 0.0
    raise ValueError(kind)


def sampler_valid(value: float) -> bool:
    return not math.isnan(value) and value > -9999 and value != math.inf


def reference_terms(
    logits: torch.Tensor,
    rows: list[dict],
    *,
    weight: tuple,
    centering: tuple | None,
    clip: float | None = None,
    sequence: dict | None = None,
    samples: list[int] | None = None,
) -> dict:
    """Per-row ``loss`` (a list of 0-d tensors with gradient to ``logits``) and metric sums.

    ``rows[n]``: ``ids`` (slots, ``-1`` padding, repeats), ``sampler`` (logprob per slot, or
    None: no mask logprobs), ``label``, ``loss`` (bool), ``adv``, ``inference`` (logprob),
    ``fallback`` (scored over the full vocabulary). ``samples[n]``: the sample of row ``n``.
    ``sequence``: ``{"stat": "sum"|"mean", "cap": c | None, "band": (lo, hi) | None,
    "veto": v | None}``.
    """
    info = []
    for n, row in enumerate(rows):
        z = logits[n]
        members = []
        for v in row["ids"]:
            if v >= 0 and v not in members:
                members.append(v)
        scored = bool(members) and row["label"] in members and not row["fallback"]
        if scored:
            lse = torch.logsumexp(z[members], 0)
            logp = {v: z[v] - lse for v in members}
            logp_a = logp[row["label"]]
        else:
            logp = {}
            logp_a = z[row["label"]] - torch.logsumexp(z, 0)
        q = {}
        if scored and row["sampler"] is not None:
            first = {}
            for v, s in zip(row["ids"], row["sampler"], strict=True):
                if v >= 0 and v not in first:
                    first[v] = s
            good = {v: math.exp(s) for v, s in first.items() if sampler_valid(s)}
            mass = sum(good.values())
            q = {v: e / mass for v, e in good.items()}
        q_a = q.get(row["label"], math.exp(row["inference"]))
        info.append(dict(logp=logp, logp_a=logp_a, q=q, q_a=q_a, scored=scored))

    log_r = [math.log(float(i["logp_a"].detach().exp()) / i["q_a"]) for i in info]
    s_weight = [1.0] * len(rows)
    if sequence is not None:
        for n in range(len(rows)):
            mine = [m for m in range(len(rows)) if samples[m] == samples[n] and rows[m]["loss"]]
            stat = sum(log_r[m] for m in mine)
            if sequence["stat"] == "mean":
                stat /= max(len(mine), 1)
            rho = math.exp(stat)
            s = 1.0
            if sequence.get("cap") is not None:
                s = min(rho, sequence["cap"])
            if sequence.get("band") is not None:
                s = 1.0 if sequence["band"][0] <= rho <= sequence["band"][1] else 0.0
            veto = sequence.get("veto")
            if veto is not None and any(math.exp(log_r[m]) < veto for m in mine):
                s = 0.0
            s_weight[n] = s

    losses, policy, correction = [], [], []
    for n, (row, i) in enumerate(zip(rows, info, strict=True)):
        zero = logits.sum() * 0
        if not row["loss"]:
            losses.append(zero)
            policy.append(zero)
            correction.append(zero)
            continue
        p_a = float(i["logp_a"].detach().exp())
        w_a = weight_of(weight, p_a, i["q_a"])
        A = row["adv"]
        if clip is None:
            pg = -A * s_weight[n] * w_a * i["logp_a"]
        else:
            ratio = torch.exp(i["logp_a"] - math.log(i["q_a"]))
            k = 1.0 if weight[0] == "one" else w_a / (p_a / i["q_a"])
            pg = -s_weight[n] * k * torch.minimum(ratio * A, ratio.clamp(1 - clip, 1 + clip) * A)
        corr = zero
        if centering is not None and i["q"]:
            for v, qv in i["q"].items():
                pv = float(i["logp"][v].detach().exp())
                corr = corr + A * qv * weight_of(centering, pv, qv) * i["logp"][v]
        policy.append(pg)
        correction.append(corr)
        losses.append(pg + corr)

    metrics = {"kl": 0.0, "chi2": 0.0, "k1": 0.0, "k3": 0.0, "centered": 0, "tokens": 0}
    for row, i, lr in zip(rows, info, log_r, strict=True):
        if not row["loss"]:
            continue
        metrics["tokens"] += 1
        metrics["k1"] += -lr
        metrics["k3"] += math.exp(lr) - 1 - lr
        if i["q"]:
            metrics["centered"] += 1
            p = {v: float(i["logp"][v].detach().exp()) for v in i["q"]}
            metrics["kl"] += sum(qv * math.log(qv / p[v]) for v, qv in i["q"].items())
            # chi2 of the trainer's p renormalised over the valid slots (q's support)
            mass = sum(p.values())
            metrics["chi2"] += sum((p[v] / mass) ** 2 / qv for v, qv in i["q"].items()) - 1
    return dict(loss=losses, policy=policy, correction=correction, seq=s_weight, metrics=metrics)
