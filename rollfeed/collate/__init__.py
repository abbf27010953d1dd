"""Pure planning: truncate, pack, pad, balance DP, split CP, and the tensors of one micro batch."""

from rollfeed.collate.errors import (
    BatchConfigError,
    CollateError,
    DuplicateFieldError,
    OverlongError,
    SampleDtypeError,
    SampleLengthError,
    SegmentRangeError,
    TurnGapError,
)
from rollfeed.collate.tensor_batch import IGNORE_INDEX, TensorMicroBatch

__all__ = [
    "IGNORE_INDEX",
    "BatchConfigError",
    "CollateError",
    "DuplicateFieldError",
    "OverlongError",
    "SampleDtypeError",
    "SampleLengthError",
    "SegmentRangeError",
    "TensorMicroBatch",
    "TurnGapError",
]
