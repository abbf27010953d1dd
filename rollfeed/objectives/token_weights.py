"""Token-level importance weights ``w(v)`` of ``r = p^S / q^S`` (both normalised over the kept set).

Four detached weights, each a frozen config:

- :class:`Unweighted`: ``w = 1``;
- :class:`TruncatedIS` (TIS): ``w = min(r, cap)``;
- :class:`MaskedIS` (MIS; IcePop is MIS with a two-sided band): ``w = r·1[low ≤ r ≤ high]``;
- :class:`TrustRegion`: ``w = min(r, cap)·1[|p^S − q^S| ≤ eps]`` (a probability trust region).

Each gives, from ``log p`` and ``log q`` (any shape):

- ``log_weight`` (e.g. :meth:`TruncatedIS.log_weight`): ``log w`` of the sampled token, with the
  truncated and masked masks;
- ``log_weighted_q``: ``log(q·w)``, the centering correction's weight, in forms that never
  exponentiate an unbounded ratio (TIS ``min(log p, log cap + log q)``, MIS ``log p`` in the band
  and ``-inf`` outside), so ``q·w <= max(1, cap)``;
- ``log_clip_factor``: ``log k`` with ``k = w / r`` (``k = 1`` for :class:`Unweighted`), what
  the weight adds to the PPO clip, whose surrogate already carries ``r``: TIS truncates
  (``min(1, cap / r)``), MIS and the trust region mask.

Worked example, ``p = 0.6, q = 0.2`` (``r = 3``): ``TruncatedIS(cap=2)``: ``w = 2``, ``q·w = 0.4``,
``k = 2/3``, truncated; ``MaskedIS(low=0.5, high=2)``: ``w = 0``, ``q·w = 0``, masked;
``TrustRegion(cap=2, eps=0.5)``: ``|p − q| = 0.4``, ``w = 2``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rollfeed.objectives.errors import ObjectiveInputError


def _log(x: float) -> float:
    return math.log(x) if x > 0 else float("-inf")


# ``(log w, truncated, masked)``, each shaped like ``log_p``.
_Weighed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _none(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Unweighted:
    """``w = 1``."""

    def log_weight(self, log_p: torch.Tensor, log_q: torch.Tensor) -> _Weighed:
        """``(log w, truncated, masked)`` for ``r = p / q`` (see the module doc)."""
        return torch.zeros_like(log_p), _none(log_p), _none(log_p)

    def log_weighted_q(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return log_q.clone()

    def log_clip_factor(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(log_p)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TruncatedIS:
    """``w = min(r, cap)``; ``cap = inf`` gives ``w = r`` (``q·w = p``)."""

    cap: float

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ObjectiveInputError(f"TruncatedIS cap must be > 0 (inf allowed), got {self.cap}")

    def log_weight(self, log_p: torch.Tensor, log_q: torch.Tensor) -> _Weighed:
        log_r = log_p - log_q
        truncated = log_r > _log(self.cap)
        return torch.clamp(log_r, max=_log(self.cap)), truncated, _none(log_p)

    def log_weighted_q(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return torch.minimum(log_p, log_q + _log(self.cap))

    def log_clip_factor(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return torch.clamp(_log(self.cap) - (log_p - log_q), max=0.0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MaskedIS:
    """``w = r·1[low ≤ r ≤ high]`` (MIS; IcePop with ``0 < low < 1 < high``); ``low = 0,
    high = inf`` gives ``w = r``."""

    low: float = 0.0
    high: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ObjectiveInputError(
                f"MaskedIS needs 0 <= low <= high, got low={self.low}, high={self.high}"
            )

    def _band(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        log_r = log_p - log_q
        return (log_r >= _log(self.low)) & (log_r <= _log(self.high))

    def log_weight(self, log_p: torch.Tensor, log_q: torch.Tensor) -> _Weighed:
        band = self._band(log_p, log_q)
        return torch.where(band, log_p - log_q, float("-inf")), _none(log_p), ~band

    def log_weighted_q(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return torch.where(self._band(log_p, log_q), log_p, float("-inf"))

    def log_clip_factor(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return torch.where(self._band(log_p, log_q), 0.0, float("-inf")).to(log_p.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrustRegion:
    """``w = min(r, cap)·1[|p − q| ≤ eps]``, ``p`` and ``q`` probabilities over the kept set."""

    eps: float
    cap: float = math.inf

    def __post_init__(self) -> None:
        if not self.eps >= 0 or not self.cap > 0:
            raise ObjectiveInputError(
                f"TrustRegion needs eps >= 0 and cap > 0, got eps={self.eps}, cap={self.cap}"
            )

    def _inside(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        return (torch.exp(log_p) - torch.exp(log_q)).abs() <= self.eps

    def log_weight(self, log_p: torch.Tensor, log_q: torch.Tensor) -> _Weighed:
        inside = self._inside(log_p, log_q)
        log_r = log_p - log_q
        truncated = inside & (log_r > _log(self.cap))
        log_w = torch.where(inside, torch.clamp(log_r, max=_log(self.cap)), float("-inf"))
        return log_w, truncated, ~inside

    def log_weighted_q(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        capped = torch.minimum(log_p, log_q + _log(self.cap))
        return torch.where(self._inside(log_p, log_q), capped, float("-inf"))

    def log_clip_factor(self, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        factor = torch.clamp(_log(self.cap) - (log_p - log_q), max=0.0)
        return torch.where(self._inside(log_p, log_q), factor, float("-inf"))


TokenWeight = Unweighted | TruncatedIS | MaskedIS | TrustRegion
TOKEN_WEIGHTS = (Unweighted, TruncatedIS, MaskedIS, TrustRegion)
