"""build_dataloader: dataset + MicroBatchSampler + MicroBatchCollator in a (Stateful)DataLoader.

Defaults chosen for a trainer rank:

- ``num_workers > 0``: persistent workers (a pass is one training step; workers, their open
  payload files and parsed step files survive from step to step), ``fork`` on Linux (cheap start,
  the dataset is shared copy-on-write), one torch thread per worker (the trainer owns the cores).
- ``pin_memory`` only when CUDA is available (pinning needs it).
- ``num_workers > 0``: a receive thread (:mod:`rollfeed.loaders.prefetch`) takes each batch from
  the workers while the trainer computes, so ``next`` is a queue get.
- ``stateful=True``: torchdata's ``StatefulDataLoader`` (:class:`StepDataLoader`), whose
  ``state_dict()`` holds the sampler state as of the micro batches handed out (not prefetched),
  so a resume repeats and loses nothing.
- An error raised in a worker comes out of the trainer's ``next`` with its type and attributes
  (:mod:`rollfeed.loaders.worker_errors`), not rebuilt from text.

Example::

    loader = build_dataloader(RolloutDataset(samples), Topology(dp_rank=0, dp_size=1),
                              seq_len=16384, root="/data/payload", num_workers=2)
    for tmb in loader: ...          # one training step
    state = loader.state_dict()     # ... later: loader.load_state_dict(state)
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from rollfeed.collate.balance import DEFAULT_QUADRATIC
from rollfeed.loaders.collator import MicroBatchCollator
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.errors import LoaderConfigError
from rollfeed.loaders.prefetch import PrefetchDataLoader, PrefetchStepDataLoader
from rollfeed.loaders.sampler import MicroBatchSampler
from rollfeed.loaders.state import Reshard
from rollfeed.loaders.step_loader import StepDataLoader
from rollfeed.loaders.topology import Topology
from rollfeed.loaders.worker_errors import CarryErrors
from rollfeed.payload import PAYLOAD_FIELDS, PayloadField, PayloadRoot


def init_worker(worker_id: int, *, threads: int) -> None:
    """Worker init: cap torch's intra-op threads (workers decode, the trainer computes)."""
    del worker_id
    torch.set_num_threads(threads)


def build_dataloader(
    dataset: RolloutDataset,
    topology: Topology,
    *,
    seq_len: int,
    root: PayloadRoot | str | os.PathLike[str] | None,
    cp_layout: Literal["contiguous", "zigzag"] = "contiguous",
    width: int | None = None,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    stateful: bool = True,
    seed: int = 0,
    shuffle: bool = False,
    pad_to_multiple_of: int | None = None,
    overlong: Literal["truncate", "drop", "error"] = "truncate",
    quadratic_cost: float = DEFAULT_QUADRATIC,
    whole_fields: bool = False,
    fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
    stream: bool = False,
    step_timeout_s: float = 600.0,
    start_step: int | None = None,
    on_reshard: Reshard = "error",
    worker_threads: int = 1,
    multiprocessing_context: str | None = None,
    timeout_s: float = 0,
    prefetch_thread: bool | None = None,
    prefetch_depth: int = 2,
) -> DataLoader:
    """A loader yielding this rank's ``TensorMicroBatch``es, one pass per training step.

    ``timeout_s``: per-batch wait on workers (0 = none; a dead worker is detected regardless).
    ``multiprocessing_context``: default ``"fork"`` on Linux.
    ``prefetch_thread``: receive (and pin) micro batches on a thread, ``prefetch_depth`` ahead
    (:mod:`rollfeed.loaders.prefetch`); ``None``: on when ``num_workers > 0``.
    Other options: see the pieces.
    """
    if num_workers < 0:
        raise LoaderConfigError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch_factor is not None and num_workers == 0:
        raise LoaderConfigError("prefetch_factor needs num_workers > 0; drop it or add workers")
    plan_kw: dict[str, Any] = dict(
        seq_len=seq_len,
        cp_layout=cp_layout,
        pad_to_multiple_of=pad_to_multiple_of,
        overlong=overlong,
        quadratic_cost=quadratic_cost,
        fields=fields,
    )
    sampler = MicroBatchSampler(
        dataset,
        topology,
        seed=seed,
        shuffle=shuffle,
        stream=stream,
        step_timeout_s=step_timeout_s,
        start_step=start_step,
        on_reshard=on_reshard,
        **plan_kw,
    )
    collator = MicroBatchCollator(
        topology, root=root, width=width, whole_fields=whole_fields, **plan_kw
    )
    if prefetch_thread is None:
        prefetch_thread = num_workers > 0
    pin = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        batch_sampler=sampler,
        collate_fn=CarryErrors(collator) if num_workers else collator,
        num_workers=num_workers,
        pin_memory=pin and not prefetch_thread,  # the receive thread pins instead
        timeout=timeout_s,
    )
    if num_workers:
        if multiprocessing_context is None and sys.platform.startswith("linux"):
            multiprocessing_context = "fork"
        if multiprocessing_context == "fork":
            sampler.warm()
        kw.update(
            persistent_workers=True,
            prefetch_factor=prefetch_factor,
            worker_init_fn=functools.partial(init_worker, threads=worker_threads),
            multiprocessing_context=multiprocessing_context,
        )
    if prefetch_thread:
        cls = PrefetchStepDataLoader if stateful else PrefetchDataLoader
        return cls(dataset, depth=prefetch_depth, pin=pin, **kw)
    return StepDataLoader(dataset, **kw) if stateful else DataLoader(dataset, **kw)
