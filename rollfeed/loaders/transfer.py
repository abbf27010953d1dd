"""Pinning and the device copy: a worker's micro batch is one buffer, pinned once, copied once.

A worker sends a micro batch as views of **one** shared-memory buffer (the collator packs its
tensors at aligned offsets). :func:`move_micro_batch` moves that buffer whole (one page-locked
copy, or one asynchronous host-to-device copy) and rebuilds every tensor as a view of the moved
buffer at the same offset, shape and stride, so no value can differ from the source's. A micro
batch whose tensors have storages of their own (made in the trainer's process) moves tensor by
tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollfeed.collate import TensorMicroBatch


def move_micro_batch(
    tmb: TensorMicroBatch, move: Callable[[torch.Tensor], torch.Tensor]
) -> TensorMicroBatch:
    """``tmb`` with its one buffer (``[nbytes]`` uint8) passed through ``move`` once."""
    tensors = tmb.tensors()
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors[1:]):
        return tmb.apply(move)
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    moved = move(whole).untyped_storage()

    def view(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(0, dtype=t.dtype, device=moved.device)
        return out.set_(moved, t.storage_offset(), t.shape, t.stride())

    return tmb.apply(view)
