"""Divergence terms in forms that do not cancel near on-policy (``p ≈ q``), never negative.

With ``d = log p − log q`` on the valid slots, ``Σ q = 1`` and ``Σ q·e^d = 1``:

- ``χ²(p‖q) = Σ p²/q − 1 = Σ q·(e^d − 1)²``: a sum of non-negative terms, ``q·expm1(d)²``, or
  ``exp(log q + 2·log expm1(d))`` past ``d = 30`` (``e^d`` would overflow where ``q`` is tiny);
- ``KL(q‖p) = Σ q·(−d) = Σ q·φ(d)`` with ``φ(x) = e^x − 1 − x ≥ 0``: a series for ``|x| < 0.01``
  (``expm1(x) − x`` there loses ``~2ε/|x|`` of its digits), ``q·(expm1(d) − d)`` up to
  ``d = 30`` and ``exp(log q + d) − q·(1 + d)`` (``= p − q − q·d ≤ 1``) beyond;
- ``k3 = r − 1 − log r = φ(log r)``.

The left-hand forms lose every digit once ``χ²`` or ``KL`` fall to ``ε·|S|`` (float32 rounding at
step 0 gave ``χ² = −3e−09``); these keep at least 10 digits in float64 down to ``|d| ≈ 1e−6``.

Example, float64: ``p = [0.5 + 1e-6, 0.5 − 1e-6]``, ``q = [0.5, 0.5]``: ``χ² = 4.0000000000e-12``
(the left form: ``3.99991e-12``), ``KL = 2.0000000000e-12`` (``Σ q (log q − log p)``:
``2.00001e-12``).
"""

from __future__ import annotations

import torch

_SERIES = 0.01
_FAR = 30.0
# 1/k! for k = 2..7: below |x| = 0.01 the next term is 1e-16 of the sum.
_INV_FACTORIALS = (1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720, 1 / 5040)


def _series(x: torch.Tensor) -> torch.Tensor:
    """``φ(x) / x² = Σ_{k≥2} x^(k−2) / k!`` for ``|x| < 0.01`` (Horner)."""
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


def kl_chi2_terms(log_q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q·φ(d), q·expm1(d)²)`` per slot with ``q = exp(log_q)``, for ``log q + d ≤ 0``
    (``p ≤ 1``): both ``≥ 0``, no overflow but where ``χ²`` itself does not fit."""
    q = torch.exp(log_q)
    small = d.abs() < _SERIES
    far = d > _FAR
    ds = torch.where(small, d, 0.0)
    near = torch.where(far, 0.0, d)
    e = torch.expm1(near)
    df = torch.where(far, d, _FAR)
    kl = torch.where(far, torch.exp(log_q + df) - q * (1 + df), q * (e - near))
    kl = torch.where(small, q * ds * ds * _series(ds), kl)
    log_e = df + torch.log1p(-torch.exp(-df))
    chi2 = torch.where(far, torch.exp(log_q + 2 * log_e), q * e * e)
    return kl, chi2
