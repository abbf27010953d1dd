"""policy_loss: per-token policy-gradient terms with score centering over the kept set.

Score centering (arXiv:2609.20807, "Score Centering Stabilizes Off-policy RL") subtracts from the
sampled token's score its expectation under the sampler's distribution over the kept set ``S``.
For a loss token ``t`` with sampled token ``a``, advantage ``A_t`` and detached weights::

    ℓ_t = −sg(A_t)·[ sg(s_t·w_a)·log p^S(a) − Σ_{v∈S} sg(q^S(v)·w_c(v))·log p^S(v) ]

``p^S(v) = exp(z_v − logsumexp_S z)`` is the trainer's, ``q^S`` the sampler's (renormalised over the
valid slots, :mod:`rollfeed.objectives.support_distribution`), ``w`` the token weight of the sampled
token (:mod:`rollfeed.objectives.token_weights`, of ``r = p^S(a)/q^S(a)``), ``s_t`` the sample's
:class:`~rollfeed.objectives.SequenceWeight` (1 without one) and ``w_c`` the centering
correction's token weight (:class:`ScoreCentering`). With ``w_c(v) = r(v)`` the correction's
gradient is ``Σ_S ∇p^S = 0``: it recentres the score exactly when the sampler's ``q^S`` is
reweighted to the trainer's.

With :class:`PPOClip` the first term is the clipped surrogate instead,
``−sg(s_t·k_a)·min(r_a A_t, clip(r_a, 1 − ε_low, 1 + ε_high) A_t)`` with ``r_a`` carrying the
gradient and ``k = w / r`` what the token weight adds (:mod:`rollfeed.objectives.token_weights`).

A token whose weight is 0 (``w = 0``, ``k = 0`` or ``s_t = 0``) adds exactly 0 to the first term
and to every gradient, whatever its ratio: each factor is formed in log space (``log s + log w``,
``log s + log k + log r``) and selected before it is exponentiated, so an overflowing ratio never
meets a 0 weight (a ``torch.where`` after ``exp`` would still put ``0·inf = NaN`` into the
gradient). Only an unbounded weight can overflow (the clip of a negative advantage without a cap,
``TruncatedIS(cap=inf)``, ``MaskedIS(high=inf)``, an uncapped sequence weight): a loss token whose
term or gradient does not fit the dtype raises
:class:`~rollfeed.objectives.ObjectiveOverflowError`. Tokens without a sampler logprob are out of
``distribution.loss_mask`` (dropped and counted by
:func:`~rollfeed.objectives.support_distribution`).

With the policy versions of the tokens (``versions=mb.versions`` and ``lag=VersionLag(step=k)``,
:mod:`rollfeed.objectives.version_lag`) the mismatch metrics are split by version lag, and a
per-lag weight ``λ_t`` (``VersionLag(weights=...)``) multiplies the token's whole term
``λ_t·ℓ_t``, formed in log space as the other weights are (``λ_t = 0`` is an exact 0).

The centering term applies to every centered loss token, also to those that a mask (MIS, IcePop,
the trust region, a sequence mask or veto) removes from the first term; singletons give 0. A loss
token it cannot center (no kept set, or no mask logprobs for two or more ids) is an
:class:`~rollfeed.objectives.ObjectiveMissingInputError` unless ``ScoreCentering(missing="skip")``.
Centering with a sequence weight or the clip needs ``ScoreCentering(weight=...)``: the correction's
``w_c`` is then a choice, so it must be named (:class:`ObjectiveCompositionError`); otherwise
``w_c = w``.

Worked example (one token, ``A = 1``, ``Unweighted``, centering): ``S = {a, b}``,
``p^S = [0.5, 0.5]``, ``q^S = [0.8, 0.2]`` -> ``ℓ = −log 0.5 + 0.8·log 0.5 + 0.2·log 0.5 = 0`` in
value, and ``∂ℓ/∂z_a = −(1 − 0.5) + (0.8 − 0.5) = −0.2``, ``∂ℓ/∂z_b = 0.2`` (the plain score gives
``−0.5`` and ``0.5``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.distributed as dist

from rollfeed.deprecation import renamed_keywords
from rollfeed.objectives.divergence import phi
from rollfeed.objectives.errors import ObjectiveCompositionError, ObjectiveInputError
from rollfeed.objectives.mismatch import mismatch_sums, row_divergences
from rollfeed.objectives.policy_checks import position_checks, verify
from rollfeed.objectives.sample_sums import sample_sums
from rollfeed.objectives.sequence_weights import SequenceWeight
from rollfeed.objectives.support_checks import not_a_logprob
from rollfeed.objectives.support_distribution import SupportDistribution
from rollfeed.objectives.token_weights import TOKEN_WEIGHTS, TokenWeight, Unweighted
from rollfeed.objectives.version_lag import VersionLag, lag_sums

MISSING = ("error", "skip")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PPOClip:
    """The PPO clipped surrogate's range ``[1 − eps_low, 1 + eps_high]`` (``eps_high`` defaults
    to ``eps_low``)."""

    eps_low: float = 0.2
    eps_high: float | None = None

    def __post_init__(self) -> None:
        high = self.eps_low if self.eps_high is None else self.eps_high
        if not 0 <= self.eps_low < 1 or not high >= 0:
            raise ObjectiveInputError(
                f"PPOClip needs 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {high}"
            )

    @property
    def high(self) -> float:
        return self.eps_low if self.eps_high is None else self.eps_high


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScoreCentering:
    """Score centering's correction; ``weight`` is its token weight ``w_c`` (None: the sampled
    token's weight, allowed only without a sequence weight and without the clip).

    ``missing``: what a loss token without an input centering needs does (its kept set, or, for
    a kept set of two or more ids, a valid mask logprob): ``"error"`` (the default) raises
    :class:`~rollfeed.objectives.ObjectiveMissingInputError` naming the field and how to write
    it; ``"skip"`` leaves it uncentered, counted in ``rows_no_support`` /
    ``rows_no_mask_logprobs`` (with no centered token at all, ``kl``, ``chi2``, ``log_mass`` and
    ``seq_chi2`` are not computed)."""

    weight: TokenWeight | None = None
    missing: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        if self.missing not in MISSING:
            raise ObjectiveInputError(
                f"ScoreCentering missing must be one of {MISSING}, got {self.missing!r}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyTerms:
    """Per-token terms ``[N]`` (0 off the loss tokens; the caller reduces them).

    loss: ``ℓ_t = policy + centering``. policy: the sampled token's term. centering: the
    correction (0 where not centered). weight: detached effective weight of the sampled token's
    term, ``s_t·w_a`` (the term is ``−A·weight·log p^S(a)``; with the clip ``s_t·k_a`` times
    ``r_a`` where the surrogate follows the ratio and ``1 ± ε`` where the clip holds it, so the
    term is ``−A·weight``). sequence_weight: ``s_t``. metrics: additive sums, name -> 0-d
    tensor (:func:`~rollfeed.objectives.finish_metrics`).
    """

    loss: torch.Tensor
    policy: torch.Tensor
    centering: torch.Tensor
    weight: torch.Tensor
    sequence_weight: torch.Tensor
    metrics: dict[str, torch.Tensor]


@renamed_keywords("policy_loss", kept="distribution")
def policy_loss(
    distribution: SupportDistribution,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    weight: TokenWeight | None = None,
    clip: PPOClip | None = None,
    sequence: SequenceWeight | None = None,
    centering: ScoreCentering | None = None,
    positions: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    versions: torch.Tensor | None = None,
    lag: VersionLag | None = None,
) -> PolicyTerms:
    """The per-token terms of the module doc for ``N`` rows; reads its value checks back in one
    host sync (:mod:`rollfeed.objectives.policy_checks`).

    Args:
        distribution: the rows' kept-set (support) distributions
            (:func:`~rollfeed.objectives.support_distribution`).
        logprobs: ``[N]`` trainer ``log p^S(a)`` of the sampled tokens, with gradient (the
            scorer's label logprobs: over the kept set, or the full vocabulary on fallback rows).
        advantages: ``[N]``.
        weight: the sampled token's token weight ``w`` (None: :class:`Unweighted`).
        clip: the PPO clip, or None for the plain score ``log p^S(a)``.
        sequence: a sample-level weight (needs ``positions`` and ``cu_seqlens``).
        centering: score centering, or None.
        positions, cu_seqlens: the micro batch's sample boundaries (``mb.positions``,
            ``mb.cu_seqlens``); given, the sample-level sums (sequence weight, sequence χ²) are
            exact over ``group`` (the ``cp`` group) with one all-reduce per call.
        versions, lag: ``[N]`` the policy version of each row (``mb.versions``, -1: none) and
            the trained step with its lag buckets and weights (:class:`VersionLag`); both or
            neither.
    """
    weight = Unweighted() if weight is None else weight
    n = distribution.n_rows
    if logprobs.shape != (n,) or advantages.shape != (n,):
        raise ObjectiveInputError(
            f"logprobs and advantages must be [{n}], got {tuple(logprobs.shape)} and "
            f"{tuple(advantages.shape)}",
            tensor="logprobs",
        )
    for name, value in (("weight", weight), ("centering.weight", _named(centering))):
        if value is not None and not isinstance(value, TOKEN_WEIGHTS):
            raise ObjectiveInputError(
                f"{name} must be one of {[t.__name__ for t in TOKEN_WEIGHTS]}, got "
                f"{type(value).__name__}"
            )
    if centering is not None and centering.weight is None and (clip or sequence):
        raise ObjectiveCompositionError(
            "score centering with a "
            + ("sequence-level weight" if sequence else "PPO clip")
            + " needs its correction's token weight named: ScoreCentering(weight=Unweighted()) "
            "or TruncatedIS / MaskedIS / TrustRegion"
        )
    if (versions is None) != (lag is None):
        raise ObjectiveInputError(
            "versions and lag come together: versions=mb.versions, lag=VersionLag(step=k) (the "
            "step being trained)",
            tensor="versions",
        )
    if lag is not None and not isinstance(lag, VersionLag):
        raise ObjectiveInputError(f"lag must be a VersionLag, got {type(lag).__name__}")
    buckets = None if lag is None else lag.buckets(versions.to(logprobs.device), n)
    bounds = positions is not None and cu_seqlens is not None
    if sequence is not None and not bounds:
        raise ObjectiveInputError(
            "a SequenceWeight needs the sample boundaries: positions=mb.positions, "
            "cu_seqlens=mb.cu_seqlens",
            tensor="positions",
        )
    cdt = distribution.log_p.dtype
    loss = distribution.loss_mask
    zero = torch.zeros((), dtype=cdt, device=logprobs.device)
    neg_inf = torch.full((), -math.inf, dtype=cdt, device=logprobs.device)
    given_adv = advantages.detach().to(cdt)
    given_lp = logprobs.to(cdt)
    # Off the loss every input is a neutral number (advantage 0, ratio 1): no term there may
    # put a NaN or an inf into a gradient, and each weight is formed in log space and selected
    # before it is exponentiated (a 0 weight times an overflowing ratio is a NaN gradient).
    adv = torch.where(loss, given_adv, zero)
    log_q = torch.where(loss, distribution.log_q_label, zero)
    lp = torch.where(loss, given_lp, log_q)
    log_r = lp - log_q
    log_r_d = log_r.detach()
    log_w, truncated, masked = weight.log_weight(lp.detach(), log_q)
    log_lag = None if lag is None or lag.weights is None else lag.log_weight(buckets, cdt)
    if log_lag is not None:
        log_w = log_w + log_lag

    kl, chi2 = row_divergences(distribution)
    sums = None
    bad_positions = torch.zeros_like(loss)
    bad_bounds = torch.zeros((), dtype=torch.bool, device=loss.device)
    if bounds:
        veto = sequence.veto if sequence is not None else None
        vetoed = log_r_d < (math.log(veto) if veto is not None else -math.inf)
        ones, centered = torch.ones_like(kl), distribution.centered.double()
        columns = torch.stack(
            [log_r_d.double(), ones, vetoed.double(), torch.log1p(chi2), centered], 1
        )
        sums = sample_sums(columns, loss, positions=positions, cu_seqlens=cu_seqlens, group=group)
        bad_positions, bad_bounds = position_checks(positions, cu_seqlens)
    if sequence is not None:
        s, seq_trunc, seq_mask, seq_veto = sequence.weigh(sums[:, 0], sums[:, 1], sums[:, 2])
        log_s = torch.log(s).to(cdt)
        s = s.to(cdt)
    else:
        log_s = torch.zeros_like(log_r_d)
        s = torch.ones_like(log_r_d)
        seq_trunc = seq_mask = seq_veto = torch.zeros_like(loss)

    if clip is None:
        log_factor = torch.where(loss, log_s + log_w, neg_inf)
        keep = log_factor > -math.inf
        factor = torch.where(keep, torch.exp(torch.where(keep, log_factor, zero)), zero)
        policy = torch.where(keep, -adv * factor * lp, zero)
    else:
        low, high = math.log1p(-clip.eps_low), math.log1p(clip.high)
        # The surrogate follows r (with its gradient) inside the clip's side for the sign of A,
        # else the bound, constant: min(r A, clip(r) A) without forming an unbounded r.
        follow = torch.where(adv >= 0, log_r_d <= high, log_r_d >= low)
        chosen = torch.where(follow, log_r, log_r_d.clamp(low, high))
        log_k = weight.log_clip_factor(lp.detach(), log_q)
        if log_lag is not None:
            log_k = log_k + log_lag
        log_factor = torch.where(loss, log_s + log_k, neg_inf)
        keep = log_factor > -math.inf
        factor = torch.where(keep, torch.exp(torch.where(keep, log_factor + chosen, zero)), zero)
        policy = -adv * factor
    applied = factor.detach()

    correction = torch.zeros(n, dtype=cdt, device=logprobs.device)
    no_support = no_mask_logprobs = torch.zeros_like(loss)
    if centering is not None:
        w_c = centering.weight if centering.weight is not None else weight
        on = distribution.valid & distribution.centered[distribution.row]
        log_qw = w_c.log_weighted_q(distribution.log_p.detach(), distribution.log_q)
        qw = torch.where(on, log_qw, neg_inf).exp()
        correction = correction.index_add(0, distribution.row, qw * distribution.log_p)
        correction = torch.where(distribution.centered, adv * correction, zero)
        if log_lag is not None:  # a weight of 0 leaves an exact 0, whatever the correction
            correction = torch.where(log_lag > -math.inf, log_lag.exp() * correction, zero)
        if centering.missing == "error":
            no_support, no_mask_logprobs = distribution.no_support, distribution.no_mask_logprobs

    terms = policy + correction
    verify(
        logprobs=given_lp,
        advantages=given_adv,
        bad_logprobs=loss & not_a_logprob(given_lp.detach()),
        bad_advantages=loss & ~torch.isfinite(given_adv),
        positions=positions,
        cu_seqlens=cu_seqlens,
        bad_positions=bad_positions,
        bad_bounds=bad_bounds,
        no_support=no_support,
        no_mask_logprobs=no_mask_logprobs,
        overflow=loss & ~(torch.isfinite(terms.detach()) & torch.isfinite(adv * factor.detach())),
        log_ratio=log_r_d,
    )
    metrics = mismatch_sums(
        distribution,
        kl=kl,
        chi2=chi2,
        log_r=log_r_d,
        applied=applied,
        truncated=truncated & loss,
        masked=masked & loss,
        sequence_flags=(seq_trunc & loss, seq_mask & loss, seq_veto & loss),
        sums=sums,
    )
    if lag is not None:
        metrics.update(
            lag_sums(
                lag,
                buckets,
                loss=loss,
                centered=distribution.centered,
                log_r=torch.where(loss, log_r_d.double(), 0.0),
                k3=torch.where(loss, phi(torch.where(loss, log_r_d.double(), 0.0)), 0.0),
                kl=kl,
                chi2=chi2,
            )
        )
    return PolicyTerms(
        loss=terms,
        policy=policy,
        centering=correction,
        weight=applied,
        sequence_weight=torch.where(loss, s, zero),
        metrics=metrics,
    )


def _named(centering: ScoreCentering | None) -> TokenWeight | None:
    return centering.weight if centering is not None else None
