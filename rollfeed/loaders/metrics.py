"""Per-step loader metrics: what the plan did to the step, what this rank got, how long it waited.

Whoever makes a micro batch (a worker, or the trainer's process without workers) measures it
there (:func:`measure`) and the facts travel with it, in the same delivery, so they can never
describe another micro batch. :class:`StepMetrics` adds up one pass (one step) as the trainer
takes its micro batches; ``RolloutLoader.metrics`` is its dict, plain Python numbers a trainer
logs as they are:

- the step's plan (the whole step, the same on every rank; ``plan_lengths``): ``step``,
  ``samples``, ``tokens`` (after truncation), ``truncated`` and ``truncated_tokens``, ``dropped``
  (samples left out: overlong under ``overlong="drop"``, or with nothing before an image the cut
  would split), ``truncated_before_image`` and ``dropped_at_image`` (of those truncated and
  dropped, the ones cut before an image: :mod:`rollfeed.collate.image_runs`),
  ``padding_fraction``, ``micro_steps``;
  the loss tokens it holds (label coordinates, after truncation: what every rank's ``loss_mask``
  holds together): ``loss_tokens``, ``samples_without_loss`` (planned samples left with no loss
  token, truncation included), ``micro_batches_without_loss`` (of the ``micro_steps * dp``
  micro batches of every rank, dummies included) and ``dummy_micro_batches``; under a staleness
  bound (:mod:`rollfeed.loaders.staleness`) ``stale_samples`` (samples whose oldest version lags
  the step by more than ``max_staleness``) and ``stale_dropped`` (of those, left out under
  ``"drop"``), both 0 without a bound; what ``on_reshard`` did as a pass from a restored mid-step
  state started (:mod:`rollfeed.loaders.state`), both 0 on an ordinary pass:
  ``reshard_restarted`` (1: the state's count could not be held to this plan of the step, its
  file rewritten or the state saved under another world shape or plan, and ``"restart_step"``
  trained the step from its start) and ``reshard_skipped`` (steps whose rest the pass went past:
  under ``"next_step"``, or a step file gone);
- this rank's micro batches handed out so far in the pass: ``micro_batches``, ``rank_samples``,
  ``rank_tokens`` (real tokens of their whole rows), ``payload_bytes`` (bytes of the fields read by
  handle, this rank's windows at their stored dtype), ``make_s`` (seconds spent reading and
  collating them), of which ``samples_s`` reading their samples (the step records; from an
  object store a GET per block of the step file), ``read_ahead`` (of them, made before the
  loader asked: a worker's :mod:`~rollfeed.loaders.read_ahead`), and the kept-set (support)
  width distribution over this rank's rows that hold one (``sampling_mask``): ``support_rows``,
  ``support_width_mean``, ``support_width_p50`` / ``_p90`` / ``_p99``, ``support_width_max`` (0
  when there is none); the staleness distribution
  of their loss tokens (whole rows, label coordinates, before a mask): ``tokens_lag0``,
  ``tokens_lag1``, ... up to the largest lag seen (the step minus the token's policy version),
  ``tokens_lag_ahead`` (a version newer than the step), ``tokens_unversioned`` (none), and
  ``stale_masked_tokens`` (those taken out of the loss under ``on_stale="mask"``);
- the trainer-visible wait, the time spent inside ``next``: ``wait_s`` (total), ``wait_max_s``, and
  of ``wait_s`` the part before the micro batch was made, ``wait_making_s``, and after it,
  ``wait_handover_s`` (transfer from the worker, receive, pinning, the device copy).

Example (two micro batches with support widths ``[1, 1, 3]`` and ``[2]``; training step 5 on
loss tokens of versions ``[5, 5, 4]`` and ``[3]``)::

    support_rows 4, support_width_mean 1.75, support_width_p50 1, support_width_max 3
    tokens_lag0 2, tokens_lag1 1, tokens_lag2 1, tokens_lag_ahead 0, tokens_unversioned 0

The keys ``kept_rows`` and ``kept_width_*`` were renamed ``support_rows`` and ``support_width_*``:
until the next release the dict still reads them, with a ``DeprecationWarning``
(:class:`LoaderMetrics`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from rollfeed.collate import RaggedRows, Sample, TensorMicroBatch
from rollfeed.deprecation import RenamedKeys
from rollfeed.loaders.staleness import LagCounts, lag_counts
from rollfeed.payload import PAYLOAD_FIELDS

PLAN_KEYS = (
    "samples",
    "tokens",
    "truncated",
    "truncated_tokens",
    "dropped",
    "truncated_before_image",
    "dropped_at_image",
    "padding_fraction",
    "micro_steps",
    "loss_tokens",
    "samples_without_loss",
    "micro_batches_without_loss",
    "dummy_micro_batches",
    "stale_samples",
    "stale_dropped",
    "reshard_restarted",
    "reshard_skipped",
)


class LoaderMetrics(RenamedKeys):
    """``loader.metrics``: a dict of plain numbers (module doc) that still reads the renamed
    ``kept_*`` keys, with a warning."""

    owner = "loader.metrics"
    renamed: ClassVar[Mapping[str, str]] = {
        "kept_rows": "support_rows",
        **{f"kept_width_{s}": f"support_width_{s}" for s in ("mean", "p50", "p90", "p99", "max")},
    }


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MicroBatchFacts:
    """What the maker of one micro batch measured.

    ``kept_widths [W + 1]`` int64: how many of this rank's rows hold a kept set of ``w`` ids
    (``w = 0``: no kept set). ``lags``: its loss tokens by lag. ``made_at``:
    ``time.monotonic()`` when it was made (one clock for every process of a host).
    ``samples_s``: of ``make_s``, reading the samples; ``ahead``: made by a worker's read-ahead
    before the loader asked for it.
    """

    samples: int
    tokens: int
    payload_bytes: int
    kept_widths: np.ndarray
    lags: LagCounts
    make_s: float
    made_at: float
    samples_s: float = 0.0
    ahead: bool = False


def measure(
    tmb: TensorMicroBatch, samples: Sequence[Sample], *, started: float, samples_s: float = 0.0
) -> MicroBatchFacts:
    """The facts of ``tmb``, made from ``samples`` since ``started`` (``time.monotonic()``), which
    took ``samples_s`` to read; the lags from the step and the staleness bound ``samples`` were
    planned with."""
    by_handle = {seg.field for s in samples for seg in s.payload}
    kept = [name for name in tmb.fields if _kept_set(name)]  # the sampling mask's ids
    support = tmb.fields[kept[0]] if kept else None
    widths = np.zeros(1, np.int64)
    if isinstance(support, RaggedRows) and support.n_rows:
        widths = np.bincount(support.lengths().numpy())
    elif support is not None and support.numel():
        widths = np.bincount((support >= 0).sum(dim=1).numpy())
    lags = lag_counts(
        samples,
        tmb.seq_lens.tolist(),
        step=getattr(samples, "step", None),
        staleness=getattr(samples, "staleness", None),
    )
    now = time.monotonic()
    return MicroBatchFacts(
        samples=tmb.num_samples,
        tokens=int(tmb.seq_lens.sum()),
        payload_bytes=sum(t.nbytes for name, t in tmb.fields.items() if name in by_handle),
        kept_widths=widths,
        lags=lags,
        make_s=now - started,
        made_at=now,
        samples_s=samples_s,
    )


def _kept_set(name: str) -> bool:
    """Whether field ``name`` holds kept sets of token ids (declared ``label="omitted"``)."""
    spec = PAYLOAD_FIELDS.get(name)
    return spec is not None and spec.ragged and spec.label == "omitted"


class StepMetrics:
    """One pass's metrics, added up micro batch by micro batch; see the module doc."""

    def __init__(self, step: int, plan: Mapping[str, float]) -> None:
        self.step, self.plan = step, {k: plan[k] for k in PLAN_KEYS}
        self.counts = dict.fromkeys(
            ("micro_batches", "rank_samples", "rank_tokens", "payload_bytes", "read_ahead"), 0
        )
        self.seconds = dict.fromkeys(
            ("make_s", "samples_s", "wait_s", "wait_max_s", "wait_making_s", "wait_handover_s"),
            0.0,
        )
        self.widths = np.zeros(1, np.int64)
        self.lags = LagCounts.none()

    def add(self, facts: MicroBatchFacts, *, asked: float, handed: float) -> None:
        """One micro batch handed out: ``next`` was called at ``asked`` and returned at
        ``handed`` (``time.monotonic()``)."""
        c, s = self.counts, self.seconds
        c["micro_batches"] += 1
        c["rank_samples"] += facts.samples
        c["rank_tokens"] += facts.tokens
        c["payload_bytes"] += facts.payload_bytes
        c["read_ahead"] += facts.ahead
        wait = handed - asked
        making = min(max(facts.made_at - asked, 0.0), wait)
        s["make_s"] += facts.make_s
        s["samples_s"] += facts.samples_s
        s["wait_s"] += wait
        s["wait_max_s"] = max(s["wait_max_s"], wait)
        s["wait_making_s"] += making
        s["wait_handover_s"] += wait - making
        w = facts.kept_widths
        if len(w) > len(self.widths):
            self.widths = np.pad(self.widths, (0, len(w) - len(self.widths)))
        self.widths[: len(w)] += w
        self.lags = self.lags + facts.lags

    def as_dict(self) -> LoaderMetrics:
        rows = self.widths[1:]
        held = int(rows.sum())
        out = LoaderMetrics({"step": self.step, **self.plan, **self.counts, **self.seconds})
        out["support_rows"] = held
        if held:
            cum = np.cumsum(rows)
            width = np.arange(1, len(self.widths))
            out["support_width_mean"] = float((rows * width).sum() / held)
            for q in (50, 90, 99):  # the smallest width with at least q% of the rows at or below
                out[f"support_width_p{q}"] = int(width[np.searchsorted(cum, held * q / 100)])
            out["support_width_max"] = int(width[np.flatnonzero(rows)[-1]])
        else:
            out.update(dict.fromkeys(("support_width_mean", "support_width_p50"), 0))
            out.update(dict.fromkeys(("support_width_p90", "support_width_p99"), 0))
            out["support_width_max"] = 0
        lags = self.lags
        by_lag = lags.by_lag.tolist() or [0]
        out.update({f"tokens_lag{k}": int(n) for k, n in enumerate(by_lag)})
        out["tokens_lag_ahead"], out["tokens_unversioned"] = lags.ahead, lags.unversioned
        out["stale_masked_tokens"] = lags.masked
        return out
