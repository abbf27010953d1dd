"""SequenceWeight: a per-sample weight of the sampled tokens' log-ratios ``log r_t``.

The statistic of a sample is ``Σ_t log r_t`` over its loss tokens (``statistic="sum"``: the
sequence ratio ``ρ``) or their mean (``"mean"``: the geometric mean ratio). Then:

- ``cap``: truncation, ``s = min(ρ, cap)`` (``exp(min(log ρ, log cap))``: never an unbounded
  exponent);
- ``band = (low, high)``: masking, ``s = 1[low ≤ ρ ≤ high]``;
- neither: ``s = 1``;
- ``veto``: the catastrophic-token veto, ``s = 0`` for a sample with any loss token whose
  ``r_t < veto``.

The weight is detached and multiplies the sampled token's policy term (never the centering
correction). Sums come from :func:`~rollfeed.objectives.sample_sums.sample_sums`, exact under
``cp``.

Example: a sample with ``log r = [0.2, -0.1, 0.5]``: ``"sum"`` gives ``log ρ = 0.6``
(``ρ = 1.822``), ``cap=1.5`` -> ``s = 1.5`` (truncated); ``"mean"`` gives ``log ρ = 0.2``
(``ρ = 1.221``), ``band=(0.5, 2)`` -> ``s = 1``; ``veto=0.95`` -> ``s = 0`` (``r = 0.905``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from rollfeed.objectives.errors import ObjectiveInputError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SequenceWeight:
    """A sample-level weight (module doc); at least one of ``cap``, ``band``, ``veto``."""

    statistic: Literal["sum", "mean"] = "sum"
    cap: float | None = None
    band: tuple[float, float] | None = None
    veto: float | None = None

    def __post_init__(self) -> None:
        if self.statistic not in ("sum", "mean"):
            raise ObjectiveInputError(
                f"SequenceWeight statistic must be 'sum' or 'mean', got {self.statistic!r}"
            )
        if self.cap is None and self.band is None and self.veto is None:
            raise ObjectiveInputError("SequenceWeight needs a cap, a band or a veto")
        if self.cap is not None and self.band is not None:
            raise ObjectiveInputError("SequenceWeight truncates (cap) or masks (band), not both")
        if self.cap is not None and not self.cap > 0:
            raise ObjectiveInputError(f"SequenceWeight cap must be > 0, got {self.cap}")
        if self.band is not None and not 0 <= self.band[0] <= self.band[1]:
            raise ObjectiveInputError(f"SequenceWeight band needs 0 <= low <= high: {self.band}")
        if self.veto is not None and not self.veto > 0:
            raise ObjectiveInputError(f"SequenceWeight veto must be > 0, got {self.veto}")

    def weigh(
        self, log_ratio_sum: torch.Tensor, tokens: torch.Tensor, vetoed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(s, truncated, masked, vetoed)`` per token from its sample's sums (``[N]`` each):
        the sum of ``log r``, the loss-token count and the count of vetoed tokens."""
        stat = log_ratio_sum
        if self.statistic == "mean":
            stat = log_ratio_sum / tokens.clamp_min(1)
        none = torch.zeros_like(stat, dtype=torch.bool)
        truncated = masked = none
        if self.cap is not None:
            log_cap = math.log(self.cap) if math.isfinite(self.cap) else math.inf
            weight = torch.exp(torch.clamp(stat, max=log_cap))
            truncated = stat > log_cap
        elif self.band is not None:
            low, high = self.band
            inside = (stat >= (math.log(low) if low > 0 else -math.inf)) & (
                stat <= (math.log(high) if math.isfinite(high) else math.inf)
            )
            weight, masked = inside.to(stat.dtype), ~inside
        else:
            weight = torch.ones_like(stat)
        hit = vetoed > 0 if self.veto is not None else none
        return torch.where(hit, 0.0, weight), truncated, masked, hit
