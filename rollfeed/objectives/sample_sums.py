"""Per-sample sums over loss tokens, exact when a packed row is split over ``cp`` ranks.

A rank holds ``N`` positions of a packed row (``positions [N]``, in the whole row) whose slots
(one per sample, then the tail padding) are ``cu_seqlens [num_slots + 1]`` (see
:class:`rollfeed.collate.TensorMicroBatch`). Every rank adds its loss tokens' ``columns [N, k]``
into ``[num_slots, k]``; one SUM all-reduce over the ``cp`` group makes each sample's sums whole,
and every token reads its own sample's sums back.

Example: ``cu_seqlens [0, 3, 5, 6]``, cp 2 contiguous, loss tokens at positions 0, 1 (rank 0) and
3 (rank 1), column ``log r = [0.1, 0.2, -0.5]``: slots ``[0.3, -0.5, 0]``; rank 0 reads
``[0.3, 0.3, 0.3]`` at positions 0..2, rank 1 ``[-0.5, -0.5, 0]`` at 3..5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollfeed.objectives.errors import ObjectiveInputError


def sample_sums(
    columns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``[N, k]``: each token's sample's sums of ``columns [N, k]`` over its loss tokens, over
    every rank of ``group`` (one all-reduce of ``[num_slots, k]``; detached)."""
    n = loss_mask.numel()
    if positions.shape != (n,) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ObjectiveInputError(
            f"positions must be [{n}] and cu_seqlens [num_slots + 1] (from the micro batch), got "
            f"{tuple(positions.shape)} and {tuple(cu_seqlens.shape)}",
            tensor="positions",
        )
    bounds = cu_seqlens.to(device=positions.device, dtype=torch.int64)
    slots = bounds.numel() - 1
    slot = torch.searchsorted(bounds, positions.long(), right=True) - 1
    slot = slot.clamp(0, slots - 1)
    with torch.no_grad():
        kept = torch.where(loss_mask[:, None], columns.detach(), 0.0)
        sums = torch.zeros(slots, columns.shape[1], dtype=columns.dtype, device=columns.device)
        sums = sums.index_add(0, slot, kept)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
    return sums[slot]
