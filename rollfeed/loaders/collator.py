"""MicroBatchCollator: the ``collate_fn`` that turns one micro batch's samples into tensors.

It receives the samples of the indices :class:`~rollfeed.loaders.sampler.MicroBatchSampler`
yielded (packing order, ``[]`` for a dummy), rebuilds the planner's micro batch
(:func:`rollfeed.loaders.plan.rebuild_micro_batch`), and calls
:func:`rollfeed.collate.to_tensor_micro_batch` for this rank's CP coordinate — so the payload bytes
are read here, inside a worker process when ``num_workers > 0``. The result equals, bitwise, the
single-process ``prepare_batch`` + ``to_tensor_micro_batch`` for ``(dp_rank, cp_rank)``.

Inside a worker the result's tensors are copied into **one** shared-memory buffer (views at
aligned offsets): a DataLoader sends every storage to the main process as its own file descriptor
over a socket, so one storage per micro batch instead of ~13 is what keeps the trainer's wait
small (measured by ``python -m rollfeed.bench loader``).

Picklable and fd-free: the :class:`~rollfeed.payload.PayloadRoot` it holds opens files lazily per
process and keeps them open across micro batches of that worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch.utils.data import get_worker_info

from rollfeed.collate import Sample, TensorMicroBatch, to_tensor_micro_batch
from rollfeed.collate.balance import DEFAULT_QUADRATIC
from rollfeed.loaders.plan import PlanSpec, rebuild_micro_batch
from rollfeed.loaders.topology import Topology
from rollfeed.payload import PAYLOAD_FIELDS, PayloadField, PayloadRoot


class MicroBatchCollator:
    """``collate_fn(samples) -> TensorMicroBatch`` for ``topology``'s CP rank; see module doc.

    ``root``: payload root (a path or one shared :class:`PayloadRoot`; ``None`` when every field
    is inline). ``width``: static ragged width. ``whole_fields``: read fields over the whole row.
    The planner options must match the sampler's (``build_dataloader`` wires both from one set).
    """

    def __init__(
        self,
        topology: Topology,
        *,
        seq_len: int,
        root: PayloadRoot | str | os.PathLike[str] | None,
        cp_layout: Literal["contiguous", "zigzag"] = "contiguous",
        width: int | None = None,
        pad_to_multiple_of: int | None = None,
        overlong: Literal["truncate", "drop", "error"] = "truncate",
        quadratic_cost: float = DEFAULT_QUADRATIC,
        whole_fields: bool = False,
        fields: Mapping[str, PayloadField] = PAYLOAD_FIELDS,
    ) -> None:
        self.topology = topology
        self.spec = PlanSpec(
            seq_len=seq_len,
            cp_size=topology.cp_size,
            cp_layout=cp_layout,
            pad_to_multiple_of=pad_to_multiple_of,
            overlong=overlong,
            quadratic_cost=quadratic_cost,
            fields=fields,
        )
        self.root = root if root is None or isinstance(root, PayloadRoot) else PayloadRoot(root)
        self.width, self.whole_fields = width, whole_fields

    def __call__(self, samples: Sequence[Sample]) -> TensorMicroBatch:
        mb = rebuild_micro_batch(samples, self.spec)
        tmb = to_tensor_micro_batch(
            mb,
            cp_rank=self.topology.cp_rank,
            cp_size=self.spec.cp_size,
            cp_layout=self.spec.cp_layout,
            root=self.root,
            width=self.width,
            whole_fields=self.whole_fields,
            fields=self.spec.fields,
        )
        return tmb if get_worker_info() is None else share_as_one_storage(tmb)


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
