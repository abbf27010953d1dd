"""The demo's loss: the PPO clip, a token-level correction and score centering, each a flag.

Per loss token, from :mod:`rollfeed.objectives` (``r = p^S(a) / q^S(a)``, both over the kept set;
``A`` the advantage)::

    clip only          ℓ = −min(r A, clip(r, 1 − ε, 1 + ε) A)               (Schulman et al., 2017)
    + correction w     ℓ = −k·min(r A, clip(r) A),  k = w / r  (TIS truncates, IcePop masks)
    + centering        ℓ += sg(A)·Σ_{v∈S} sg(q^S(v)·w(v))·log p^S(v)      (arXiv:2609.20807)
    no clip            ℓ = −sg(A)·sg(w_a)·log p^S(a) (+ centering)

The step's loss is ``Σ ℓ / N`` over every loss token of every rank, ``N`` the step's count
(:func:`rollfeed.objectives.aggregate`, ``token_mean``, from the counts each micro batch carries).
The corrections are fixed configurations of the library's weights (:data:`CORRECTIONS`): ``none``
(``w = 1``), ``tis`` (``min(r, 2)``), ``icepop`` (``r·1[0.5 ≤ r ≤ 2]``), ``trust``
(``min(r, 2)·1[|p − q| ≤ 0.2]``). Centering uses the correction's own weight as its ``w_c``.

Worked example, clip only, ``ε = 0.2``, one rank (rows without mask logprobs, so ``q`` is the
sampler's ``inference_logprobs``)::

    log p − log q  [0.0, 0.5, -0.5]   A [1.0, 1.0, -2.0]   N 3
    ℓ              [-1.0, -1.2 (r clipped to 1.2), 1.6 (r clipped to 0.8)]
    loss           (-1.0 - 1.2 + 1.6) / 3 = -0.2; d loss / d log p = [-1/3, 0, 0]
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rollfeed.collate import TensorMicroBatch
from rollfeed.models import SupportScores
from rollfeed.objectives import (
    MaskedIS,
    PolicyTerms,
    PPOClip,
    ScoreCentering,
    TokenWeight,
    TruncatedIS,
    TrustRegion,
    Unweighted,
    VersionLag,
    micro_batch_rows,
    policy_loss,
    support_distribution,
)

CORRECTIONS: dict[str, TokenWeight] = {
    "none": Unweighted(),
    "tis": TruncatedIS(cap=2.0),
    "icepop": MaskedIS(low=0.5, high=2.0),
    "trust": TrustRegion(eps=0.2, cap=2.0),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoObjective:
    """The demo's flags: ``clip_eps`` (0: no clip), ``correction`` (a :data:`CORRECTIONS` key),
    ``centering``."""

    clip_eps: float = 0.2
    correction: str = "tis"
    centering: bool = True

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {sorted(CORRECTIONS)}")

    def describe(self) -> str:
        """``"clip ε 0.2 + tis + centering"``."""
        parts = [f"clip ε {self.clip_eps:g}"] if self.clip_eps > 0 else ["no clip"]
        parts += [self.correction] if self.correction != "none" else []
        return " + ".join(parts + (["centering"] if self.centering else []))

    def terms(
        self,
        mb: TensorMicroBatch,
        scores: SupportScores,
        *,
        cp_group: dist.ProcessGroup | None,
        step: int | None = None,
    ) -> PolicyTerms:
        """Per-token terms ``[N]`` of this rank's rows (``scores`` from ``score(mb,
        return_support_logprobs=True)``). With the trained ``step`` the mismatch metrics are
        also split by version lag (``lag0_k3``, ``lag1_k3``, ...; a micro batch without
        versions counts its tokens in none); the terms are the same."""
        weight = CORRECTIONS[self.correction]
        versions, lag = None, None
        if step is not None:
            lag = VersionLag(step=step, lags=2)
            versions = mb.versions
            if versions is None:
                versions = torch.full_like(mb.labels, -1, dtype=torch.int32)
        support, mask = micro_batch_rows(mb)
        kept = support_distribution(
            support,
            scores.support_logprobs,
            mask,
            labels=mb.labels,
            loss_mask=mb.loss_mask,
            inference_logprobs=mb.inference_logprobs,
        )
        return policy_loss(
            kept,
            scores.logprobs[mb.positions],
            mb.advantages,
            weight=weight,
            clip=PPOClip(eps_low=self.clip_eps) if self.clip_eps > 0 else None,
            centering=ScoreCentering(weight=weight) if self.centering else None,
            positions=mb.positions,
            cu_seqlens=mb.cu_seqlens,
            group=cp_group,
            versions=versions,
            lag=lag,
        )
