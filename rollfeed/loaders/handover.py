"""Handover: a worker's micro batch reaches the trainer's process in one memfd buffer of a pool the
worker keeps, its descriptor sent over a socket the worker inherited.

A DataLoader hands a tensor over by its shared-memory descriptor, which the receiver fetches from
the worker through :mod:`multiprocessing.resource_sharer`: a new connection, an authentication
handshake both ways and the descriptor, each step answered by a listener thread of the worker,
which waits for the worker's GIL while the worker decodes the next micro batch. And every micro
batch is a fresh shared-memory segment, whose pages the kernel faults in and zeroes as the worker
writes them (about as long as decoding the micro batch). Measured by
``python -m rollfeed.bench loader``, those were most of the trainer's wait. Here:

- the worker writes the micro batch into one ``memfd`` buffer of its pool (views at 64-byte
  aligned offsets, as :func:`~rollfeed.loaders.collator.share_as_one_storage` lays them out) and
  sends the buffer's descriptor over its own ``AF_UNIX`` socket before the micro batch's
  description (a :class:`Slot` per tensor) goes on the DataLoader's queue: one ``sendmsg``;
- the trainer's process maps it (``torch.from_file`` of ``/proc/self/fd/N``) and, once the last
  tensor of that mapping is gone (a ``weakref.finalize`` on its storage), sends the buffer's
  number back, so the worker writes a later micro batch into memory it has already faulted in.
  A buffer is reused only then: never while any tensor of the trainer still views it.

Buffers of micro batches the DataLoader discarded (a pass left early) are skipped by their token,
which counts up in each worker, and given back. A worker keeps at most :data:`KEEP` free buffers.
Linux only (``memfd_create``, descriptors over ``AF_UNIX``): forked workers inherit the sockets,
and a fork server's (or a spawned) worker is handed its end when it starts (multiprocessing passes
the descriptors of a socket pickled into the new process); elsewhere the collator's one
shared-memory buffer goes through torch's handover.

Example (worker 1, a micro batch of 3 tensors)::

    described = handover.send(tmb, worker=1, token=17)  # tensors -> Slot(offset, dtype, shape)
    tmb = handover.receive(described)                     # views of one mapped buffer
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import struct
import weakref
from dataclasses import dataclass

import torch

from rollfeed.collate import RaggedRows, TensorMicroBatch

KEEP = 4  # free buffers a worker keeps for reuse
_ALIGN = 64
_ROUND = 1 << 20  # buffers are whole MiB, so that micro batches of a little more reuse them
_SENT = struct.Struct("<qq")  # token, buffer number (worker -> trainer, with the descriptor)
_FREE = struct.Struct("<q")  # buffer number (trainer -> worker)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor of a micro batch lies in its buffer (contiguous)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Described:
    """A micro batch whose tensors are :class:`Slot`\\ s of ``nbytes`` of a buffer, sent by
    ``worker`` with ``token``."""

    batch: TensorMicroBatch
    nbytes: int
    worker: int
    token: int


@dataclass(slots=True)
class _Buffer:
    fd: int
    nbytes: int
    data: torch.Tensor  # [nbytes] uint8, this worker's mapping


class Handover:
    """One socket pair per worker, made before the workers start (see the module doc); each
    worker's pool of buffers is made in that worker."""

    def __init__(self, workers: int) -> None:
        self.pairs = [
            socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(workers)
        ]
        self._pid = os.getpid()
        self._buffers: dict[int, _Buffer] = {}
        self._free: list[int] = []

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")

    def send(self, tmb: TensorMicroBatch, *, worker: int, token: int) -> Described:
        """In worker ``worker``: ``tmb`` written into a buffer whose descriptor is sent now."""
        sizes = [t.numel() * t.element_size() for t in tmb.tensors()]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // _ALIGN) * _ALIGN)
        nbytes = max(offsets[-1], 1)
        number = self._take(worker, nbytes)
        buf = self._buffers[number].data
        at = iter(offsets)

        def place(t: torch.Tensor) -> Slot:  # apply() visits tensors in tensors() order
            offset = next(at)
            view = buf[offset : offset + t.numel() * t.element_size()]
            view.view(t.dtype).view(t.shape).copy_(t)
            return Slot(offset, t.dtype, tuple(t.shape))

        described = Described(tmb.apply(place), nbytes, worker, token)  # type: ignore[arg-type]
        fd = self._buffers[number].fd
        socket.send_fds(self.pairs[worker][1], [_SENT.pack(token, number)], [fd])
        return described

    def _take(self, worker: int, nbytes: int) -> int:
        """A free buffer of at least ``nbytes`` (given back ones first), or a new one."""
        if self._pid != os.getpid():  # a new worker: no buffers of its own yet
            self._pid, self._buffers, self._free = os.getpid(), {}, []
        end = self.pairs[worker][1]
        while True:
            try:
                self._free.append(_FREE.unpack(end.recv(_FREE.size, socket.MSG_DONTWAIT))[0])
            except BlockingIOError:
                break
        fits = [n for n in self._free if self._buffers[n].nbytes >= nbytes]
        if fits:
            number = min(fits, key=lambda n: self._buffers[n].nbytes)
            self._free.remove(number)
        else:
            number = max(self._buffers, default=-1) + 1
            size = -(-nbytes // _ROUND) * _ROUND
            fd = os.memfd_create("rollfeed-micro-batch", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            data = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
            self._buffers[number] = _Buffer(fd, size, data)
        while len(self._free) > KEEP:  # the smallest go: the larger fit more micro batches
            small = min(self._free, key=lambda n: self._buffers[n].nbytes)
            self._free.remove(small)
            os.close(self._buffers.pop(small).fd)
        return number

    def receive(self, described: Described) -> TensorMicroBatch:
        """In the trainer's process: the micro batch ``send`` described, mapped; its buffer is
        given back when the mapping's last tensor is gone."""
        end = self.pairs[described.worker][0]
        while True:  # a worker's buffers come in its order; those before were dropped
            data, fds, _, _ = socket.recv_fds(end, _SENT.size, 1)
            token, number = _SENT.unpack(data)
            assert fds and token <= described.token, (token, described.token)
            if token == described.token:
                break
            os.close(fds[0])  # made for a pass that was left (its micro batch was discarded)
            _give_back(end, number)
        try:
            buf = torch.from_file(
                f"/proc/self/fd/{fds[0]}", shared=True, size=described.nbytes, dtype=torch.uint8
            )
        finally:
            os.close(fds[0])
        weakref.finalize(buf.untyped_storage(), _give_back, end, number)

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
            fields={
                k: v.apply(view) if isinstance(v, RaggedRows) else view(v)
                for k, v in tmb.fields.items()
            },
            coverage={k: view(v) for k, v in tmb.coverage.items()},
            step_counts=None if tmb.step_counts is None else tmb.step_counts.apply(view),
            media=None if tmb.media is None else tmb.media.apply(view),
            tree=None if tmb.tree is None else tmb.tree.apply(view),
        )


def _give_back(end: socket.socket, number: int) -> None:
    """Tell the worker at the other ``end`` that buffer ``number`` is free (its workers may be
    gone: nothing to tell then)."""
    with contextlib.suppress(OSError):
        end.send(_FREE.pack(number), socket.MSG_DONTWAIT)
