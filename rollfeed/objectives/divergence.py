"""Divergence terms in forms that do not cancel near on-policy (``p ≈ q``), never negative.

With ``d = log p − log q`` on the valid slots, ``Σ q = 1`` and ``Σ q·e^d = 1``:

- ``χ²(p‖q) = Σ p²/q − 1 = Σ q·(e^d − 1)²``: a sum of non-negative terms, each formed as
  ``exp(log q + 2·log|expm1(d)|)`` (no overflow of ``e^d`` where ``q`` is tiny);
- ``KL(q‖p) = Σ q·(−d) = Σ q·φ(d)`` with ``φ(x) = e^x − 1 − x ≥ 0``, a series for ``|x| < 0.1``
  (``e^x − 1 − x`` there loses ``~2ε/|x|`` of its digits) and ``exp(log q + d) − q·(1 + d)``
  (``= p − q − q·d``, no overflow) or ``q·(expm1(d) − d)`` beyond;
- ``k3 = r − 1 − log r = φ(log r)``.

The left-hand forms lose every digit once ``χ²`` or ``KL`` fall to ``ε·|S|`` (float32 rounding at
step 0 gave ``χ² = −3e−09``); these keep at least 10 digits in float64 down to ``|d| ≈ 1e−6``.

Example, float64: ``p = [0.5 + 1e-6, 0.5 − 1e-6]``, ``q = [0.5, 0.5]``: ``χ² = 4.0000000000e-12``
(the left form: ``3.99991e-12``), ``KL = 2.0000000000e-12`` (``Σ q (log q − log p)``:
``2.00001e-12``).
"""

from __future__ import annotations

import torch

_SERIES = 0.1
# 1/k! for k = 2..11: |x| < 0.1 leaves a relative error below 1e-16 after x^11.
_INV_FACTORIALS = (
    1 / 2,
    1 / 6,
    1 / 24,
    1 / 120,
    1 / 720,
    1 / 5040,
    1 / 40320,
    1 / 362880,
    1 / 3628800,
    1 / 39916800,
)


def _series(x: torch.Tensor) -> torch.Tensor:
    """``φ(x) / x² = Σ_{k≥2} x^(k−2) / k!`` for ``|x| < 0.1`` (Horner)."""
    acc = torch.full_like(x, _INV_FACTORIALS[-1])
    for c in reversed(_INV_FACTORIALS[:-1]):
        acc = acc * x + c
    return acc


def phi(x: torch.Tensor) -> torch.Tensor:
    """``e^x − 1 − x`` (``≥ 0``; ``inf`` once ``e^x`` overflows, never NaN for ``x ≥ −inf``)."""
    small = x.abs() < _SERIES
    xs = torch.where(small, x, 0.0)
    xb = torch.where(small, 1.0, x)
    return torch.where(small, xs * xs * _series(xs), torch.expm1(xb) - xb)


def q_phi(log_q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``q·φ(d)`` with ``q = exp(log_q)``, for ``log q + d ≤ 0`` (``p ≤ 1``): never overflows."""
    q = torch.exp(log_q)
    small = d.abs() < _SERIES
    ds = torch.where(small, d, 0.0)
    neg = torch.where(d < 0, d, -1.0)
    pos = torch.where(d > 0, d, 1.0)
    return torch.where(
        small,
        q * ds * ds * _series(ds),
        torch.where(d < 0, q * (torch.expm1(neg) - neg), torch.exp(log_q + pos) - q * (1 + pos)),
    )


def log_abs_expm1(x: torch.Tensor) -> torch.Tensor:
    """``log|e^x − 1|`` (``-inf`` at 0), without forming ``e^x`` for large ``x``."""
    pos = x > 0
    xp = torch.where(pos, x, 1.0)
    xn = torch.where(pos, -1.0, x)
    return torch.where(pos, xp + torch.log(-torch.expm1(-xp)), torch.log(-torch.expm1(xn)))
