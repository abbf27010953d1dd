"""Step records as values: one sample's arrays, texts and segment records, and a step's index.

A :class:`StepRecord` is what a step record file holds per sample, whatever a sample is to the
layers above: its token ids ``[T]`` and a mask ``[T]`` (the tokens the index counts: its runs are
repeated there), named ``columns`` (arrays of any of the stored dtypes, per token or not),
``texts`` (name -> string), payload ``segments`` (:class:`~rollfeed.payload.PayloadSegment`), and
what the index keeps for planning: the oldest ``policy_version`` among its tokens (``None``: not
recorded), a ``group`` id and the ``shared_prefix`` tokens it shares with its group.

A :class:`StepRecordIndex` is a step's index as read (:mod:`rollfeed.payload.format.step_layout`):
per record ``[n]`` int64 columns and every record's mask runs.

Example::

    StepRecord(ids=np.array([5, 6, 7]), mask=np.array([0, 1, 1], bool),
               columns={"advantages": np.full(3, 0.5, np.float32)}, texts={"uid": "a"})
    index.tokens -> [3, ...];  index.runs_of(0) -> [[1, 3]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollfeed.payload.segment import PayloadSegment


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepRecord:
    """One record of a step record file; see the module doc."""

    ids: np.ndarray
    mask: np.ndarray
    columns: Mapping[str, np.ndarray] = field(default_factory=dict)
    texts: Mapping[str, str] = field(default_factory=dict)
    segments: Sequence[PayloadSegment] = ()
    spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    policy_version: int | None = None
    group: str | None = None
    shared_prefix: int = 0

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepRecordIndex:
    """A step's index: per record ``[n]`` int64 ``offsets``, ``sizes`` (bytes), ``tokens``,
    ``crc32c``, ``policy_version`` (-1: none), ``group`` (the group id's 64-bit hash as int64
    bits; 0: none) and ``shared`` (shared-prefix tokens); ``run_counts [n]`` and ``run_spans
    [R, 2]`` every record's mask runs, ``run_offsets [n + 1]`` where each record's begin;
    ``span_counts``, ``span_spans``, ``span_offsets`` the same of its marked spans."""

    offsets: np.ndarray
    sizes: np.ndarray
    tokens: np.ndarray
    crc32c: np.ndarray
    policy_version: np.ndarray
    group: np.ndarray
    shared: np.ndarray
    run_counts: np.ndarray
    run_spans: np.ndarray
    run_offsets: np.ndarray
    span_counts: np.ndarray
    span_spans: np.ndarray
    span_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def of_rows(cls, rows: np.ndarray, spans: np.ndarray, marked: np.ndarray) -> StepRecordIndex:
        """From the index's rows (``INDEX_ROW``), runs ``[R, 2]`` and marked spans ``[K, 2]``."""
        counts = rows["runs"].astype(np.int64)
        marks = rows["spans"].astype(np.int64)
        return cls(
            offsets=rows["offset"].astype(np.int64),
            sizes=rows["size"].astype(np.int64),
            tokens=rows["tokens"].astype(np.int64),
            crc32c=rows["crc32c"].astype(np.int64),
            policy_version=rows["policy_version"].astype(np.int64),
            group=rows["group"].view(np.int64).copy(),
            shared=rows["shared"].astype(np.int64),
            run_counts=counts,
            run_spans=np.asarray(spans, np.int64).reshape(-1, 2),
            run_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            span_counts=marks,
            span_spans=np.asarray(marked, np.int64).reshape(-1, 2),
            span_offsets=np.concatenate([[0], np.cumsum(marks)]).astype(np.int64),
        )

    def runs_of(self, i: int) -> np.ndarray:
        """``[r, 2]``: record ``i``'s mask runs."""
        return self.run_spans[self.run_offsets[i] : self.run_offsets[i + 1]]

    def marked_of(self, i: int) -> np.ndarray:
        """``[k, 2]``: record ``i``'s marked spans."""
        return self.span_spans[self.span_offsets[i] : self.span_offsets[i + 1]]
