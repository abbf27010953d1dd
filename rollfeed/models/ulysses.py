"""Ulysses sequence parallelism: all-to-all between sequence shards and head shards.

Each of ``sp`` ranks holds a slice of the sequence for every token-wise op (embeddings, MLP,
norms, LM head). Around attention, one all-to-all trades the sequence split for a head split, so
each rank attends over the whole sequence with ``heads / sp`` heads; a second all-to-all trades
back. Idea from DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509).

Shapes, for ``sp = 2``, ``S = 6`` tokens, ``H = 4`` heads::

    rank r holds x[3r:3r+3, :, :]            [S/sp, H, d]
    seq_to_heads  -> x[:, 2r:2r+2, :]        [S, H/sp, d]
    heads_to_seq  -> x[3r:3r+3, :, :]        [S/sp, H, d]   (inverse)

The gathered sequence is the concatenation of the ranks' shards in rank order ("rank order"). With a
non-contiguous layout (zigzag) that order differs from the canonical order of the row; pass each
rank's ``canonical_index`` to :func:`gather_sequence` to get canonical coordinates back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollfeed.errors import RollfeedError

logger = logging.getLogger(__name__)


class UlyssesShapeError(RollfeedError):
    """A head or sequence count that the sequence-parallel group cannot split evenly."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallel:
    """The sequence-parallel group of this rank (``group=None`` with ``size=1``: no parallelism).

    Built from whatever topology object the trainer has, e.g.
    ``SequenceParallel(group=sp_pg, rank=topo.sp_rank, size=topo.sp_size)``.
    """

    group: Any = None
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"SequenceParallel needs size >= 1 and 0 <= rank < size, got rank={self.rank}, "
                f"size={self.size}"
            )
        if self.size > 1 and self.group is None:
            raise ValueError(f"SequenceParallel size={self.size} needs a process group")

    @property
    def enabled(self) -> bool:
        return self.size > 1


def _all_to_all(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int):
    # Chunk c of the scattered dim goes to rank c; what rank c sends us lands in slot c, which is
    # the c-th block of the gathered dim, so rank order equals block order.
    send = torch.stack(x.chunk(sp.size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=sp.group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, scatter_dim, gather_dim):
        ctx.sp, ctx.scatter_dim, ctx.gather_dim = sp, scatter_dim, gather_dim
        return _all_to_all(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all is the all-to-all with the two dims swapped.
        return _all_to_all(grad, ctx.sp, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_heads(
    x: torch.Tensor, sp: SequenceParallel, *, seq_dim: int, head_dim: int
) -> torch.Tensor:
    """``[.., S/sp, .., H, ..]`` sequence shard -> ``[.., S, .., H/sp, ..]`` head shard.

    Differentiable (the backward is the inverse all-to-all).
    Raises :class:`UlyssesShapeError` when ``H`` is not a multiple of ``sp.size``.
    """
    if not sp.enabled:
        return x
    heads = x.shape[head_dim]
    if heads % sp.size:
        raise UlyssesShapeError(
            f"Ulysses needs the head count to be a multiple of the sequence-parallel size: "
            f"{heads} heads, sp={sp.size}; choose sp dividing {heads}"
        )
    return _AllToAll.apply(x, sp, head_dim, seq_dim)


def heads_to_seq(
    x: torch.Tensor, sp: SequenceParallel, *, seq_dim: int, head_dim: int
) -> torch.Tensor:
    """``[.., S, .., H/sp, ..]`` head shard -> ``[.., S/sp, .., H, ..]`` sequence shard; inverse of
    :func:`seq_to_heads`. Raises :class:`UlyssesShapeError` when ``S`` is not a multiple of sp."""
    if not sp.enabled:
        return x
    length = x.shape[seq_dim]
    if length % sp.size:
        raise UlyssesShapeError(
            f"Ulysses needs the sequence length to be a multiple of the sequence-parallel size: "
            f"S={length}, sp={sp.size}; pad micro batches to a multiple of {sp.size}"
        )
    return _AllToAll.apply(x, sp, seq_dim, head_dim)


def _all_gather(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=0)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp, ctx.rows = sp, x.shape[0]
        return _all_gather(x, sp)

    @staticmethod
    def backward(ctx, grad):
        # Every rank holds the same gathered tensor and computes the same function of it, so the
        # gradient of this rank's shard is its own block of the (identical) upstream gradient.
        start = ctx.sp.rank * ctx.rows
        return grad[start : start + ctx.rows], None


def gather_rank_order(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Non-differentiable all-gather along dim 0 in rank order (for index tensors)."""
    if not sp.enabled:
        return x
    with torch.no_grad():
        return _all_gather(x, sp)


def gather_sequence(
    x: torch.Tensor, sp: SequenceParallel, *, canonical_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Differentiable gather of per-token outputs ``[S/sp, ...]`` -> ``[S, ...]``.

    ``canonical_index [S/sp]`` (optional) gives each local row's position in the full row; without
    it the result is in rank order (right for contiguous sharding). Every rank must then compute the
    same loss from the result; the backward hands each rank its own rows' gradient.

    Example, sp=2, zigzag-like indices: rank 0 holds rows for positions [0, 3], rank 1 [1, 2];
    the gather returns rows ordered 0, 1, 2, 3.
    """
    out = _GatherSequence.apply(x, sp) if sp.enabled else x
    if canonical_index is None:
        return out
    order = gather_rank_order(canonical_index.to(torch.long), sp)
    inverse = torch.argsort(order)
    if not torch.equal(order[inverse], torch.arange(order.numel(), device=order.device)):
        raise ValueError(
            f"canonical_index must be a permutation of 0..{order.numel() - 1} across the "
            "sequence-parallel group; got duplicates or gaps"
        )
    return out[inverse]
