"""Mismatch metrics between the sampler and the trainer, as additive sums, then means.

:func:`mismatch_sums` gives 0-d tensors on the inputs' device (no host sync until read) that add
over micro batches and ranks (sum them over the dp and cp groups, e.g. one all-reduce of their
stack per step); :func:`finish_metrics` turns summed ones into means. Over the loss tokens:

- ``kl``: exact ``KL(q^S ‖ p^S) = Σ_valid q^S (log q^S − log p^S)`` per centered token;
- ``chi2``: exact ``χ²(p^S ‖ q^S) = Σ_valid (p^S)² / q^S − 1`` per centered token;
- ``k1``, ``k3``: at the sampled token, ``−log r`` and ``r − 1 − log r`` (``r = p^S(a)/q^S(a)``);
- ``log_ratio_mean``, ``log_ratio_std``: of ``log r``;
- ``seq_chi2``: per sample ``Π_t (1 + χ²_t) − 1`` over its centered tokens, the χ² of the
  sample's product of kept-set distributions, averaged over samples (a sample split over cp ranks
  counts once: each rank adds its share of the sample's loss tokens);
- ``truncated_frac``, ``masked_frac`` (the token weight), ``seq_truncated_frac``,
  ``seq_masked_frac``, ``seq_vetoed_frac`` (the sequence weight), fractions of loss tokens;
- ``ess``: ``(Σ w)² / (n·Σ w²)`` of the applied weights (:attr:`PolicyTerms.weight`);
- ``log_mass``: the sampler's log-mass on the valid slots before renormalising, per centered token;
- the counters of :class:`~rollfeed.objectives.KeptDistribution` (``rows_*``, ``slots_invalid``,
  ``duplicate_ids``), summed.

Example: two loss tokens, ``log r = [0.1, -0.3]`` -> ``k1 = 0.1``, ``log_ratio_mean = -0.1``,
``log_ratio_std = 0.2``; applied weights ``[1, 3]`` -> ``ess = 16 / (2·10) = 0.8``.
"""

from __future__ import annotations

import torch

from rollfeed.objectives.kept_distribution import KeptDistribution

_FRACTIONS = ("truncated", "masked", "seq_truncated", "seq_masked", "seq_vetoed")


def mismatch_sums(
    kept: KeptDistribution,
    *,
    log_r: torch.Tensor,
    log_chi2: torch.Tensor,
    applied: torch.Tensor,
    truncated: torch.Tensor,
    masked: torch.Tensor,
    sequence_flags: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sums: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The additive sums of the module doc (``[N]`` inputs, detached; ``sums [N, 4]`` the sample
    sums of ``(log r, 1, vetoed, log(1 + χ²))`` or None)."""
    loss, centered = kept.loss_mask, kept.centered
    dtype = kept.log_p.dtype
    lp, lq = kept.log_p.detach(), kept.log_q
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    kl_slot = torch.where(kept.valid, torch.exp(lq) * (lq - lp), zero)
    kl = torch.zeros(kept.n_rows, dtype=dtype, device=lp.device).index_add(0, kept.row, kl_slot)
    on = loss.to(dtype)
    ratio = torch.exp(log_r)
    out = {
        "tokens": loss.sum(dtype=torch.int64),
        "kl": torch.where(centered, kl, zero).sum(),
        "chi2": torch.where(centered, torch.expm1(log_chi2), zero).sum(),
        "k1": (-log_r * on).sum(),
        "k3": ((ratio - 1 - log_r) * on).sum(),
        "log_ratio": (log_r * on).sum(),
        "log_ratio_sq": (log_r.square() * on).sum(),
        "weight": applied.sum(),
        "weight_sq": applied.square().sum(),
        "log_mass": torch.where(centered, kept.log_mass, zero).sum(),
        "truncated": truncated.sum(dtype=torch.int64),
        "masked": masked.sum(dtype=torch.int64),
    }
    for name, flag in zip(_FRACTIONS[2:], sequence_flags, strict=True):
        out[name] = flag.sum(dtype=torch.int64)
    if sums is not None:
        share = torch.where(loss, 1 / sums[:, 1].clamp_min(1), zero)
        out["samples"] = share.sum()
        out["seq_chi2"] = (share * torch.expm1(sums[:, 3])).sum()
    return out | {name: value.clone() for name, value in kept.counts.items()}


def finish_metrics(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Means from (summed) :func:`mismatch_sums`; the counters pass through. 0-d tensors."""
    dtype = sums["kl"].dtype  # counts divide in the metrics' float dtype
    tokens = sums["tokens"].clamp_min(1).to(dtype)
    centered = sums["rows_centered"].clamp_min(1).to(dtype)
    mean = sums["log_ratio"] / tokens
    out = {
        "kl": sums["kl"] / centered,
        "chi2": sums["chi2"] / centered,
        "k1": sums["k1"] / tokens,
        "k3": sums["k3"] / tokens,
        "log_ratio_mean": mean,
        "log_ratio_std": (sums["log_ratio_sq"] / tokens - mean.square()).clamp_min(0).sqrt(),
        "ess": sums["weight"].square() / (tokens * sums["weight_sq"]).clamp_min(1e-300),
        "log_mass": sums["log_mass"] / centered,
    }
    for name in _FRACTIONS:
        out[f"{name}_frac"] = sums[name] / tokens
    if "samples" in sums:
        out["seq_chi2"] = sums["seq_chi2"] / sums["samples"].clamp_min(1e-300)
    counters = ("tokens", "rows_", "slots_invalid", "duplicate_ids")
    return out | {k: v for k, v in sums.items() if k.startswith(counters)}
