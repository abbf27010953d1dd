"""Inference side: the sampler's kept sets and routed experts, captured by handle; turn assembly.

A client of :mod:`rollfeed.payload` (it writes with :class:`~rollfeed.payload.PayloadWriter` and
hands out segment records). vLLM is imported only when asked for
(:func:`capture_sampling_params`, the route), so the pure conversions work without it.

- kept sets (:func:`support_from_logprob_rows`, :func:`support_from_native_mask`) and routed
  experts (:func:`align_routed_experts`) from engine outputs, pure NumPy;
- :func:`capture_completion`: one completion's side channels written, ``[L]`` arrays and segments
  returned; :class:`CaptureConfig` fixes what is captured and how strictly;
- the vLLM adapter (:func:`check_engine`, :func:`capture_sampling_params`,
  :func:`capture_request_output`);
- :func:`assemble_turns`: the turns of a multi-turn rollout stitched into one sample's payload,
  :func:`stitch_version_spans` their policy versions;
- serving (``python -m rollfeed serve``, :mod:`rollfeed.capture.server`): the capture route
  (:class:`CaptureRoute`; :class:`GenerateRequest` in, :class:`GenerateResponse` of
  :class:`CompletionRecord`\\ s out, :class:`ServerInfo`) in vLLM's OpenAI-compatible server
  (its client, which turns answers into samples and step files, is :mod:`rollfeed.orchestrator`);
  the same capture through vLLM's ``/v1/completions`` and ``/v1/chat/completions`` for a request
  that names a group in ``vllm_xargs`` (:class:`TurnCapture` in its answer; multi-turn
  conversations stitched into samples, :mod:`rollfeed.capture.conversations`);
- weights that change under the server: a trainer checkpoint (:func:`read_checkpoint`) loaded in
  place as a new policy version (:class:`WeightUpdater`, :class:`WeightsRequest` in,
  :class:`WeightsResponse` out), every sampled token stamped with the version that sampled it;
- :class:`CaptureError` and its family.
"""

from rollfeed.capture.checkpoint import Checkpoint, CheckpointError, read_checkpoint
from rollfeed.capture.completion import CapturedCompletion, capture_completion
from rollfeed.capture.config import CaptureConfig
from rollfeed.capture.errors import (
    CaptureError,
    CaptureModeError,
    CaptureRequestError,
    CaptureServerError,
    ModelPathError,
    RoutingShapeError,
    SamplingSettingsError,
    SupportBoundError,
    SupportMembershipError,
    TurnGapError,
    TurnPrefixError,
    TurnRangeError,
)
from rollfeed.capture.kept_set import (
    LogprobRows,
    SupportCapture,
    support_from_logprob_rows,
    support_from_native_mask,
)
from rollfeed.capture.protocol import (
    CompletionRecord,
    GenerateRequest,
    GenerateResponse,
    ServerInfo,
    TurnCapture,
    WeightsRequest,
    WeightsResponse,
)
from rollfeed.capture.route import CaptureRoute
from rollfeed.capture.routing import align_routed_experts, routed_dtype
from rollfeed.capture.turns import Turn, assemble_turns, stitch_version_spans
from rollfeed.capture.vllm_adapter import (
    capture_request_output,
    capture_sampling_params,
    check_engine,
    check_sampling_params,
    engine_version_spans,
    logprob_rows,
)
from rollfeed.capture.weights import WeightReloadError, WeightUpdater

__all__ = [
    "CaptureConfig",
    "CaptureError",
    "CaptureModeError",
    "CaptureRequestError",
    "CaptureRoute",
    "CaptureServerError",
    "CapturedCompletion",
    "Checkpoint",
    "CheckpointError",
    "CompletionRecord",
    "GenerateRequest",
    "GenerateResponse",
    "LogprobRows",
    "ModelPathError",
    "RoutingShapeError",
    "SamplingSettingsError",
    "ServerInfo",
    "SupportBoundError",
    "SupportCapture",
    "SupportMembershipError",
    "Turn",
    "TurnCapture",
    "TurnGapError",
    "TurnPrefixError",
    "TurnRangeError",
    "WeightReloadError",
    "WeightUpdater",
    "WeightsRequest",
    "WeightsResponse",
    "align_routed_experts",
    "assemble_turns",
    "capture_completion",
    "capture_request_output",
    "capture_sampling_params",
    "check_engine",
    "check_sampling_params",
    "engine_version_spans",
    "logprob_rows",
    "read_checkpoint",
    "routed_dtype",
    "stitch_version_spans",
    "support_from_logprob_rows",
    "support_from_native_mask",
]
