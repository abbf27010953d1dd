"""Bytes <-> handles: per-token side channels written once, passed around as segment records.

The byte format, the writer, the reader and the roots, and step record files (one training
step's records and the index every rank plans from, :mod:`rollfeed.payload.format.step_layout`);
it imports nothing of rollfeed but the leaf :mod:`rollfeed.errors`, and never vLLM. The inference
side that writes through it (kept sets, routed experts, the vLLM adapter, turn assembly) is
:mod:`rollfeed.capture`.
"""

from rollfeed.payload.errors import (
    PayloadChecksumError,
    PayloadDtypeError,
    PayloadError,
    PayloadFieldError,
    PayloadHeaderError,
    PayloadIndexError,
    PayloadInputError,
    PayloadIOError,
    PayloadMediaError,
    PayloadMissingFileError,
    PayloadOutputBoundError,
    PayloadPathError,
    PayloadRegionError,
    PayloadSegmentError,
    PayloadStaleFileError,
    PayloadStoreAuthError,
    PayloadStoreTimeoutError,
    PayloadTruncatedError,
    PayloadWidthError,
    RaggedRowsError,
    StepRecordError,
    UnknownFieldError,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS, PayloadField, lookup_field, register_field
from rollfeed.payload.format.label_rows import canonical_rows
from rollfeed.payload.media import ImageProcessorSpec, ImageSpan, MediaRef, MediaWriter, read_media
from rollfeed.payload.ragged_rows import RaggedRows
from rollfeed.payload.read.reader import FieldRead, read_field, read_fields
from rollfeed.payload.read.step_reader import StepRecordFile
from rollfeed.payload.root import PayloadRoot
from rollfeed.payload.segment import PayloadSegment, RaggedLayout, clip_segments, shift_segments
from rollfeed.payload.step_record import StepRecord, StepRecordIndex
from rollfeed.payload.stores.store_url import is_store_url
from rollfeed.payload.write.step_writer import StepRecordWriter
from rollfeed.payload.write.writer import PayloadWriter

__all__ = [
    "PAYLOAD_FIELDS",
    "FieldRead",
    "ImageProcessorSpec",
    "ImageSpan",
    "MediaRef",
    "MediaWriter",
    "PayloadChecksumError",
    "PayloadDtypeError",
    "PayloadError",
    "PayloadField",
    "PayloadFieldError",
    "PayloadHeaderError",
    "PayloadIOError",
    "PayloadIndexError",
    "PayloadInputError",
    "PayloadMediaError",
    "PayloadMissingFileError",
    "PayloadOutputBoundError",
    "PayloadPathError",
    "PayloadRegionError",
    "PayloadRoot",
    "PayloadSegment",
    "PayloadSegmentError",
    "PayloadStaleFileError",
    "PayloadStoreAuthError",
    "PayloadStoreTimeoutError",
    "PayloadTruncatedError",
    "PayloadWidthError",
    "PayloadWriter",
    "RaggedLayout",
    "RaggedRows",
    "RaggedRowsError",
    "StepRecord",
    "StepRecordError",
    "StepRecordFile",
    "StepRecordIndex",
    "StepRecordWriter",
    "UnknownFieldError",
    "canonical_rows",
    "clip_segments",
    "is_store_url",
    "lookup_field",
    "read_field",
    "read_fields",
    "read_media",
    "register_field",
    "shift_segments",
]
