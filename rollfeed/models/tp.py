"""Tensor-parallel reductions for vocab-parallel support scoring.

Under TP each rank holds a vocabulary shard ``[v0, v0 + V_local)`` of the logits (or of the LM-head
rows) and the *same* support rows, labels and upstream gradients. Scoring needs two reductions over
the TP group per call:

- :func:`all_reduce_max` — the row maxima ``[N]``, detached (the max is a shift that cancels out of
  every score, so it carries no gradient);
- :func:`all_reduce_sum_local_grad` — a stacked ``[2 or 3, N]`` of partial sums in one collective
  (flattened and followed by the ``[nnz]`` kept ids' logits, zero where another rank owns the id,
  when the kept logprobs are asked for).
  Its forward value is the global sum; its backward sends the incoming gradient to this rank's own
  local term only (``global + (local - local.detach())``). That is exact here because every rank
  evaluates the same loss from the same global sums, and shard r's logits enter those sums only
  through shard r's local term. The gradient a rank sees for its logits is therefore the TP=1
  gradient restricted to its shard, and the backward needs no collective.

:func:`full_vocab_size` finds ``V`` (one collective), which no rank knows from its shard alone.

All call ``torch.distributed.all_reduce`` through the module attribute, so a test can wrap it to
count collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def all_reduce_max(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    """Element-wise max over the TP group of a detached copy of ``x`` (``x`` is untouched)."""
    out = x.detach().clone()
    if tp_group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=tp_group)
    return out


def full_vocab_size(
    local_width: int, tp_group: ProcessGroup | None, device: torch.device | str = "cpu"
) -> int:
    """The full vocabulary ``V``: ``local_width`` without TP, the sum of the shards' widths under
    TP (the shards ``[vocab_start, vocab_start + V_local)`` tile ``[0, V)``).

    Under TP this is one 1-element all-reduce and one host sync; call it once (the scorer does, at
    construction) and pass the result on rather than per step. ``device``: where the collective's
    tensor lives (the backend's device, e.g. the LM head's).
    """
    if tp_group is None:
        return local_width
    total = torch.tensor([local_width], dtype=torch.int64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tp_group)
    return int(total.item())


def all_reduce_sum_local_grad(local: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``local`` over the TP group; the gradient flows back into ``local`` unchanged.

    Forward value: ``Σ_ranks local``. Backward: ``d out / d local = I`` on every rank (see the
    module docstring for why that is the right gradient for vocab-parallel scoring).
    """
    if tp_group is None:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tp_group)
    # `local - local.detach()` is exactly zero in the forward, so the value is the reduced sum bit
    # for bit, and the gradient reaches `local` through the identity.
    return total + (local - local.detach())


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; all-reduce SUM of the gradient in backward (Megatron's "copy to TP")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp_group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.tp_group = tp_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.tp_group)
        return grad, None


def sum_grad_over_tp(x: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    """``x`` unchanged; in backward its gradient is summed over the TP group.

    For an input every TP rank shares (the hidden states before a vocab-parallel LM head): each rank
    computes only its vocabulary shard's part of the gradient, and the true gradient is their sum.
    """
    if tp_group is None or not x.requires_grad:
        return x
    return _SumGradOverTP.apply(x, tp_group)
