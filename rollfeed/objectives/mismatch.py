"""Mismatch metrics between the sampler and the trainer, as additive sums, then means.

:func:`mismatch_sums` gives 0-d tensors on the inputs' device (no host sync until read) that add
over micro batches and ranks (sum them over the dp and cp groups, e.g. one all-reduce of their
stack per step); :func:`finish_metrics` turns summed ones into means. Each slot's or token's term
is formed in the inputs' dtype in a form that does not cancel and is never negative
(:mod:`rollfeed.objectives.divergence`), and summed in float64 whatever the inputs' dtype (near
on-policy ``χ²`` is ``~1e−12`` per token, a sum over 1e5 of them keeps its digits), so a
divergence is never negative. Over the loss tokens:

- ``kl``: exact ``KL(q^S ‖ p^S) = Σ_valid q^S (log q^S − log p^S)`` per centered token;
- ``chi2``: exact ``χ²(p̃ ‖ q^S) = Σ_valid (p̃ − q^S)² / q^S`` per centered token, ``p̃`` the
  trainer's ``p^S`` renormalised over the valid slots (``p^S`` itself when every slot is valid;
  over invalid slots, where ``q^S = 0``, ``χ²(p^S ‖ q^S)`` is infinite);
- ``k1``, ``k3``: at the sampled token, ``−log r`` and ``r − 1 − log r`` (``r = p^S(a)/q^S(a)``);
- ``log_ratio_mean``, ``log_ratio_std``: of ``log r``;
- ``seq_chi2``: per sample ``Π_t (1 + χ²_t) − 1`` over its centered tokens, the χ² of the
  sample's product of kept-set distributions, averaged over the samples that have one (a sample
  split over cp ranks counts once: each rank adds its share of the sample's centered tokens);
- ``truncated_frac``, ``masked_frac`` (the token weight), ``seq_truncated_frac``,
  ``seq_masked_frac``, ``seq_vetoed_frac`` (the sequence weight), fractions of loss tokens;
- ``ess``: ``(Σ w)² / (n·Σ w²)`` of the applied weights (:attr:`PolicyTerms.weight`);
- ``log_mass``: the sampler's log-mass on the valid slots before renormalising, per centered token;
- ``weighted``: the loss tokens whose applied weight is above 0;
- the counters of :class:`~rollfeed.objectives.SupportDistribution` (``rows_*``, ``slots_invalid``,
  ``duplicate_ids``, ``no_sampler_logprob``), summed;
- with the policy versions (:class:`~rollfeed.objectives.VersionLag`), ``k1``, ``k3``,
  ``log_ratio_mean``, ``kl`` and ``chi2`` again per lag bucket (``lag0_k1``, ...,
  ``lag_older_chi2``; :mod:`rollfeed.objectives.version_lag`).

*Not computed* has one meaning: a mean without anything to average (no loss token, no centered
token, no sample with one, no weight above 0, or no sample boundaries for ``seq_chi2``) is absent
from :func:`finish_metrics`' dict and named in its ``"not_computed"`` tuple, never a 0 or a NaN.

Example: two loss tokens, ``log r = [0.1, -0.3]`` -> ``k1 = 0.1``, ``log_ratio_mean = -0.1``,
``log_ratio_std = 0.2``; applied weights ``[1, 3]`` -> ``ess = 16 / (2·10) = 0.8``; no mask
logprobs -> ``not_computed == ("chi2", "kl", "log_mass", "seq_chi2")``.
"""

from __future__ import annotations

import torch

from rollfeed.objectives.divergence import kl_chi2_terms, phi
from rollfeed.objectives.support_distribution import ObjectiveMetrics, SupportDistribution
from rollfeed.objectives.version_lag import finish_lag_metrics, lag_counters

_FRACTIONS = ("truncated", "masked", "seq_truncated", "seq_masked", "seq_vetoed")
_PER_TOKEN = ("k1", "k3", "log_ratio_mean", "log_ratio_std", *(f"{f}_frac" for f in _FRACTIONS))
_PER_CENTERED = ("kl", "chi2", "log_mass")
_COUNTERS = ("tokens", "rows_", "slots_invalid", "duplicate_ids", "no_sampler_logprob", "weighted")


def row_divergences(kept: SupportDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kl, chi2)``, ``[N]`` float64 each, per centered row (0 elsewhere; module doc). The
    slots' terms are in the inputs' dtype (each ``>= 0``), their row sums in float64."""
    on = kept.valid & kept.centered[kept.row]
    lq = torch.where(on, kept.log_q, float("-inf"))
    # d = log p̃ − log q over the valid slots; Σ q = Σ p̃ = 1 there.
    shift = kept.log_p_valid[kept.row]
    d = torch.where(on, kept.log_p.detach() - torch.where(on, kept.log_q, 0.0) - shift, 0.0)
    rows = lambda slots: torch.zeros(  # noqa: E731
        kept.n_rows, dtype=torch.float64, device=d.device
    ).index_add(0, kept.row, torch.where(on, slots, 0.0).double())
    kl_slots, chi2_slots = kl_chi2_terms(lq, d)
    # KL(q‖p) = KL(q‖p̃) − log Σ_valid p, both terms >= 0.
    kl = rows(kl_slots) - kept.log_p_valid.double()
    chi2 = rows(chi2_slots)
    return torch.where(kept.centered, kl, 0.0), torch.where(kept.centered, chi2, 0.0)


def mismatch_sums(
    kept: SupportDistribution,
    *,
    kl: torch.Tensor,
    chi2: torch.Tensor,
    log_r: torch.Tensor,
    applied: torch.Tensor,
    truncated: torch.Tensor,
    masked: torch.Tensor,
    sequence_flags: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sums: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The additive sums of the module doc (``[N]`` inputs, detached; ``kl``, ``chi2`` from
    :func:`row_divergences`; ``sums [N, 5]`` the sample sums of ``(log r, 1, vetoed,
    log(1 + χ²), centered)`` or None)."""
    loss, centered = kept.loss_mask, kept.centered
    lr = torch.where(loss, log_r.detach().double(), 0.0)
    w = torch.where(loss, applied.detach().double(), 0.0)
    count = lambda mask: mask.sum(dtype=torch.int64)  # noqa: E731
    out = {
        "tokens": count(loss),
        "kl": torch.where(centered, kl, 0.0).sum(),
        "chi2": torch.where(centered, chi2, 0.0).sum(),
        "k1": -lr.sum(),
        "k3": torch.where(loss, phi(lr), 0.0).sum(),
        "log_ratio": lr.sum(),
        "log_ratio_sq": lr.square().sum(),
        "weight": w.sum(),
        "weight_sq": w.square().sum(),
        "weighted": count(loss & (applied > 0)),
        "log_mass": torch.where(centered, kept.log_mass.double(), 0.0).sum(),
        "truncated": count(truncated),
        "masked": count(masked),
    }
    for name, flag in zip(_FRACTIONS[2:], sequence_flags, strict=True):
        out[name] = count(flag)
    if sums is not None:
        share = torch.where(centered, 1 / sums[:, 4].clamp_min(1), 0.0)
        out["samples"] = share.sum()
        out["seq_chi2"] = (share * torch.expm1(sums[:, 3])).sum()
    return ObjectiveMetrics(out | {name: value.clone() for name, value in kept.counts.items()})


def finish_metrics(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | tuple[str, ...]]:
    """Means from (summed) :func:`mismatch_sums` as 0-d float64 tensors, the counters passed
    through, and ``"not_computed"``: the names of the means left out (module doc). Reads the
    counts that decide it back in one host sync."""
    f64 = lambda name: sums[name].to(torch.float64)  # noqa: E731
    decide = [f64("tokens"), f64("rows_centered"), f64("weighted"), f64("weight_sq")]
    lag_keys = lag_counters(sums)
    decide += [f64(k) for k in lag_keys]
    if "samples" in sums:
        decide.append(f64("samples"))
    tokens, centered, weighted, weight_sq, *rest = torch.stack(decide).tolist()
    lag_counts, samples = dict(zip(lag_keys, rest, strict=False)), rest[len(lag_keys) :]
    out: dict[str, torch.Tensor | tuple[str, ...]] = {}
    skipped: list[str] = []
    if tokens > 0:
        mean = f64("log_ratio") / tokens
        spread = f64("log_ratio_sq") / tokens - mean.square()
        finite = torch.isfinite(mean) & torch.isfinite(spread)
        out["k1"] = f64("k1") / tokens
        out["k3"] = f64("k3") / tokens
        out["log_ratio_mean"] = mean
        # A log r of -inf (a trainer logprob of -inf) spreads them without bound.
        out["log_ratio_std"] = torch.where(finite, spread.clamp_min(0), torch.inf).sqrt()
        for name in _FRACTIONS:
            out[f"{name}_frac"] = f64(name) / tokens
    else:
        skipped += _PER_TOKEN
    if centered > 0:
        for name in _PER_CENTERED:
            out[name] = f64(name) / centered
    else:
        skipped += _PER_CENTERED
    if samples and samples[0] > 0:
        out["seq_chi2"] = f64("seq_chi2") / samples[0]
    else:
        skipped.append("seq_chi2")
    # Σ w² of float64 weights can under- or overflow where no float32 weight would.
    if weighted > 0 and 0 < weight_sq < float("inf"):
        out["ess"] = f64("weight").square() / (tokens * f64("weight_sq"))
    else:
        skipped.append("ess")
    out |= {k: v for k, v in sums.items() if k.startswith(_COUNTERS)}
    lags, lag_skipped = finish_lag_metrics(sums, lag_counts)
    out |= lags
    out["not_computed"] = tuple(sorted(skipped + lag_skipped))
    return ObjectiveMetrics(out)
