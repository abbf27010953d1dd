"""Version lag in the objectives: the mismatch metrics split by how stale a token is, and an
optional weight per lag.

A token's lag is ``step - version``: the trained step minus the policy version that sampled it
(``TensorMicroBatch.versions``, -1 where a token carries none). :class:`VersionLag` names the
step, the lags the metrics tell apart and, optionally, a weight per lag; given to
:func:`~rollfeed.objectives.policy_loss` with the versions, it

- splits the mismatch sums over the loss tokens into buckets ``lag0``, ``lag1``, ...,
  ``lag{lags - 1}`` and ``lag_older`` (every lag ``>= lags``): per bucket the counters
  ``<bucket>_tokens`` and ``<bucket>_centered`` and the sums of ``k1``, ``k3``, ``log r``,
  ``log² r``, ``kl``, ``chi2``, which :func:`~rollfeed.objectives.finish_metrics` turns into
  ``<bucket>_k1``, ``<bucket>_k3``, ``<bucket>_log_ratio_mean``, ``<bucket>_kl``,
  ``<bucket>_chi2`` (a bucket without a token, or without a centered one, names them in
  ``not_computed``); ``lag_none_tokens`` counts the loss tokens in none (no version, or one newer
  than the step). Every bucket is there on every rank, so the sums add over ranks as they are;
- with ``weights``, multiplies each loss token's whole term (the sampled token's and the
  centering correction) by the weight of its bucket: ``weights[b]`` for bucket ``b``, the last
  weight for every bucket past the tuple's end; a token in none keeps weight 1. A weight of 0
  takes the token out exactly (its term and gradient are 0 whatever its ratio), and it counts in
  ``ess`` and ``weighted`` as the applied weight it is.

On-policy data (every version the step, weight of lag 0 being 1, or no versions given) gives the
terms of the objective without it, bit for bit.

Example (training step 7, ``VersionLag(step=7, lags=2, weights=(1.0, 0.5, 0.0))``): loss tokens
of versions ``[7, 6, 4, -1]`` fall in ``lag0``, ``lag1``, ``lag_older`` and none, weighted
``1, 0.5, 0, 1``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rollfeed.objectives.errors import ObjectiveInputError

OLDER = "lag_older"
NONE_TOKENS = "lag_none_tokens"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VersionLag:
    """The trained ``step``, the ``lags`` the metrics tell apart and an optional weight per lag
    bucket (see the module doc)."""

    step: int
    lags: int = 3
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if type(self.step) is not int or self.step < 0:
            raise ObjectiveInputError(f"VersionLag.step must be an int >= 0, got {self.step!r}")
        if type(self.lags) is not int or not 1 <= self.lags <= 64:
            raise ObjectiveInputError(
                f"VersionLag.lags must be an int in [1, 64], got {self.lags!r}"
            )
        w = self.weights
        if w is not None and (
            not isinstance(w, tuple)
            or not w
            or not all(isinstance(x, int | float) and 0 <= x < math.inf for x in w)
        ):
            raise ObjectiveInputError(
                f"VersionLag.weights must be None or a non-empty tuple of finite numbers >= 0, "
                f"got {w!r}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The buckets, in order: ``lag0`` .. ``lag{lags - 1}``, ``lag_older``."""
        return (*(f"lag{k}" for k in range(self.lags)), OLDER)

    def buckets(self, versions: torch.Tensor, n: int) -> torch.Tensor:
        """``[n]`` int64 bucket of each row of ``versions [n]`` (integers), -1 for none."""
        if versions.shape != (n,) or versions.dtype.is_floating_point or versions.is_complex():
            raise ObjectiveInputError(
                f"versions must be [{n}] integers (mb.versions), got {versions.dtype} "
                f"{tuple(versions.shape)}",
                tensor="versions",
            )
        v = versions.to(torch.int64)
        lag = self.step - v
        on = (v >= 0) & (lag >= 0)
        return torch.where(on, lag.clamp(max=self.lags), -1)

    def log_weight(self, buckets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[n]`` log of each row's weight (0 in none; ``-inf`` for a weight of 0)."""
        if self.weights is None:
            return torch.zeros(buckets.shape, dtype=dtype, device=buckets.device)
        table = [math.log(x) if x > 0 else -math.inf for x in self.weights]
        table += [table[-1]] * (self.lags + 1 - len(table))
        logs = torch.tensor(table[: self.lags + 1], dtype=dtype, device=buckets.device)
        return torch.where(buckets >= 0, logs[buckets.clamp(min=0)], 0.0).to(dtype)


def lag_sums(
    lag: VersionLag,
    buckets: torch.Tensor,
    *,
    loss: torch.Tensor,
    centered: torch.Tensor,
    log_r: torch.Tensor,
    k3: torch.Tensor,
    kl: torch.Tensor,
    chi2: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The per-bucket sums of the module doc (``[N]`` inputs; ``log_r`` and ``k3`` float64 and
    0 off the loss, ``kl`` and ``chi2`` per centered row)."""
    out: dict[str, torch.Tensor] = {}
    for b, name in enumerate(lag.names):
        mine = loss & (buckets == b)
        here = centered & mine
        lr = torch.where(mine, log_r, 0.0)
        out[f"{name}_tokens"] = mine.sum(dtype=torch.int64)
        out[f"{name}_centered"] = here.sum(dtype=torch.int64)
        out[f"{name}_k1"] = -lr.sum()
        out[f"{name}_k3"] = torch.where(mine, k3, 0.0).sum()
        out[f"{name}_log_ratio"] = lr.sum()
        out[f"{name}_log_ratio_sq"] = lr.square().sum()
        out[f"{name}_kl"] = torch.where(here, kl, 0.0).sum()
        out[f"{name}_chi2"] = torch.where(here, chi2, 0.0).sum()
    out[NONE_TOKENS] = (loss & (buckets < 0)).sum(dtype=torch.int64)
    return out


def finish_lag_metrics(
    sums: dict[str, torch.Tensor], counts: dict[str, float]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(means, not computed)`` of the buckets in ``sums`` (``counts``: the buckets'
    ``_tokens`` and ``_centered`` counters, read back); the counters pass through."""
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name in _bucket_names(sums):
        tokens, centered = counts[f"{name}_tokens"], counts[f"{name}_centered"]
        f64 = lambda key, name=name: sums[f"{name}_{key}"].to(torch.float64)  # noqa: E731
        out[f"{name}_tokens"] = sums[f"{name}_tokens"]
        out[f"{name}_centered"] = sums[f"{name}_centered"]
        if tokens > 0:
            out[f"{name}_k1"] = f64("k1") / tokens
            out[f"{name}_k3"] = f64("k3") / tokens
            out[f"{name}_log_ratio_mean"] = f64("log_ratio") / tokens
        else:
            skipped += [f"{name}_k1", f"{name}_k3", f"{name}_log_ratio_mean"]
        if centered > 0:
            out[f"{name}_kl"] = f64("kl") / centered
            out[f"{name}_chi2"] = f64("chi2") / centered
        else:
            skipped += [f"{name}_kl", f"{name}_chi2"]
    if NONE_TOKENS in sums:
        out[NONE_TOKENS] = sums[NONE_TOKENS]
    return out, skipped


def lag_counters(sums: dict[str, torch.Tensor]) -> list[str]:
    """The counter keys :func:`finish_lag_metrics` needs read back."""
    return [f"{n}_{c}" for n in _bucket_names(sums) for c in ("tokens", "centered")]


def _bucket_names(sums: dict[str, torch.Tensor]) -> list[str]:
    return [k.removesuffix("_centered") for k in sums if is_lag_key(k) and k.endswith("_centered")]


def is_lag_key(key: str) -> bool:
    """Whether ``key`` is one of :func:`lag_sums`' (no other metric starts with ``lag``)."""
    return key.startswith("lag")
