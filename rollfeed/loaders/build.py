"""build_dataloader: a dataset, its sampler and its collator in a :class:`RolloutLoader`.

What the loader yields is one :class:`~rollfeed.loaders.config.LoaderConfig` (the plan and the
run's choices), which the sampler (which plans) and the collator (which places and reads) share;
runtime facts (this rank's topology, the payload root) are separate arguments; how the loader
runs is :class:`~rollfeed.loaders.options.LoaderOptions`. Example::

    topology = Topology.from_process_group(cp_size=2)
    config = LoaderConfig(plan=PlanConfig(seq_len=16_384, cp_layout="zigzag"), shuffle=True)
    loader = build_dataloader(dataset, topology, config, root="/shared/payload")
    loader.batch_sampler.config.plan.cp_size  # 2: the plan takes its cp_size from the topology
"""

from __future__ import annotations

import os

from rollfeed.collate import Topology
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.config import LoaderConfig
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.loader import RolloutLoader
from rollfeed.loaders.options import LoaderOptions
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.payload import PayloadRoot


def build_dataloader(
    dataset: RolloutDataset,
    topology: Topology,
    config: LoaderConfig,
    *,
    root: PayloadRoot | str | os.PathLike[str] | None,
    options: LoaderOptions | None = None,
) -> RolloutLoader:
    """A loader yielding this rank's ``TensorMicroBatch``es, one pass per training step.

    Args:
        dataset: the samples of each step (a list, or a step directory).
        topology: this rank's place; ``(dp_rank, dp_size)`` selects its micro batches,
            ``cp_rank`` its part of each row, ``cp_size`` is the plan's.
        config: what the loader yields: the plan (sequence length, CP layout, padding,
            overlong policy, balance cost, field registry), seed, shuffle, stream, start step,
            reshard policy, step timeout, ragged width, whole fields (:class:`LoaderConfig`).
        root: payload root (a path or one shared :class:`PayloadRoot`; ``None`` when every
            field is inline).
        options: how the loader runs (workers, receive thread, pinning, device); default
            ``LoaderOptions()``: no workers.
    """
    sampler = MicroBatchSampler(dataset, topology, config)
    collator = MicroBatchCollator(topology, config, root=root)
    return RolloutLoader(dataset, sampler, collator, options or LoaderOptions())
