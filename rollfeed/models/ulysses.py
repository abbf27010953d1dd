"""Ulysses: the scorer's algorithm over the ``cp`` group, all-to-all between row and head shards.

Each of the ``cp`` ranks holds a slice of the packed row for every token-wise op (embeddings, MLP,
norms, LM head). Around attention, one all-to-all trades the row split for a head split, so each
rank attends over the whole row with ``heads / cp`` heads; a second all-to-all trades back. Idea
from DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509).

Shapes, for ``cp = 2``, ``S = 6`` tokens, ``H = 4`` heads::

    rank r holds x[3r:3r+3, :, :]            [S/cp, H, d]
    seq_to_heads  -> x[:, 2r:2r+2, :]        [S, H/cp, d]
    heads_to_seq  -> x[3r:3r+3, :, :]        [S/cp, H, d]   (inverse)

The gathered row is the concatenation of the ranks' shards in rank order ("rank order"). With a
non-contiguous layout (zigzag) that order differs from the canonical order of the row; pass each
rank's ``canonical_index`` to :func:`gather_sequence` to get canonical coordinates back.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from rollfeed.models.cp_group import CPGroup
from rollfeed.models.errors import PackingError, UlyssesShapeError

logger = logging.getLogger(__name__)


def _all_to_all(x: torch.Tensor, cp: CPGroup, scatter_dim: int, gather_dim: int):
    # Chunk c of the scattered dim goes to rank c; what rank c sends us lands in slot c, which is
    # the c-th block of the gathered dim, so rank order equals block order.
    send = torch.stack(x.chunk(cp.size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=cp.group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, scatter_dim, gather_dim):
        ctx.cp, ctx.scatter_dim, ctx.gather_dim = cp, scatter_dim, gather_dim
        return _all_to_all(x, cp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all is the all-to-all with the two dims swapped.
        return _all_to_all(grad, ctx.cp, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, cp: CPGroup, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """``[.., S/cp, .., H, ..]`` row shard -> ``[.., S, .., H/cp, ..]`` head shard.

    Differentiable (the backward is the inverse all-to-all).
    Raises :class:`~rollfeed.models.UlyssesShapeError` when ``H`` is not a multiple of
    ``cp.size``.
    """
    if not cp.enabled:
        return x
    heads = x.shape[head_dim]
    if heads % cp.size:
        raise UlyssesShapeError(
            f"Ulysses needs the head count to be a multiple of the cp size: {heads} heads, "
            f"cp={cp.size}; choose a cp size dividing {heads}"
        )
    return _AllToAll.apply(x, cp, head_dim, seq_dim)


def heads_to_seq(x: torch.Tensor, cp: CPGroup, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """``[.., S, .., H/cp, ..]`` head shard -> ``[.., S/cp, .., H, ..]`` row shard; inverse of
    :func:`seq_to_heads`. Raises :class:`~rollfeed.models.UlyssesShapeError` when ``S`` is not a
    multiple of ``cp.size``."""
    if not cp.enabled:
        return x
    length = x.shape[seq_dim]
    if length % cp.size:
        raise UlyssesShapeError(
            f"Ulysses needs the row length to be a multiple of the cp size: S={length}, "
            f"cp={cp.size}; plan micro batches with PlanConfig(cp_size={cp.size})"
        )
    return _AllToAll.apply(x, cp, seq_dim, head_dim)


def _all_gather(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    return torch.cat(parts, dim=0)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp, ctx.rows = cp, x.shape[0]
        return _all_gather(x, cp)

    @staticmethod
    def backward(ctx, grad):
        # Every rank holds the same gathered tensor and computes the same function of it, so the
        # gradient of this rank's shard is its own block of the (identical) upstream gradient.
        start = ctx.cp.rank * ctx.rows
        return grad[start : start + ctx.rows], None


def gather_rank_order(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Non-differentiable all-gather along dim 0 in rank order (for index tensors)."""
    if not cp.enabled:
        return x
    with torch.no_grad():
        return _all_gather(x, cp)


def gather_sequence(
    x: torch.Tensor, cp: CPGroup, *, canonical_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Differentiable gather of per-token outputs ``[S/cp, ...]`` -> ``[S, ...]``.

    ``canonical_index [S/cp]`` (optional) gives each local row's position in the full row;
    without it the result is in rank order (right for contiguous sharding). Every rank must then
    compute the same loss from the result; the backward hands each rank its own rows' gradient.
    Raises :class:`~rollfeed.models.PackingError` when the indices of the group are not a
    permutation of ``0..S-1``.

    Example, cp=2, zigzag-like indices: rank 0 holds rows for positions [0, 3], rank 1 [1, 2];
    the gather returns rows ordered 0, 1, 2, 3.
    """
    out = _GatherSequence.apply(x, cp) if cp.enabled else x
    if canonical_index is None:
        return out
    order = gather_rank_order(canonical_index.to(torch.long), cp)
    inverse = torch.argsort(order)
    if not torch.equal(order[inverse], torch.arange(order.numel(), device=order.device)):
        raise PackingError(
            f"canonical_index must be a permutation of 0..{order.numel() - 1} across the cp "
            "group; got duplicates or gaps",
            tensor="canonical_index",
        )
    return out[inverse]


def gather_uneven(
    x: torch.Tensor,
    cp: CPGroup,
    counts: tuple[int, ...],
    *,
    canonical_index: torch.Tensor,
) -> torch.Tensor:
    """Differentiable gather of per-row outputs when rank ``r`` holds ``counts[r]`` rows (a row
    holding prefix trees: ranks hold different numbers of flat rows): ``[counts[rank], ...]`` ->
    ``[sum(counts), ...]`` in canonical order (``canonical_index [counts[rank]]`` each local
    row's position). Each rank's rows are padded to the largest count for the all-gather.

    Example, cp 2, counts (3, 1): rank 0 holds rows for positions [0, 1, 3], rank 1 [2]; the
    gather returns rows ordered 0, 1, 2, 3.
    """
    if len(counts) != cp.size or x.shape[0] != counts[cp.rank]:
        raise PackingError(
            f"this rank holds {x.shape[0]} rows, the micro batch says {counts} over cp "
            f"{cp.size}; score the micro batch split for this rank",
            tensor="positions",
        )
    top = max(counts)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return (
            torch.cat([t, t.new_zeros(top - t.shape[0], *t.shape[1:])]) if top > t.shape[0] else t
        )

    index = canonical_index.to(torch.long)
    if cp.enabled:
        every = _GatherSequence.apply(padded(x), cp)
        take = torch.cat(
            [torch.arange(r * top, r * top + n, device=x.device) for r, n in enumerate(counts)]
        )
        x = every.index_select(0, take)
        index = gather_rank_order(padded(index), cp).index_select(0, take)
    inverse = torch.argsort(index)
    if not torch.equal(index[inverse], torch.arange(index.numel(), device=index.device)):
        raise PackingError(
            f"canonical_index must be a permutation of 0..{index.numel() - 1} across the cp "
            "group; got duplicates or gaps",
            tensor="canonical_index",
        )
    return x[inverse]
