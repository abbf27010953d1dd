"""Pure planning: truncate, pack, pad, balance DP, split CP, and the tensors of one micro batch."""

from rollfeed.collate.balance import partition_costs, sequence_cost
from rollfeed.collate.config import PlanConfig
from rollfeed.collate.cp import attention_work, field_ranges, ranges_index, rank_ranges
from rollfeed.collate.errors import (
    BatchConfigError,
    CollateError,
    DuplicateFieldError,
    OverlongError,
    SampleDtypeError,
    SampleLengthError,
    SampleValueError,
    SegmentRangeError,
)
from rollfeed.collate.micro_batch import MicroBatch, place_micro_batch
from rollfeed.collate.pack import pack_ffd
from rollfeed.collate.prepare import BatchPlan, plan_lengths, prepare_batch
from rollfeed.collate.sample import Sample
from rollfeed.collate.tensor_batch import IGNORE_INDEX, TensorMicroBatch
from rollfeed.collate.to_tensor import to_tensor_micro_batch
from rollfeed.collate.truncate import truncate_sample

__all__ = [
    "IGNORE_INDEX",
    "BatchConfigError",
    "BatchPlan",
    "CollateError",
    "DuplicateFieldError",
    "MicroBatch",
    "OverlongError",
    "PlanConfig",
    "Sample",
    "SampleDtypeError",
    "SampleLengthError",
    "SampleValueError",
    "SegmentRangeError",
    "TensorMicroBatch",
    "attention_work",
    "field_ranges",
    "pack_ffd",
    "partition_costs",
    "place_micro_batch",
    "plan_lengths",
    "prepare_batch",
    "ranges_index",
    "rank_ranges",
    "sequence_cost",
    "to_tensor_micro_batch",
    "truncate_sample",
]
