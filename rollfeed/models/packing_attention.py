"""Attention over packed micro batches, optionally under Ulysses sequence parallelism.

A packed row holds several samples back to back. A token may attend only to earlier tokens of its
own sample, so the mask is block-diagonal causal. It is built from each token's *canonical index*
(its position in the whole pre-split row) and *segment id* (which sample it belongs to), so it is
right for any order in which the tokens reach attention (rank order under SP, zigzag included).

Example, row = sample A (3 tokens) + sample B (2 tokens), canonical order::

    segment  = [0, 0, 0, 1, 1]
    allowed[i, j] = segment[i] == segment[j] and j <= i
    row 3 (B's first token) attends only to itself.

The attention function plugs into transformers' registry under :data:`PACKED_ATTENTION`; the model
forward receives the layout as the keyword argument ``packing=PackedLayout`` and hands it down to
every attention call (transformers forwards extra keyword arguments to the attention function).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollfeed.models.ulysses import (
    SequenceParallel,
    gather_rank_order,
    heads_to_seq,
    seq_to_heads,
)

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "rollfeed_packed"


class PackingError(ValueError):
    """Packing metadata (positions, cu_seqlens, canonical indices) not describing the row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedLayout:
    """What attention needs to know about one packed row, in the order tokens reach attention.

    ``allowed [S, S]`` bool: query i may attend key j. ``sp``: the sequence-parallel group (size 1
    when the whole row is local). Build it once per forward with :func:`packed_layout`.
    """

    allowed: torch.Tensor
    sp: SequenceParallel


def segment_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[S]`` position ids restarting at 0 per sample (canonical order) -> ``[S]`` segment ids.

    Example: positions [0, 1, 2, 0, 1] -> segments [0, 0, 0, 1, 1]. The first token always opens a
    segment, even when a truncated row does not start at position 0.
    """
    starts = position_ids == 0
    starts[:1] = True
    return torch.cumsum(starts.to(torch.long), 0) - 1


def packed_layout(
    position_ids: torch.Tensor,
    *,
    sp: SequenceParallel | None = None,
    canonical_index: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> PackedLayout:
    """The attention layout of this rank's tokens ``position_ids [S/sp]``.

    ``canonical_index [S/sp]``: each local token's index in the whole row (default: contiguous
    shards, ``sp.rank * S/sp + arange``). ``cu_seqlens [B+1]``: sample boundaries of the whole row;
    without it, samples are read off the position ids (a reset to 0 opens a sample), which needs the
    tokens of each sample in canonical order, so give ``cu_seqlens`` for zigzag layouts.
    """
    sp = sp or SequenceParallel()
    local = position_ids.reshape(-1).to(torch.long)
    if canonical_index is None:
        canonical_index = sp.rank * local.numel() + torch.arange(local.numel(), device=local.device)
    elif canonical_index.numel() != local.numel():
        raise PackingError(
            f"canonical_index has {canonical_index.numel()} entries for {local.numel()} tokens"
        )
    order = gather_rank_order(canonical_index.reshape(-1).to(torch.long), sp)
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=order.device, dtype=torch.long)
        if bounds[0] != 0 or bounds[-1] < order.numel() or (bounds.diff() < 0).any():
            raise PackingError(
                f"cu_seqlens must start at 0, be non-decreasing and reach the row length "
                f"{order.numel()}; got {bounds.tolist()}"
            )
        segment = torch.searchsorted(bounds, order, right=True) - 1
    else:
        positions = gather_rank_order(local, sp)
        canonical = torch.empty_like(positions).index_copy_(0, order, positions)
        segment = segment_ids_from_positions(canonical)[order]
    allowed = (segment[:, None] == segment[None, :]) & (order[None, :] <= order[:, None])
    return PackedLayout(allowed=allowed, sp=sp)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    packing: PackedLayout,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q ``[B, H, S/sp, d]``, k/v ``[B, KV, S/sp, d]`` ->
    ``[B, S/sp, H, d]``. ``attention_mask`` from transformers is ignored: ``packing`` replaces it.
    """
    del attention_mask
    if kwargs.get("sliding_window") is not None:
        raise PackingError(
            f"packed attention implements full causal attention only; this layer asks for a "
            f"sliding window of {kwargs['sliding_window']} (use a model config without one)"
        )
    sp = packing.sp
    heads, kv_heads = query.shape[1], key.shape[1]
    if sp.enabled and kv_heads % sp.size:
        # Fewer KV heads than ranks: replicate each KV head for its query group so the split lines
        # up with the query heads' split (costs bandwidth, keeps the math exact).
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    query = seq_to_heads(query, sp, seq_dim=2, head_dim=1)
    key = seq_to_heads(key, sp, seq_dim=2, head_dim=1)
    value = seq_to_heads(value, sp, seq_dim=2, head_dim=1)
    if packing.allowed.shape[0] != query.shape[2]:
        raise PackingError(
            f"packing layout covers {packing.allowed.shape[0]} tokens, attention sees "
            f"{query.shape[2]}; build the layout from this forward's position ids"
        )
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=packing.allowed,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    out = heads_to_seq(out, sp, seq_dim=2, head_dim=1)
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> str:
    """Register :func:`packed_attention_forward` with transformers (idempotent); returns its name,
    for ``model.set_attn_implementation(name)`` or ``config._attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    return PACKED_ATTENTION
