"""MicroBatchCollator: the ``collate_fn`` that turns one micro batch's samples into tensors.

It receives the samples of the indices :class:`~rollfeed.loaders.sampler.MicroBatchSampler` yielded
(packing order, ``[]`` for a dummy), places the planner's micro batch
(:func:`rollfeed.collate.place_micro_batch`), and calls
:func:`rollfeed.collate.to_tensor_micro_batch` for this rank's CP coordinate — so the payload bytes
are read here, inside a worker process when ``num_workers > 0``, and so are the images this cp rank
encodes, decoded and processed with ``LoaderConfig.image_processor``. The result equals, bitwise,
the single-process ``prepare_batch`` + ``to_tensor_micro_batch`` for ``(dp_rank, cp_rank)``, its
step's loss-token counts (``step_counts``, planned by the sampler) included. Samples that come with
the sampler's config (:class:`~rollfeed.loaders.plan.Planned`, through the dataset's
``__getitems__``) are refused with :class:`~rollfeed.loaders.errors.PlanMismatchError` when it is
not the collator's. Under ``on_stale="mask"`` the labels whose policy version lags the planned step
by more than ``max_staleness`` leave ``loss_mask`` (:func:`~rollfeed.loaders.staleness.mask_stale`);
a staleness bound needs the sampler's micro batches (they carry the step).

Called inside a DataLoader worker, the result's tensors are copied into **one** shared-memory
buffer (views at aligned offsets): a DataLoader sends every storage to the main process as its
own file descriptor over a socket, so one storage per micro batch instead of ~13 is what keeps
the trainer's wait small (measured by ``python -m rollfeed.bench loader``). The loader's own
workers call :meth:`MicroBatchCollator.make` and hand the result over themselves
(:mod:`rollfeed.loaders.handover`).

Picklable and fd-free: the :class:`~rollfeed.payload.PayloadRoot` it holds opens files lazily per
process and keeps them open across micro batches of that worker.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
from torch.utils.data import get_worker_info

from rollfeed.collate import (
    Sample,
    TensorMicroBatch,
    Topology,
    place_micro_batch,
    to_tensor_micro_batch,
)
from rollfeed.loaders.config import LoaderConfig
from rollfeed.loaders.errors import LoaderConfigError, PlanMismatchError
from rollfeed.loaders.plan import Planned
from rollfeed.loaders.staleness import mask_stale
from rollfeed.payload import PayloadRoot


class MicroBatchCollator:
    """``collate_fn(samples) -> TensorMicroBatch`` for ``topology``'s CP rank; see module doc.

    Args:
        topology: this rank's place; its ``cp_rank`` picks the rank's part of the row, and its
            ``cp_size`` is the plan's (``topology.bind(config.plan)``).
        config: the plan (the sampler's too, checked per micro batch), ``width`` (static
            ragged width; default each micro batch's widest row) and ``whole_fields`` (read
            fields over the whole row, for models that shard inside the forward);
            ``self.config`` holds it with the plan bound to the topology.
        root: payload root (a path or one shared :class:`PayloadRoot`; ``None`` when every
            field is inline).
    """

    def __init__(
        self,
        topology: Topology,
        config: LoaderConfig,
        *,
        root: PayloadRoot | str | os.PathLike[str] | None,
    ) -> None:
        if not isinstance(config, LoaderConfig):
            raise LoaderConfigError(
                f"config must be a LoaderConfig, got {type(config).__name__}; wrap a plan as "
                "LoaderConfig(plan=PlanConfig(...))"
            )
        self.topology = topology
        self.config = dataclasses.replace(config, plan=topology.bind(config.plan))
        self.root = root if root is None or isinstance(root, PayloadRoot) else PayloadRoot(root)

    def __call__(self, samples: Sequence[Sample]) -> TensorMicroBatch:
        tmb = self.make(samples)
        return tmb if get_worker_info() is None else share_as_one_storage(tmb)

    def make(self, samples: Sequence[Sample]) -> TensorMicroBatch:
        """The micro batch of ``samples``, its tensors where they were made (no sharing)."""
        if isinstance(samples, Planned) and samples.config != self.config.plan:
            raise PlanMismatchError(
                "the sampler planned this micro batch with another plan than the collator's ("
                f"sampler vs collator: {'; '.join(samples.config.differences(self.config.plan))}); "
                "build both from one LoaderConfig"
            )
        policy = self.config.staleness
        step = samples.step if isinstance(samples, Planned) else None
        if policy is not None and (step is None or samples.staleness != policy):
            raise PlanMismatchError(
                f"the collator bounds staleness ({policy}) and the micro batch was not planned "
                "under that bound by a sampler (which gives it its step"
                + ("" if step is None else f"; it was planned under {samples.staleness}")
                + "): build the sampler and the collator from one LoaderConfig"
            )
        counts = samples.counts if isinstance(samples, Planned) else None
        mb = place_micro_batch(samples, self.config.plan, step_counts=counts)
        tmb = to_tensor_micro_batch(
            mb,
            cp_rank=self.topology.cp_rank,
            root=self.root,
            width=self.config.width,
            whole_fields=self.config.whole_fields,
            image_processor=self.config.image_processor,
        )
        if policy is not None and policy.on_stale == "mask":
            assert step is not None
            tmb = mask_stale(tmb, step=step, bound=policy.max_staleness)
        return tmb


_ALIGN = 64


def share_as_one_storage(tmb: TensorMicroBatch) -> TensorMicroBatch:
    """The same micro batch with every tensor a view of one shared-memory byte buffer.

    Offsets are multiples of 64 bytes, so every dtype's view is aligned. Values, dtypes and
    shapes are unchanged (the views are contiguous)::

        input_ids [N] int64 at bytes [0, 8N), labels at [round64(8N), ...), ...
    """
    sizes = [t.numel() * t.element_size() for t in tmb.tensors()]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + -(-n // _ALIGN) * _ALIGN)
    buf = torch.empty(max(offsets[-1], 1), dtype=torch.uint8).share_memory_()
    slots = iter(zip(offsets, sizes, strict=False))

    def place(t: torch.Tensor) -> torch.Tensor:  # apply() visits tensors in tensors() order
        at, n = next(slots)
        view = buf[at : at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    return tmb.apply(place)
