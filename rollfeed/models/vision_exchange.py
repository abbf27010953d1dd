"""Image embeddings to the ``cp`` ranks that hold their placeholder tokens.

Under ``cp`` a packed row is split after the embedding: each rank embeds its own tokens, and the
vision tower's work is divided too, each rank encoding the distinct images the row's deal gives it
(:mod:`rollfeed.collate.image_owners`). An image's placeholder tokens may lie on any rank (a run
split by a contiguous chunk boundary, zigzag chunks, the same image at several runs), so after
encoding, each merged-patch row goes from the rank that encoded it to the rank that holds its
token: one uneven all-to-all (:class:`ExchangePlan`), whose backward is the reverse all-to-all, so
every placeholder's gradient reaches the rank that encoded it (summed where an image fills several
runs).

:func:`exchange_plan` is pure arithmetic every rank does alike from the micro batch:

- ``send [K]``: rows of this rank's encoder output to send, grouped by destination rank (rank
  order), each group in the destination's local token order; ``send_counts [cp]``;
- ``recv_counts [cp]``: rows arriving from each rank; ``local [n]``: where each arriving row goes
  among this rank's placeholder tokens (in local token order, the order ``masked_scatter`` fills).

Worked example (one image of 4 tokens at row positions 2..5 of a row of 8, cp 2, contiguous;
rank 0 encodes it)::

    rank 0 holds 0..3 (placeholders 2, 3), rank 1 holds 4..7 (placeholders 4, 5)
    rank 0: send [0, 1, 2, 3]  send_counts [2, 2]  recv_counts [2, 0]  local [0, 1]
    rank 1: send []            send_counts [0, 0]  recv_counts [2, 0]  local [0, 1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rollfeed.models.cp_group import CPGroup


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangePlan:
    """One rank's part of the all-to-all; see the module doc."""

    send: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    local: torch.Tensor


def exchange_plan(
    *,
    spans: np.ndarray,
    grids: np.ndarray,
    owner: np.ndarray,
    merge: int,
    order: np.ndarray,
    cp_rank: int,
    cp_size: int,
    device: torch.device,
) -> ExchangePlan:
    """This rank's plan from the row's placeholder runs ``spans [R, 3]`` (row start, tokens,
    image), the distinct images' ``grids [U, 3]``, their ``owner [U]`` ranks, the vision tower's
    ``merge`` size and ``order [S]``: the row position of every token in rank order (rank ``d``
    holds ``order[d * S / cp : (d + 1) * S / cp]``, in its local order: the packed layout's
    ``order``)."""
    tokens = [math.prod(g) // merge**2 for g in grids.tolist()]
    first = np.zeros(len(tokens), np.int64)  # each image's first row in its owner's output
    done = np.zeros(cp_size, np.int64)
    for u, n in enumerate(tokens):
        first[u] = done[owner[u]]
        done[owner[u]] += n
    length = len(order)
    per_rank = length // cp_size
    image = np.full(length, -1, np.int64)  # the image at each row position, -1 for text
    row = np.zeros(length, np.int64)  # its row in the owner's output
    for start, n, u in spans.tolist():
        image[start : start + n] = u
        row[start : start + n] = first[u] + np.arange(n)
    send, send_counts, recv_counts, local = [], [], [], None
    for d in range(cp_size):
        held = order[d * per_rank : (d + 1) * per_rank]
        held = held[image[held] >= 0]  # d's placeholder tokens, in d's local order
        src = owner[image[held]]
        mine = src == cp_rank
        send.append(row[held[mine]])
        send_counts.append(int(mine.sum()))
        if d == cp_rank:
            arrivals = np.argsort(src, kind="stable")  # by source rank, local order within
            recv_counts = np.bincount(src, minlength=cp_size).tolist()
            local = np.empty(len(arrivals), np.int64)
            local[arrivals] = np.arange(len(arrivals))
    assert local is not None
    return ExchangePlan(
        send=torch.from_numpy(np.concatenate(send)).to(device),
        send_counts=send_counts,
        recv_counts=recv_counts,
        local=torch.from_numpy(local).to(device),
    )


def _all_to_all(x: torch.Tensor, cp: CPGroup, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=cp.group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, send, recv):
        ctx.cp, ctx.send, ctx.recv = cp, send, recv
        return _all_to_all(x, cp, send, recv)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all: every row's gradient goes back to the rank it came from.
        return _all_to_all(grad, ctx.cp, ctx.recv, ctx.send), None, None, None


def exchange(features: torch.Tensor, plan: ExchangePlan, cp: CPGroup) -> torch.Tensor:
    """``[n, F]``: this rank's placeholder rows (local token order) from every rank's encoder
    output ``features [M, F]`` (differentiable; a collective over ``cp`` when it is enabled)."""
    rows = features.index_select(0, plan.send)
    if cp.enabled:
        rows = _Exchange.apply(rows, cp, plan.send_counts, plan.recv_counts)
    return rows.index_select(0, plan.local)
