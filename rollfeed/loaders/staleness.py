"""Staleness: how far behind the trained step a token's policy version is, and what a bound does.

A token's policy version ``v`` names the weights that sampled it: those a trainer trains step
``v`` with (after ``v`` optimizer steps; :mod:`rollfeed.collate.versions`). Training step ``k``,
its *lag* is ``k - v``: 0 for on-policy data, 1 for a sampler one step ahead of the trainer, and
both within one sample continued across a weight update. ``LoaderConfig(max_staleness=m)`` bounds
the lag, under one of three named policies (``on_stale``):

- ``"drop"``: a sample whose oldest version (the step index's, read at plan time without its
  record) lags more than ``m`` is not planned, counted in the plan's ``stale_dropped``;
- ``"mask"``: every sample is planned; in the micro batch its tokens that lag more than ``m`` leave
  ``loss_mask`` (:func:`mask_stale`), counted in ``stale_masked_tokens``. The step's loss-token
  counts (``step_counts``, the normalisation of :func:`rollfeed.objectives.aggregate`) stay the
  plan's: a masked token counts there as one whose term is 0, as a token an importance weight
  masks;
- ``"error"`` (the default): a step holding such a sample is a :class:`StaleSampleError`
  naming the step, the sample and its version, raised as the step is planned.

A version newer than the step (lag < 0) is never stale; it is counted (``tokens_lag_ahead``).

Example (training step 9, ``max_staleness=1``, three samples of oldest versions 9, 8 and 6)::

    stale_samples([9, 8, 6], 9, 1) -> [False, False, True]   # "drop" plans samples 0 and 1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from rollfeed.collate import Sample, TensorMicroBatch, token_versions
from rollfeed.loaders.errors import LoaderError

OnStale = Literal["drop", "mask", "error"]
ON_STALE: tuple[OnStale, ...] = ("drop", "mask", "error")


class StaleSampleError(LoaderError):
    """A sample's tokens lag the trained step by more than ``max_staleness`` under
    ``on_stale="error"`` (names the step, the sample and its oldest version)."""

    PLACE = (*LoaderError.PLACE, "version")


@dataclass(frozen=True, kw_only=True, slots=True)
class Staleness:
    """A bound on the lag (``max_staleness`` versions) and its policy (``on_stale``)."""

    max_staleness: int
    on_stale: OnStale


def stale_samples(versions: np.ndarray | Sequence[int], step: int, bound: int) -> np.ndarray:
    """``[n]`` bool: the samples whose oldest version (``versions [n]``, -1: none) lags ``step``
    by more than ``bound``."""
    v = np.asarray(versions, np.int64)
    return (v >= 0) & (step - v > bound)


def stale_error(step: int, sample: int, version: int, bound: int, file: str | None) -> LoaderError:
    """The error of ``on_stale="error"`` for ``sample`` (its index in its step) of ``version``."""
    return StaleSampleError(
        f"sample {sample} of step {step} holds tokens of policy version {version}, "
        f"{step - version} versions behind the step, more than max_staleness={bound}; pass "
        "on_stale='drop' (leave such samples out) or 'mask' (take their stale tokens out of the "
        "loss), or raise the bound",
        file=file,
        step=step,
        sample=sample,
        version=version,
    )


def mask_stale(tmb: TensorMicroBatch, *, step: int, bound: int) -> TensorMicroBatch:
    """``tmb`` with its labels of a version lagging ``step`` by more than ``bound`` out of
    ``loss_mask`` (every other tensor as it is)."""
    if tmb.versions is None:
        return tmb
    v = tmb.versions.to(torch.int64)
    stale = (v >= 0) & (step - v > bound)
    if not bool(stale.any()):
        return tmb
    return replace(tmb, loss_mask=tmb.loss_mask & ~stale)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LagCounts:
    """Loss tokens (label coordinates, after truncation, before a mask) of some micro batches by
    lag: ``by_lag [L]`` int64 (entry ``k``: tokens of lag ``k``), ``ahead`` (a version newer
    than the step), ``unversioned`` (no version), ``masked`` (taken out under ``"mask"``)."""

    by_lag: np.ndarray
    ahead: int = 0
    unversioned: int = 0
    masked: int = 0

    @classmethod
    def none(cls) -> LagCounts:
        return cls(by_lag=np.zeros(0, np.int64))

    def __add__(self, other: LagCounts) -> LagCounts:
        n = max(len(self.by_lag), len(other.by_lag))
        pad = lambda a: np.pad(a, (0, n - len(a)))  # noqa: E731
        return LagCounts(
            by_lag=pad(self.by_lag) + pad(other.by_lag),
            ahead=self.ahead + other.ahead,
            unversioned=self.unversioned + other.unversioned,
            masked=self.masked + other.masked,
        )


def lag_counts(
    samples: Sequence[Sample],
    kept: Sequence[int],
    *,
    step: int | None,
    staleness: Staleness | None,
) -> LagCounts:
    """The :class:`LagCounts` of ``samples`` kept to ``kept`` tokens each (their lengths in the
    micro batch), trained at ``step`` (``None``: not known, every loss token counts as
    unversioned)."""
    out = LagCounts.none()
    for sample, n in zip(samples, kept, strict=True):
        loss = sample.loss_mask[1:n]  # label j is token j + 1
        versions = token_versions(sample.version_spans, len(sample))[1:n][loss].astype(np.int64)
        has = versions >= 0 if step is not None else np.zeros(len(versions), bool)
        lags = (step or 0) - versions[has]
        masked = 0
        if staleness is not None and staleness.on_stale == "mask":
            masked = int((lags > staleness.max_staleness).sum())
        out = out + LagCounts(
            by_lag=np.bincount(lags[lags >= 0], minlength=0).astype(np.int64),
            ahead=int((lags < 0).sum()),
            unversioned=int((~has).sum()),
            masked=masked,
        )
    return out
