"""Capture one completion: kept sets, mask logprobs and routing written once, segments returned.

:func:`capture_completion` is engine-independent (the vLLM adapter in
:mod:`rollfeed.capture.vllm_adapter` feeds it); it turns one request's outputs into the per-token
arrays a trainer sample needs plus payload segments, and never hands arrays of side channels on.

Coordinates: a *turn* starts at ``prompt_start`` of its request (0 for single-turn; the length of
the already-captured prefix for a later turn of a multi-turn rollout). Everything returned is
relative to that start, which is what :class:`~rollfeed.capture.Turn` expects:

    turn tokens   = prompt_ids[prompt_start:] + completion_ids        (length L)
    routed rows   at positions 0 .. L - 2                              (field routed_experts)
    mask rows     at positions new_prompt .. L - 1, one per completion token
                  (new_prompt = len(prompt_ids) - prompt_start)

Example: prompt ``[1, 2, 3]``, completion ``[7, 8]``, ``prompt_start=0`` -> token_ids
``[1, 2, 3, 7, 8]``, loss_mask ``[0, 0, 0, 1, 1]``, ``sampling_mask`` rows at positions 3 and 4,
``routed_experts`` rows at positions 0..3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rollfeed.capture.config import CaptureConfig
from rollfeed.capture.errors import CaptureError
from rollfeed.capture.kept_set import (
    CaptureMetrics,
    LogprobRows,
    support_from_logprob_rows,
    support_from_native_mask,
)
from rollfeed.capture.routing import align_routed_experts
from rollfeed.payload import PayloadSegment, PayloadWriter


@dataclass(frozen=True, kw_only=True, slots=True)
class CapturedCompletion:
    """One captured turn; every array is ``[L]`` over the turn's tokens (see module doc).

    token_ids: int64. loss_mask: bool (completion tokens, less repaired ones).
    inference_logprobs: float32, the sampler's logprob of each completion token (0 elsewhere).
    new_prompt_len: prompt tokens this turn adds. segments: payload records, turn-relative.
    metrics: counters of :class:`~rollfeed.capture.SupportCapture` plus ``routed_rows``.
    version_spans: ``[K, 3]`` int64 ``(start, end, version)``, turn-relative: the policy
    versions of the completion's tokens, none on the prompt (the sample's ``version_spans``).
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    inference_logprobs: np.ndarray
    new_prompt_len: int
    segments: tuple[PayloadSegment, ...]
    metrics: dict[str, int]
    version_spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))

    @property
    def length(self) -> int:
        return int(self.token_ids.size)


def capture_completion(
    writer: PayloadWriter,
    *,
    prompt_ids: Sequence[int] | np.ndarray,
    completion_ids: Sequence[int] | np.ndarray,
    logprobs: LogprobRows,
    config: CaptureConfig,
    routed_experts: np.ndarray | None = None,
    native_mask: Sequence[Sequence[int]] | None = None,
    prompt_start: int = 0,
    version_spans: np.ndarray | None = None,
) -> CapturedCompletion:
    """Write one completion's side channels with ``writer``; return arrays and segments.

    Args:
        prompt_ids: ``[P]`` the request's whole prompt. completion_ids: ``[C]`` sampled tokens.
        logprobs: ``C`` rows of processed logprobs (``config.requested`` asked per token).
        routed_experts: ``[P + C - 1 - prompt_start, layers, top_k]`` or None (not captured).
        native_mask: the engine's kept sets (``C`` lists), preferred over the logprob rows.
        prompt_start: first prompt position of this turn (``routed_experts_prompt_start``).
        version_spans: ``[K, 3]`` ``(start, end, version)`` over the completion's tokens
            (0 = the first sampled one;
            :func:`~rollfeed.capture.vllm_adapter.engine_version_spans`), or None: no version.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    completion = np.asarray(completion_ids, dtype=np.int64).reshape(-1)
    if not 0 <= prompt_start <= prompt.size:
        raise CaptureError(f"prompt_start {prompt_start} must lie in [0, {prompt.size}]")
    if native_mask is not None:
        support = support_from_native_mask(
            native_mask, completion, rows=logprobs, policy=config.policy
        )
    else:
        support = support_from_logprob_rows(
            logprobs, completion, requested=config.requested, policy=config.policy
        )
    new_prompt = prompt.size - prompt_start
    arrays: dict[str, np.ndarray | tuple[np.ndarray, np.ndarray]] = {
        "sampling_mask": (support.counts, support.ids)
    }
    pos = {"sampling_mask": new_prompt}
    if config.mask_logprobs:
        arrays["sampling_mask_logprobs"] = (support.counts, support.logprobs)
        pos["sampling_mask_logprobs"] = new_prompt
    metrics = CaptureMetrics(support.metrics, routed_rows=0)
    if routed_experts is not None:
        if config.num_experts is None:
            raise CaptureError("routed experts given but CaptureConfig.num_experts is not set")
        rows = align_routed_experts(
            routed_experts,
            prompt_len=prompt.size,
            completion_len=completion.size,
            num_experts=config.num_experts,
            prompt_start=prompt_start,
        )
        want = rows.dtype.name
        if want != "uint8" and writer.dtypes.get("routed_experts") != want:
            # Without it the writer picks uint8 for a request whose ids happen to be < 256.
            raise CaptureError(
                f"{config.num_experts} experts need routed_experts stored as {want} in every "
                "request; create the writer with dtypes=config.writer_dtypes"
            )
        arrays["routed_experts"], pos["routed_experts"] = rows, 0
        metrics["routed_rows"] = len(rows)
    segments = writer.write(arrays, pos, sampled=completion)
    loss_mask = np.concatenate([np.zeros(new_prompt, dtype=bool), support.trainable])
    logps = np.concatenate([np.zeros(new_prompt, np.float32), support.sampled_logprobs])
    spans = np.zeros((0, 3), np.int64) if version_spans is None else np.asarray(version_spans)
    spans = spans.astype(np.int64).reshape(-1, 3)
    if len(spans) and (spans[:, :2].min() < 0 or spans[:, :2].max() > completion.size):
        raise CaptureError(
            f"version spans {spans.tolist()[:4]} lie outside the completion's {completion.size} "
            "tokens"
        )
    return CapturedCompletion(
        token_ids=np.concatenate([prompt[prompt_start:], completion]),
        loss_mask=loss_mask,
        inference_logprobs=logps,
        new_prompt_len=new_prompt,
        segments=tuple(segments),
        metrics=metrics,
        version_spans=spans + np.array([new_prompt, new_prompt, 0], np.int64),
    )
