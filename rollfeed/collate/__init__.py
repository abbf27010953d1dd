"""Pure planning: truncate, pack, pad, balance DP, split CP, and the tensors of one micro batch;
the rank's place in the parallel grid (:class:`Topology`); the policy versions of a sample's
tokens (:func:`token_versions`, :func:`oldest_version`: :mod:`rollfeed.collate.versions`).

Renamed (the old name works until the next release, with a ``DeprecationWarning``):
``KeptSetError`` is :class:`SupportSetError`.
"""

from rollfeed.collate.config import PlanConfig
from rollfeed.collate.errors import (
    BatchConfigError,
    CollateError,
    DuplicateFieldError,
    ImageInputError,
    MeshAxisError,
    OverlongError,
    SampleDtypeError,
    SampleLengthError,
    SampleValueError,
    SegmentRangeError,
    SupportSetError,
)
from rollfeed.collate.image_runs import ImageRuns
from rollfeed.collate.loss_runs import LossRuns
from rollfeed.collate.media_batch import MediaBatch
from rollfeed.collate.micro_batch import MicroBatch, place_micro_batch
from rollfeed.collate.prepare import BatchPlan, plan_lengths, prepare_batch
from rollfeed.collate.sample import Sample
from rollfeed.collate.step_counts import StepCounts, StepLoss
from rollfeed.collate.tensor_batch import IGNORE_INDEX, TensorMicroBatch
from rollfeed.collate.to_tensor import to_tensor_micro_batch
from rollfeed.collate.topology import Topology
from rollfeed.collate.versions import oldest_version, token_versions
from rollfeed.deprecation import renamed_names as _renamed_names
from rollfeed.payload import RaggedRows, RaggedRowsError

__getattr__ = _renamed_names(__name__, {"KeptSetError": "SupportSetError"})

__all__ = [
    "IGNORE_INDEX",
    "BatchConfigError",
    "BatchPlan",
    "CollateError",
    "DuplicateFieldError",
    "ImageInputError",
    "ImageRuns",
    "LossRuns",
    "MediaBatch",
    "MeshAxisError",
    "MicroBatch",
    "OverlongError",
    "PlanConfig",
    "RaggedRows",
    "RaggedRowsError",
    "Sample",
    "SampleDtypeError",
    "SampleLengthError",
    "SampleValueError",
    "SegmentRangeError",
    "StepCounts",
    "StepLoss",
    "SupportSetError",
    "TensorMicroBatch",
    "Topology",
    "oldest_version",
    "place_micro_batch",
    "plan_lengths",
    "prepare_batch",
    "to_tensor_micro_batch",
    "token_versions",
]
