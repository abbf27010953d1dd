"""Policy versions: which trainer step's weights sampled each token, as spans of a sample.

A sample's ``version_spans`` is ``[K, 3]`` int64, one row ``(start, end, version)`` per run of
tokens ``[start, end)`` sampled under the weights of trainer step ``version``. Prompt and tool
tokens carry none (no span covers them). A rollout continued across a weight update (a partial
rollout) holds two spans, or more, over its completion. Rules (:func:`check_version_spans`,
typed :class:`~rollfeed.collate.errors.SampleValueError` naming the sample and the span's first
position):

- spans are non-empty, in token order and do not overlap (they may touch: a weight update
  between two tokens of one completion);
- they lie inside the sample's ``T`` tokens and never cover token 0 (a sample's first token is a
  prompt token: nothing sampled it, and it is never a label);
- a version is an int in ``[0, MAX_VERSION]`` (the micro batch holds versions as int32).

Versions travel with the tokens like every other per-token array: truncation clips the spans
(:func:`clip_version_spans`), turn stitching shifts them (:func:`shift_version_spans`) and the
micro batch holds one per position (:func:`token_versions`; label coordinates there, -1 where a
position carries none: :mod:`rollfeed.collate.tensor_batch`).

Worked example (a prompt of 3 tokens, then 5 sampled tokens, the last two after the weights of
step 8 replaced those of step 7)::

    spans = [[3, 6, 7], [6, 8, 8]]
    token_versions(spans, 8)      -> [-1, -1, -1, 7, 7, 7, 8, 8]
    clip_version_spans(spans, 5)  -> [[3, 5, 7]]
    oldest_version(spans)         -> 7
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollfeed.collate.errors import SampleDtypeError, SampleValueError

MAX_VERSION = (1 << 31) - 1  # versions are int32 in the micro batch
FIELD = "version_spans"
NO_VERSION = -1


def no_spans() -> np.ndarray:
    """``[0, 3]`` int64: a sample without versions."""
    return np.zeros((0, 3), np.int64)


def check_version_spans(value: Any, tokens: int, uid: str | None = None) -> np.ndarray:
    """``value`` (``None`` or ``[K, 3]`` integers) as checked ``[K, 3]`` int64 spans of a sample
    of ``tokens`` tokens (module doc); typed errors name the sample ``uid``."""
    if value is None:
        return no_spans()
    try:
        arr = np.asarray(value)
    except ValueError as err:
        raise SampleDtypeError(f"not an array: {err}", sample=uid, field=FIELD) from None
    if arr.size == 0:
        return no_spans()
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.dtype.kind not in "iu":
        raise SampleDtypeError(
            f"version spans are [K, 3] integers (start, end, version), got {arr.dtype} of shape "
            f"{arr.shape}",
            sample=uid,
            field=FIELD,
        )
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise SampleValueError("version spans hold integers beyond int64", sample=uid, field=FIELD)
    spans = np.ascontiguousarray(arr, np.int64)
    bad = misplaced_span(spans, tokens)
    if bad is not None:
        start, end, version = (int(v) for v in spans[bad])
        prev = int(spans[bad - 1, 1]) if bad else 0
        raise SampleValueError(
            f"version span {bad} [{start}, {end}) of version {version} is not a span of this "
            f"sample: spans are non-empty, in token order, apart (the one before ends at {prev}), "
            f"inside its {tokens} tokens and past token 0 (a prompt token), with a version in "
            f"[0, {MAX_VERSION}]",
            sample=uid,
            field=FIELD,
            pos=start,
        )
    return spans


def misplaced_span(spans: np.ndarray, tokens: int) -> int | None:
    """The first row of ``spans [K, 3]`` that breaks the module doc's rules for a sample of
    ``tokens`` tokens, or ``None`` when all hold."""
    if not len(spans):
        return None
    starts, ends, versions = spans[:, 0], spans[:, 1], spans[:, 2]
    prev = np.concatenate([[1], ends[:-1]])
    bad = (starts < prev) | (starts >= ends) | (ends > tokens)
    bad |= (versions < 0) | (versions > MAX_VERSION)
    return int(np.argmax(bad)) if bad.any() else None


def clip_version_spans(spans: np.ndarray, length: int) -> np.ndarray:
    """The spans of the first ``length`` tokens: spans past the cut go, one across it is cut."""
    kept = spans[spans[:, 0] < length].copy()
    kept[:, 1] = np.minimum(kept[:, 1], length)
    return kept


def shift_version_spans(spans: np.ndarray, offset: int) -> np.ndarray:
    """``spans`` moved ``offset`` tokens later (a turn's spans placed in its sample)."""
    out = np.asarray(spans, np.int64).reshape(-1, 3).copy()
    out[:, :2] += offset
    return out


def token_versions(spans: np.ndarray, tokens: int) -> np.ndarray:
    """``[tokens]`` int32: each token's version, :data:`NO_VERSION` where no span covers it."""
    out = np.full(tokens, NO_VERSION, np.int32)
    for start, end, version in spans.tolist():
        out[start:end] = version
    return out


def oldest_version(spans: np.ndarray) -> int | None:
    """The oldest version among the spans, ``None`` when there is none."""
    return int(spans[:, 2].min()) if len(spans) else None
