"""build_dataloader: a dataset, its sampler and its collator in a :class:`RolloutLoader`.

The sampler (which plans) and the collator (which places and reads) share the one planner config;
runtime facts (this rank's topology, the payload root) are separate arguments; how the loader runs
is :class:`~rollfeed.loaders.loader.LoaderOptions`.
"""

from __future__ import annotations

import os

from rollfeed.collate import PlanConfig, Topology
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.loader import RolloutLoader
from rollfeed.loaders.options import LoaderOptions
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.state import Reshard
from rollfeed.payload import PayloadRoot


def build_dataloader(
    dataset: RolloutDataset,
    topology: Topology,
    config: PlanConfig,
    *,
    root: PayloadRoot | str | os.PathLike[str] | None,
    width: int | None = None,
    whole_fields: bool = False,
    seed: int = 0,
    shuffle: bool = False,
    stream: bool = False,
    step_timeout_s: float = 600.0,
    start_step: int | None = None,
    on_reshard: Reshard = "error",
    options: LoaderOptions | None = None,
) -> RolloutLoader:
    """A loader yielding this rank's ``TensorMicroBatch``es, one pass per training step.

    Args:
        dataset: the samples of each step (a list, or a step directory).
        topology: this rank's place; ``(dp_rank, dp_size)`` selects its micro batches,
            ``cp_rank`` its part of each row; ``cp_size`` must be ``config.cp_size``.
        config: the planner's options (sequence length, CP layout, padding, overlong policy,
            balance cost, field registry).
        root: payload root (a path or one shared :class:`PayloadRoot`; ``None`` when every
            field is inline).
        width: static ragged width (default: each micro batch's widest row).
        whole_fields: read fields over the whole row (models that shard inside the forward).
        seed: seed of ``shuffle``.
        shuffle: present a step's samples to the planner in an order drawn from
            ``(seed, step)`` (the same on every rank); otherwise in dataset order.
        stream: every pass is exactly the next step's file (a step directory only).
        step_timeout_s: how long a pass waits for its step file before ``StepTimeoutError``.
        start_step: first step (default: the oldest step file present, 0 for a list).
        on_reshard: what ``load_state_dict`` does with a state saved at another world shape:
            ``"error"``, ``"restart_step"`` or ``"next_step"``.
        options: how the loader runs (workers, receive thread, pinning, device); default
            ``LoaderOptions()``: no workers.
    """
    sampler = MicroBatchSampler(
        dataset,
        topology,
        config,
        seed=seed,
        shuffle=shuffle,
        stream=stream,
        step_timeout_s=step_timeout_s,
        start_step=start_step,
        on_reshard=on_reshard,
    )
    collator = MicroBatchCollator(
        topology, config, root=root, width=width, whole_fields=whole_fields
    )
    return RolloutLoader(dataset, sampler, collator, options or LoaderOptions())
