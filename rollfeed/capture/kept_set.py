"""Kept sets: the ids each completion token was sampled from, with their logprobs (pure NumPy).

**Kept set from processed logprobs.** With ``logprobs_mode="processed_logprobs"`` and
``logprobs=k``, vLLM returns for each completion token the ``k`` best entries of the distribution
it actually sampled from (after temperature, top-k, top-p, min-p), plus the sampled token; ids the
filters removed come back as ``-inf`` and the finite entries sum to probability 1. The kept set
``S`` of a token is therefore its finite entries, provided the capture asked for more entries than
``S`` can hold: ask ``k = top_k + 1``, and a row whose ``k`` entries are all finite may have been
cut by the capture bound (ties at the top-k boundary do this) — a *bound* row.

Policies for a row the trainer cannot replay exactly (``policy``):

- ``"error"``: raise (:class:`SupportMembershipError`, :class:`SupportBoundError`);
- ``"repair"``: keep the sample, take the token out of the loss (``trainable = False``) and count
  it; a sampled id missing from its kept set is added to it, so a trainer never meets a label
  outside its support.

Worked example (``top_k=2``, ``requested=3``)::

    row 0: ids [7, 3, 9]  logprobs [-0.4, -1.1, -inf]  sampled 7
           -> S = [3, 7] (ids ascending), mask logprobs [-1.1, -0.4], sampled logprob -0.4
    row 1: ids [5, 7, 2]  logprobs [-0.2, -1.9, -2.5]  sampled 5
           -> 3 of 3 finite: a bound row (S may hold more ids than were returned)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from rollfeed.capture.errors import CaptureError, SupportBoundError, SupportMembershipError
from rollfeed.deprecation import RenamedKeys

Policy = Literal["error", "repair"]
POLICIES: tuple[Policy, ...] = ("error", "repair")


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobRows:
    """Returned logprob entries of ``C`` completion tokens, as CSR.

    offsets: ``[C + 1]`` int64; row ``i`` is entries ``offsets[i]:offsets[i + 1]``.
    token_ids: ``[n]`` int64. logprobs: ``[n]`` float64 (``-inf`` for filtered ids).
    """

    offsets: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray

    def __post_init__(self) -> None:
        off = np.asarray(self.offsets, dtype=np.int64)
        ids = np.asarray(self.token_ids, dtype=np.int64)
        lps = np.asarray(self.logprobs, dtype=np.float64)
        if off.ndim != 1 or off.size < 1 or off[0] != 0 or (np.diff(off) < 0).any():
            raise CaptureError("logprob row offsets must start at 0 and never decrease")
        if not (ids.shape == lps.shape == (int(off[-1]),)):
            raise CaptureError(
                f"logprob rows need {int(off[-1])} ids and logprobs, got {ids.shape} "
                f"and {lps.shape}"
            )
        object.__setattr__(self, "offsets", off)
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "logprobs", lps)

    @property
    def num_rows(self) -> int:
        return self.offsets.size - 1

    @classmethod
    def from_dicts(cls, rows: Sequence[Mapping[int, Any] | None]) -> LogprobRows:
        """From a list of ``{token_id: logprob}`` per token (values: floats or ``.logprob``)."""
        ids: list[int] = []
        lps: list[float] = []
        offsets = [0]
        for row in rows:
            for tid, value in (row or {}).items():
                ids.append(int(tid))
                lps.append(float(getattr(value, "logprob", value)))
            offsets.append(len(ids))
        return cls(offsets=np.asarray(offsets), token_ids=np.asarray(ids), logprobs=np.asarray(lps))


class CaptureMetrics(RenamedKeys):
    """The capture's counters; ``kept_ids``, renamed ``support_ids``, still reads (with a
    ``DeprecationWarning``) until the next release."""

    owner = "metrics"
    renamed: ClassVar[Mapping[str, str]] = {"kept_ids": "support_ids"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SupportCapture:
    """Kept sets of ``C`` completion tokens, ready for the payload writer.

    counts: ``[C]`` int64 kept ids per token; ids: ``[sum(counts)]`` int32 (ascending per row);
    logprobs: ``[sum(counts)]`` float32, the sampler's logprob of each kept id (mask logprobs);
    sampled_logprobs: ``[C]`` float32, the sampler's logprob of the sampled token (0 where unknown);
    trainable: ``[C]`` bool, False for rows a repair took out of the loss;
    metrics: ``rows``, ``support_ids`` (the kept ids of all rows), ``singleton_rows``,
    ``rows_not_member``, ``rows_bound``, ``rows_repaired`` (:class:`CaptureMetrics`).
    """

    counts: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray
    sampled_logprobs: np.ndarray
    trainable: np.ndarray
    metrics: dict[str, int]


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise CaptureError(f"capture policy must be one of {POLICIES}, got {policy!r}")


def _first_per_row(row: np.ndarray, hit: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """``[n]``: per row, the value at its first ``hit`` entry, ``-inf`` where none."""
    out = np.full(n, -np.inf)
    idx = np.flatnonzero(hit)[::-1]  # reversed so the first entry of a row is written last
    out[row[idx]] = values[idx]
    return out


def _first_occurrence(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[n]`` bool: the entry is the first of its (row, id) pair."""
    order = np.lexsort((ids, row))  # stable: among equal pairs the earliest entry comes first
    first = np.ones(row.size, dtype=bool)
    first[1:] = (row[order][1:] != row[order][:-1]) | (ids[order][1:] != ids[order][:-1])
    out = np.empty(row.size, dtype=bool)
    out[order] = first
    return out


def _finish(
    row: np.ndarray,
    ids: np.ndarray,
    lps: np.ndarray,
    sampled_lp: np.ndarray,
    trainable: np.ndarray,
    metrics: dict[str, int],
) -> SupportCapture:
    """Sort entries by (row, id), drop repeated ids of a row, and count."""
    n = trainable.size
    keep = _first_occurrence(row, ids)
    row, ids, lps = row[keep], ids[keep], lps[keep]
    order = np.lexsort((ids, row))
    row, ids, lps = row[order], ids[order], lps[order]
    counts = np.bincount(row, minlength=n).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise CaptureError(f"token ids must lie in [0, 2**31), got [{ids.min()}, {ids.max()}]")
    metrics.update(
        rows=n,
        support_ids=int(counts.sum()),
        singleton_rows=int((counts == 1).sum()),
        rows_repaired=int((~trainable).sum()),
    )
    return SupportCapture(
        counts=counts,
        ids=ids.astype(np.int32),
        logprobs=lps.astype(np.float32),
        sampled_logprobs=np.where(np.isfinite(sampled_lp), sampled_lp, 0.0).astype(np.float32),
        trainable=trainable,
        metrics=CaptureMetrics(metrics),
    )


def _sampled(sampled: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    arr = np.asarray(sampled, dtype=np.int64).reshape(-1)
    if arr.size != n:
        raise CaptureError(f"{arr.size} sampled tokens for {n} logprob rows; give one per token")
    return arr


def support_from_logprob_rows(
    rows: LogprobRows,
    sampled: Sequence[int] | np.ndarray,
    *,
    requested: int,
    policy: Policy = "error",
) -> SupportCapture:
    """Kept sets from processed-logprob rows (see the module doc for the rule and an example).

    Args:
        rows: ``C`` rows of returned entries (:class:`LogprobRows`).
        sampled: ``[C]`` the sampled token of each row.
        requested: entries asked per token (``SamplingParams.logprobs``, at least top_k + 1); a row
            with this many finite entries is a bound row.
        policy: ``"error"`` or ``"repair"`` for rows whose sampled token is not in its finite
            entries and for bound rows.
    """
    _check_policy(policy)
    if requested < 2:
        raise CaptureError(f"requested logprobs must be >= 2 (top_k + 1), got {requested}")
    n = rows.num_rows
    sampled = _sampled(sampled, n)
    row = np.repeat(np.arange(n), np.diff(rows.offsets))
    ids, lps = rows.token_ids, rows.logprobs
    # An id may repeat within a row (the sampled one, in flat outputs): count it once.
    finite = np.isfinite(lps) & _first_occurrence(row, ids)
    n_finite = np.bincount(row[finite], minlength=n)
    is_sampled = ids == sampled[row]
    member = np.bincount(row[finite & is_sampled], minlength=n) > 0
    sampled_lp = _first_per_row(row, is_sampled, lps, n)
    bound = n_finite >= requested
    metrics = {"rows_not_member": int((~member).sum()), "rows_bound": int(bound.sum())}
    if policy == "error" and not member.all():
        i = int(np.argmin(member))
        kept = ids[row == i][finite[row == i]].tolist()
        raise SupportMembershipError(
            f"sampled token {int(sampled[i])} is not among the finite (kept) entries {kept} of "
            f"completion token {i}; use policy='repair' to take such tokens out of the loss",
            token=i,
        )
    if policy == "error" and bound.any():
        i = int(np.argmax(bound))
        raise SupportBoundError(
            f"all {int(n_finite[i])} returned logprobs of completion token {i} are finite, so its "
            f"kept set may exceed the {requested} requested; ask for more logprobs than top_k "
            "(and use logprobs_mode='processed_logprobs'), or policy='repair'",
            token=i,
        )
    missing = np.flatnonzero(~member)
    return _finish(
        np.concatenate([row[finite], missing]),
        np.concatenate([ids[finite], sampled[missing]]),
        np.concatenate([lps[finite], sampled_lp[missing]]),
        sampled_lp,
        member & ~bound,
        metrics,
    )


def support_from_native_mask(
    mask: Sequence[Sequence[int]],
    sampled: Sequence[int] | np.ndarray,
    *,
    rows: LogprobRows,
    policy: Policy = "error",
) -> SupportCapture:
    """Kept sets from the engine's own sampling mask (``CompletionOutput.sampling_mask``).

    ``mask[i]`` lists the ids that survived the filters for completion token ``i`` (complete, so
    there are no bound rows); mask logprobs and the sampled logprob are looked up in ``rows``
    (ask ``top_k + 1`` processed logprobs). A kept id absent from ``rows`` gets ``-inf`` and is
    counted in ``mask_logprobs_missing``.

    Example: ``mask=[[4, 9]]``, ``sampled=[9]``, rows ``{9: -0.1, 4: -2.4, 1: -inf}``
    -> ``ids [4, 9]``, ``logprobs [-2.4, -0.1]``, ``sampled_logprobs [-0.1]``.
    """
    _check_policy(policy)
    n = len(mask)
    if rows.num_rows != n:
        raise CaptureError(f"{n} sampling-mask rows but {rows.num_rows} logprob rows")
    sampled = _sampled(sampled, n)
    counts = np.fromiter((len(m) for m in mask), dtype=np.int64, count=n)
    ids = np.fromiter((int(t) for m in mask for t in m), dtype=np.int64, count=int(counts.sum()))
    row = np.repeat(np.arange(n), counts)
    member = np.bincount(row[ids == sampled[row]], minlength=n) > 0
    # Look each (row, id) up among the returned entries: one sorted search over combined keys.
    lrow = np.repeat(np.arange(n), np.diff(rows.offsets))
    found, lps = np.zeros(ids.size, dtype=bool), np.full(ids.size, -math.inf)
    if rows.token_ids.size and ids.size:
        width = int(max(ids.max(), rows.token_ids.max())) + 1
        keys = lrow * width + rows.token_ids
        order = np.argsort(keys, kind="stable")
        want = row * width + ids
        at = np.searchsorted(keys[order], want).clip(max=keys.size - 1)
        found = keys[order][at] == want
        lps = np.where(found, rows.logprobs[order][at], -math.inf)
    sampled_lp = _first_per_row(lrow, rows.token_ids == sampled[lrow], rows.logprobs, n)
    metrics = {
        "rows_not_member": int((~member).sum()),
        "rows_bound": 0,
        "mask_logprobs_missing": int((~found).sum()),
    }
    if policy == "error" and not member.all():
        i = int(np.argmin(member))
        raise SupportMembershipError(
            f"sampled token {int(sampled[i])} is not in the engine's sampling mask "
            f"{list(mask[i])} of completion token {i}; use policy='repair' to take such tokens "
            "out of the loss",
            token=i,
        )
    missing = np.flatnonzero(~member)
    return _finish(
        np.concatenate([row, missing]),
        np.concatenate([ids, sampled[missing]]),
        np.concatenate([lps, sampled_lp[missing]]),
        sampled_lp,
        member.copy(),
        metrics,
    )
