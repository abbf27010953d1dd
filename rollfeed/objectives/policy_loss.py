"""policy_loss: per-token policy-gradient terms with score centering over the kept set.

Score centering (arXiv:2609.20807, "Score Centering Stabilizes Off-policy RL") subtracts from the
sampled token's score its expectation under the sampler's distribution over the kept set ``S``.
For a loss token ``t`` with sampled token ``a``, advantage ``A_t`` and detached weights::

    ℓ_t = −sg(A_t)·[ sg(s_t·w_a)·log p^S(a) − Σ_{v∈S} sg(q^S(v)·w_c(v))·log p^S(v) ]

``p^S(v) = exp(z_v − logsumexp_S z)`` is the trainer's, ``q^S`` the sampler's (renormalised over the
valid slots, :mod:`rollfeed.objectives.kept_distribution`), ``w`` the token weight of the sampled
token (:mod:`rollfeed.objectives.token_weights`, of ``r = p^S(a)/q^S(a)``), ``s_t`` the sample's
:class:`~rollfeed.objectives.SequenceWeight` (1 without one) and ``w_c`` the centering
correction's token weight (:class:`ScoreCentering`). With ``w_c(v) = r(v)`` the correction's
gradient is ``Σ_S ∇p^S = 0``: it recentres the score exactly when the sampler's ``q^S`` is
reweighted to the trainer's.

With :class:`PPOClip` the first term is the clipped surrogate instead,
``−sg(s_t·k_a)·min(r_a A_t, clip(r_a, 1 − ε_low, 1 + ε_high) A_t)`` with ``r_a`` carrying the
gradient and ``k = w / r`` what the token weight adds (:mod:`rollfeed.objectives.token_weights`).

The centering term applies to every centered loss token, also to those that a mask (MIS, IcePop,
the trust region, a sequence mask or veto) removes from the first term; singletons give 0.
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

import torch
import torch.distributed as dist

from rollfeed.objectives.errors import ObjectiveCompositionError, ObjectiveInputError
from rollfeed.objectives.kept_distribution import KeptDistribution
from rollfeed.objectives.mismatch import mismatch_sums
from rollfeed.objectives.sample_sums import sample_sums
from rollfeed.objectives.sequence_weights import SequenceWeight
from rollfeed.objectives.token_weights import TOKEN_WEIGHTS, TokenWeight, Unweighted


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
    token's weight, allowed only without a sequence weight and without the clip)."""

    weight: TokenWeight | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PolicyTerms:
    """Per-token terms ``[N]`` (0 off the loss tokens; the caller reduces them).

    loss: ``ℓ_t = policy + centering``. policy: the sampled token's term. centering: the
    correction (0 where not centered). weight: detached effective importance weight of the
    sampled token, ``s_t·w_a`` (with the clip ``s_t·k_a·r_a``). sequence_weight: ``s_t``.
    metrics: additive sums, name -> 0-d tensor (:func:`~rollfeed.objectives.finish_metrics`).
    """

    loss: torch.Tensor
    policy: torch.Tensor
    centering: torch.Tensor
    weight: torch.Tensor
    sequence_weight: torch.Tensor
    metrics: dict[str, torch.Tensor]


def policy_loss(
    kept: KeptDistribution,
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
) -> PolicyTerms:
    """The per-token terms of the module doc for ``N`` rows.

    Args:
        kept: the rows' kept-set distributions (:func:`~rollfeed.objectives.kept_distribution`).
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
    """
    weight = Unweighted() if weight is None else weight
    n = kept.n_rows
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
    bounds = positions is not None and cu_seqlens is not None
    if sequence is not None and not bounds:
        raise ObjectiveInputError(
            "a SequenceWeight needs the sample boundaries: positions=mb.positions, "
            "cu_seqlens=mb.cu_seqlens",
            tensor="positions",
        )
    cdt = kept.log_p.dtype
    loss = kept.loss_mask
    adv = advantages.detach().to(cdt)
    lp = logprobs.to(cdt)
    zero = torch.zeros((), dtype=cdt, device=lp.device)
    # Off the loss tokens the ratio is set to 1: an unbounded one there would turn the zero
    # gradient of a masked-out term into 0·inf.
    lp_on = torch.where(loss, lp, kept.log_q_label)
    log_r = lp_on.detach() - kept.log_q_label
    log_w, truncated, masked = weight.log_weight(lp_on.detach(), kept.log_q_label)

    chi2_slot = torch.where(kept.valid, torch.exp(2 * kept.log_p.detach() - kept.log_q), zero)
    chi2_plus = torch.zeros(n, dtype=cdt, device=lp.device).index_add(0, kept.row, chi2_slot)
    log_chi2 = torch.where(kept.centered, torch.log(torch.where(kept.centered, chi2_plus, 1)), 0)
    sums = None
    if bounds:
        veto = sequence.veto if sequence is not None else None
        vetoed = log_r < (math.log(veto) if veto is not None else -math.inf)
        columns = torch.stack([log_r, torch.ones_like(log_r), vetoed.to(cdt), log_chi2], 1)
        sums = sample_sums(columns, loss, positions=positions, cu_seqlens=cu_seqlens, group=group)
    if sequence is not None:
        s, seq_trunc, seq_mask, seq_veto = sequence.weigh(sums[:, 0], sums[:, 1], sums[:, 2])
    else:
        s = torch.ones_like(log_r)
        seq_trunc = seq_mask = seq_veto = torch.zeros_like(loss)

    if clip is None:
        w_a = torch.exp(log_w)
        policy = -adv * (s * w_a) * lp
        applied = s * w_a
    else:
        k_a = torch.exp(weight.log_clip_factor(lp_on.detach(), kept.log_q_label))
        ratio = torch.exp(lp_on - kept.log_q_label)
        bounded = torch.clamp(ratio, 1 - clip.eps_low, 1 + clip.high)
        policy = -(s * k_a) * torch.minimum(ratio * adv, bounded * adv)
        applied = s * k_a * ratio.detach()
    policy = torch.where(loss, policy, zero)
    applied = torch.where(loss, applied, zero)

    correction = torch.zeros(n, dtype=cdt, device=lp.device)
    if centering is not None:
        w_c = centering.weight if centering.weight is not None else weight
        on = kept.valid & kept.centered[kept.row]
        log_qw = w_c.log_weighted_q(kept.log_p.detach(), kept.log_q)
        qw = torch.where(on, torch.exp(log_qw), zero)
        correction = correction.index_add(0, kept.row, qw * kept.log_p)
        correction = torch.where(kept.centered, adv * correction, zero)

    metrics = mismatch_sums(
        kept,
        log_r=log_r,
        log_chi2=log_chi2,
        applied=applied,
        truncated=truncated & loss,
        masked=masked & loss,
        sequence_flags=(seq_trunc & loss, seq_mask & loss, seq_veto & loss),
        sums=sums,
    )
    return PolicyTerms(
        loss=policy + correction,
        policy=policy,
        centering=correction,
        weight=applied,
        sequence_weight=torch.where(loss, s, zero),
        metrics=metrics,
    )


def _named(centering: ScoreCentering | None) -> TokenWeight | None:
    return centering.weight if centering is not None else None
