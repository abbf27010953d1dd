"""torch.utils.data shell around the batches planner: dataset, batch sampler, collate_fn, state."""

from rollfeed.collate import Topology
from rollfeed.loaders.build import build_dataloader
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.config import LoaderConfig
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.errors import (
    EmptyStepError,
    LoaderConfigError,
    LoaderError,
    LoaderStateError,
    PlanMismatchError,
    StepFileError,
    StepMissingError,
    StepReplacedError,
    StepTimeoutError,
    StepWriteError,
    WorkerDiedError,
    WorkerError,
    WorkerStoppedError,
    WorkerTimeoutError,
)
from rollfeed.loaders.loader import RolloutIterator, RolloutLoader
from rollfeed.loaders.options import LoaderOptions
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.staleness import StaleSampleError
from rollfeed.loaders.step_files import StepWriter, read_step_file, step_file_name, write_step_file

__all__ = [
    "EmptyStepError",
    "LoaderConfig",
    "LoaderConfigError",
    "LoaderError",
    "LoaderOptions",
    "LoaderStateError",
    "MicroBatchCollator",
    "MicroBatchSampler",
    "PlanMismatchError",
    "RolloutDataset",
    "RolloutIterator",
    "RolloutLoader",
    "StaleSampleError",
    "StepFileError",
    "StepMissingError",
    "StepReplacedError",
    "StepTimeoutError",
    "StepWriteError",
    "StepWriter",
    "Topology",
    "WorkerDiedError",
    "WorkerError",
    "WorkerStoppedError",
    "WorkerTimeoutError",
    "build_dataloader",
    "read_step_file",
    "step_file_name",
    "write_step_file",
]
