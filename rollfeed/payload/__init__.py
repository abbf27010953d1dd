"""Bytes <-> handles: per-token side channels written once, passed around as segment records."""

from rollfeed.payload.capture import (
    LogprobRows,
    SupportCapture,
    align_routed_experts,
    routed_dtype,
    support_from_logprob_rows,
    support_from_native_mask,
)
from rollfeed.payload.capture_errors import (
    CaptureError,
    CaptureModeError,
    RoutingShapeError,
    SamplingSettingsError,
    SupportBoundError,
    SupportMembershipError,
)
from rollfeed.payload.capture_writer import CaptureConfig, CapturedCompletion, capture_completion
from rollfeed.payload.errors import (
    PayloadDtypeError,
    PayloadError,
    PayloadHeaderError,
    PayloadIndexError,
    PayloadInputError,
    PayloadIOError,
    PayloadMissingFileError,
    PayloadPathError,
    PayloadRegionError,
    PayloadSegmentError,
    PayloadStaleFileError,
    PayloadTruncatedError,
    PayloadWidthError,
    UnknownFieldError,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field, register_field
from rollfeed.payload.layout import ragged_bytes
from rollfeed.payload.reader import read_field
from rollfeed.payload.root import PayloadRoot
from rollfeed.payload.segment import PayloadSegment, RaggedLayout, clip_segments, shift_segments
from rollfeed.payload.vllm_capture import (
    capture_request_output,
    capture_sampling_params,
    check_engine,
    check_sampling_params,
    logprob_rows,
)
from rollfeed.payload.writer import PayloadWriter

__all__ = [
    "PAYLOAD_FIELDS",
    "CaptureConfig",
    "CaptureError",
    "CaptureModeError",
    "CapturedCompletion",
    "LogprobRows",
    "PayloadDtypeError",
    "PayloadError",
    "PayloadField",
    "PayloadHeaderError",
    "PayloadIOError",
    "PayloadIndexError",
    "PayloadInputError",
    "PayloadMissingFileError",
    "PayloadPathError",
    "PayloadRegionError",
    "PayloadRoot",
    "PayloadSegment",
    "PayloadSegmentError",
    "PayloadStaleFileError",
    "PayloadTruncatedError",
    "PayloadWidthError",
    "PayloadWriter",
    "RaggedLayout",
    "RoutingShapeError",
    "SamplingSettingsError",
    "SupportBoundError",
    "SupportCapture",
    "SupportMembershipError",
    "UnknownFieldError",
    "align_routed_experts",
    "capture_completion",
    "capture_request_output",
    "capture_sampling_params",
    "check_engine",
    "check_sampling_params",
    "clip_segments",
    "logprob_rows",
    "lookup_field",
    "ragged_bytes",
    "read_field",
    "register_field",
    "routed_dtype",
    "shift_segments",
    "support_from_logprob_rows",
    "support_from_native_mask",
]
