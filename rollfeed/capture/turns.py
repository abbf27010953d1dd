"""Turn assembly: stitch each turn's payload segments into one sample's payload.

A multi-turn rollout is one flat token sequence built from several inference requests. Turn ``k``
adds ``length`` tokens (its new prompt tokens, then its completion) starting at
``offset_k = sum of earlier lengths``; its segments carry positions relative to that start, in
``[0, length]``. Assembly shifts each turn's segments by its offset and applies two explicit,
counted rules to ``inputs``-window fields (routing, consumed at every forwarded position):

- ``final_token``: a turn's last sampled token is never forwarded by the engine, so it has no
  routing row. ``"fill"`` leaves it uncovered (it reads as fill); ``"repeat"`` adds a one-row
  segment pointing at the previous row's bytes (pure metadata, no I/O).
- ``gap``: a forwarded position ``[0, length - 1)`` of some turn that no segment of a field covers
  (including a turn that lacks the field while another has it). ``"drop"`` removes the field from
  the whole sample; ``"raise"`` raises :class:`TurnGapError`. Replayed and free routing are never
  mixed silently.

Other windows (``labels``, ``sequence``: masks exist only for sampled tokens) are only shifted.

Policy versions: each turn's ``version_spans`` (``(start, end, version)`` rows over its
completion, turn-relative like its segments) are shifted by the turn's offset into the sample's
(:func:`stitch_version_spans`); a multi-turn rollout whose turns ran under different weights
holds each turn's versions.

Worked example (routing, two turns of 4 and 3 tokens, each covering its forwarded positions)::

    turns = [Turn(length=4, segments=(r0,)),  # r0: pos=0, rows=3
             Turn(length=3, segments=(r1,))]  # r1: pos=0, rows=2
    assemble_turns(turns, final_token="repeat") ->
        [r0 (pos 0, rows 3), r0' (pos 3, rows 1, first=2), r1 (pos 4, rows 2), r1' (pos 6, first=1)]
        metrics {"turns": 2, "final_repeated": 2, "final_filled": 0, "gaps": 0, "fields_dropped": 0}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rollfeed.capture.errors import CaptureError, TurnGapError, TurnRangeError
from rollfeed.payload import (
    PAYLOAD_FIELDS,
    PayloadField,
    PayloadSegment,
    lookup_field,
    shift_segments,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """``length`` tokens added by one inference request; segments and policy ``version_spans``
    (``(start, end, version)`` rows) relative to their first token."""

    length: int
    segments: tuple[PayloadSegment, ...] = ()
    version_spans: tuple[tuple[int, int, int], ...] = ()


def stitch_version_spans(turns: Sequence[Turn]) -> np.ndarray:
    """``[K, 3]`` int64: every turn's version spans shifted into the sample, in token order.
    A turn's spans must be non-empty ``[start, end)`` ranges inside its ``length`` tokens, in
    order and apart (:class:`TurnRangeError` naming the turn otherwise)."""
    out, offset = [], 0
    for k, turn in enumerate(turns):
        spans = np.asarray(turn.version_spans, np.int64).reshape(-1, 3)
        prev = np.concatenate([[0], spans[:-1, 1]])
        bad = (spans[:, 0] < prev) | (spans[:, 0] >= spans[:, 1]) | (spans[:, 1] > turn.length)
        if bad.any():
            at = int(np.argmax(bad))
            raise TurnRangeError(
                f"turn {k}'s version span {spans[at].tolist()} is not a [start, end) range of "
                f"its {turn.length} tokens after the one before it",
                turn=k,
                pos=offset + int(spans[at, 0]),
            )
        out.append(spans + np.array([offset, offset, 0], np.int64))
        offset += turn.length
    return np.concatenate(out) if out else np.zeros((0, 3), np.int64)


def _first_gap(segs: list[PayloadSegment], end: int) -> int | None:
    """First position of ``[0, end)`` no segment covers, or None."""
    covered = 0
    for s in sorted((s for s in segs if s.rows), key=lambda s: s.pos):
        if s.pos > covered:
            return covered
        covered = max(covered, s.end)
        if covered >= end:
            return None
    return covered if covered < end else None


def assemble_turns(
    turns: Sequence[Turn],
    *,
    final_token: Literal["fill", "repeat"] = "fill",
    gap: Literal["drop", "raise"] = "drop",
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
) -> tuple[list[PayloadSegment], dict[str, int]]:
    """Shift and stitch the turns' segments; returns ``(segments, metrics)`` (see module doc)."""
    if final_token not in ("fill", "repeat"):
        raise CaptureError(f"final_token must be 'fill' or 'repeat', got {final_token!r}")
    if gap not in ("drop", "raise"):
        raise CaptureError(f"gap must be 'drop' or 'raise', got {gap!r}")
    metrics = {"turns": len(turns), "final_repeated": 0, "final_filled": 0, "gaps": 0}
    for k, turn in enumerate(turns):
        if isinstance(turn.length, bool) or not isinstance(turn.length, int) or turn.length < 1:
            raise TurnRangeError(
                f"turn {k} has length {turn.length!r}; a turn adds >= 1 token", turn=k
            )
        for s in turn.segments:
            lookup_field(s.field, fields)  # an unknown field is an UnknownFieldError naming it
            if s.pos < 0 or s.end > turn.length:
                raise TurnRangeError(
                    f"turn {k} segment rows [{s.pos}, {s.end}) lie outside its [0, {turn.length})",
                    turn=k,
                    field=s.field,
                )
    inputs = sorted(
        {s.field for t in turns for s in t.segments if fields[s.field].window == "inputs"}
    )
    dropped = set()
    extra: list[list[PayloadSegment]] = [[] for _ in turns]
    for name in inputs:
        pending, offset = [], 0
        for k, turn in enumerate(turns):
            mine = [s for s in turn.segments if s.field == name]
            hole = _first_gap(mine, turn.length - 1)
            if hole is not None:
                metrics["gaps"] += 1
                if gap == "raise":
                    raise TurnGapError(
                        f"turn {k} leaves a forwarded position without a row; pass gap='drop' to "
                        "train this sample without replay",
                        turn=k,
                        field=name,
                        pos=offset + hole,
                    )
                dropped.add(name)
            last = turn.length - 1
            if not any(s.pos <= last < s.end for s in mine):
                prev = [s for s in mine if s.pos <= last - 1 < s.end]
                if final_token == "repeat" and prev:
                    s = prev[0]
                    row = s.first + last - 1 - s.pos
                    pending.append((k, s.model_copy(update={"pos": last, "rows": 1, "first": row})))
                    metrics["final_repeated"] += 1
                else:
                    metrics["final_filled"] += 1
            offset += turn.length
        if name not in dropped:
            for k, seg in pending:
                extra[k].append(seg)
    if dropped:
        logger.debug("multi-turn assembly dropped inputs fields %s (coverage gaps)", dropped)
    out, offset = [], 0
    for turn, more in zip(turns, extra, strict=True):
        kept = [s for s in turn.segments if s.field not in dropped]
        out += shift_segments(sorted([*kept, *more], key=lambda s: (s.field, s.pos)), offset)
        offset += turn.length
    metrics["fields_dropped"] = len(dropped)
    return out, metrics
