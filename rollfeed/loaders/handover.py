"""Handover: a worker's micro batch reaches the trainer's process as one memfd, its descriptor sent
over a socket the worker inherited.

A DataLoader hands a tensor over by its shared-memory descriptor, which the receiver fetches from
the worker through :mod:`multiprocessing.resource_sharer`: a new connection, an authentication
handshake both ways and the descriptor, each step answered by a listener thread of the worker,
which waits for the worker's GIL while the worker decodes the next micro batch (up to the switch
interval, 5 ms, per step). Measured by ``python -m rollfeed.bench loader``, that wait was the
larger part of the trainer's wait for a micro batch. Here the worker writes the micro batch into
one ``memfd`` (views at 64-byte aligned offsets, as
:func:`~rollfeed.loaders.collator.share_as_one_storage` lays them out), sends its descriptor over
its own ``AF_UNIX`` socket before the micro batch's description (:class:`Slot` per tensor) goes
on the DataLoader's queue, and the receiver maps it (``torch.from_file`` of
``/proc/self/fd/N``): one ``sendmsg`` and one ``recvmsg``, neither waiting on the other process.
Buffers of micro batches the DataLoader discarded (a pass left early) are skipped by their token,
which counts up in each worker.

Linux with forked workers only (the sockets are inherited; ``memfd_create``); elsewhere the
collator's one shared-memory buffer goes through torch's handover.

Example (worker 1, a micro batch of 3 tensors)::

    described = handover.send(tmb, worker=1, token=17)  # tensors -> Slot(offset, dtype, shape)
    tmb = handover.receive(described)                     # views of one mapped buffer
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from dataclasses import dataclass

import torch

from rollfeed.collate import TensorMicroBatch

_ALIGN = 64
_TOKEN = struct.Struct("<q")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor of a micro batch lies in its buffer (contiguous)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Described:
    """A micro batch whose tensors are :class:`Slot`\\ s of a buffer of ``nbytes``, sent by
    ``worker`` with ``token``."""

    batch: TensorMicroBatch
    nbytes: int
    worker: int
    token: int


class Handover:
    """One socket pair per worker, made before the workers fork (see the module doc)."""

    def __init__(self, workers: int) -> None:
        self.pairs = [
            socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(workers)
        ]

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")

    def send(self, tmb: TensorMicroBatch, *, worker: int, token: int) -> Described:
        """In worker ``worker``: ``tmb`` written into a memfd whose descriptor is sent now."""
        sizes = [t.numel() * t.element_size() for t in tmb.tensors()]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // _ALIGN) * _ALIGN)
        nbytes = max(offsets[-1], 1)
        fd = os.memfd_create("rollfeed-micro-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            buf = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8
            )
            at = iter(offsets)

            def place(t: torch.Tensor) -> Slot:  # apply() visits tensors in tensors() order
                offset = next(at)
                view = buf[offset : offset + t.numel() * t.element_size()]
                view.view(t.dtype).view(t.shape).copy_(t)
                return Slot(offset, t.dtype, tuple(t.shape))

            described = Described(tmb.apply(place), nbytes, worker, token)  # type: ignore[arg-type]
            socket.send_fds(self.pairs[worker][1], [_TOKEN.pack(token)], [fd])
        finally:
            os.close(fd)  # the receiver holds its own descriptor once it was sent
        return described

    def receive(self, described: Described) -> TensorMicroBatch:
        """In the trainer's process: the micro batch ``send`` described, mapped."""
        while True:  # a worker's buffers come in its order; those before were dropped
            data, fds, _, _ = socket.recv_fds(self.pairs[described.worker][0], _TOKEN.size, 1)
            token = _TOKEN.unpack(data)[0]
            assert fds and token <= described.token, (token, described.token)
            if token == described.token:
                break
            os.close(fds[0])  # made for a pass that was left (its micro batch was discarded)
        try:
            buf = torch.from_file(
                f"/proc/self/fd/{fds[0]}", shared=True, size=described.nbytes, dtype=torch.uint8
            )
        finally:
            os.close(fds[0])

        def view(slot: Slot) -> torch.Tensor:
            n = slot.dtype.itemsize * int(torch.Size(slot.shape).numel())
            return buf[slot.offset : slot.offset + n].view(slot.dtype).view(slot.shape)

        tmb = described.batch  # apply() maps tensors only: the Slots are mapped here
        top = {
            f.name: view(value)
            for f in dataclasses.fields(tmb)
            if isinstance(value := getattr(tmb, f.name), Slot)
        }
        return dataclasses.replace(
            tmb,
            **top,
            fields={k: view(v) for k, v in tmb.fields.items()},
            coverage={k: view(v) for k, v in tmb.coverage.items()},
        )
