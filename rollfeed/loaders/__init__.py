"""torch.utils.data shell around the batches planner: dataset, batch sampler, collate_fn, state."""

from rollfeed.loaders.build import StepDataLoader, build_dataloader
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.dataset import STEP_STRIDE, RolloutDataset
from rollfeed.loaders.errors import (
    EmptyStepError,
    LoaderConfigError,
    LoaderError,
    LoaderStateError,
    StepFileError,
    StepTimeoutError,
)
from rollfeed.loaders.plan import PlanSpec, plan_step, rebuild_micro_batch
from rollfeed.loaders.prefetch import PrefetchDataLoader, PrefetchIterator, PrefetchStepDataLoader
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.state import SamplerState
from rollfeed.loaders.step_files import read_step_file, step_file_name, write_step_file
from rollfeed.loaders.step_index import StepIndex, build_step_index, read_step_index
from rollfeed.loaders.stream import stream_micro_batches
from rollfeed.loaders.topology import Topology

__all__ = [
    "STEP_STRIDE",
    "EmptyStepError",
    "LoaderConfigError",
    "LoaderError",
    "LoaderStateError",
    "MicroBatchCollator",
    "MicroBatchSampler",
    "PlanSpec",
    "PrefetchDataLoader",
    "PrefetchIterator",
    "PrefetchStepDataLoader",
    "RolloutDataset",
    "SamplerState",
    "StepDataLoader",
    "StepFileError",
    "StepIndex",
    "StepTimeoutError",
    "Topology",
    "build_dataloader",
    "build_step_index",
    "plan_step",
    "read_step_file",
    "read_step_index",
    "rebuild_micro_batch",
    "step_file_name",
    "stream_micro_batches",
    "write_step_file",
]
