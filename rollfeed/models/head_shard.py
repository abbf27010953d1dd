"""HeadShard: the part of the LM head this rank scores, read from its weight and hidden states.

A vocabulary-parallel head holds rows ``[vocab_start, vocab_start + V_local)`` of the ``[V, H]``
weight on each rank of a tensor-parallel group. Two ways to say so:

- a ``DTensor`` weight (``parallelize_module(..., {"lm_head": ColwiseParallel()})``): its mesh
  and placement say it. ``Shard(0)`` on a 1-D mesh is vocabulary-parallel (group = the mesh's,
  ``vocab_start`` from torch's even chunking of dim 0); ``Replicate()`` is scored as unsharded;
  any other placement is refused with :class:`~rollfeed.models.LMHeadError` naming it;
- a plain local shard (Megatron-style heads): the caller passes ``tp_group`` and ``vocab_start``.

Hidden states entering a ``DTensor`` head may be a ``DTensor`` too (replicated, or sequence-
parallel ``Shard(1)``): they are redistributed to ``Replicate()`` and, under ``Shard(0)``, handed
on with a ``Partial`` gradient, so DTensor's own backward sums the shards' parts (and reduce-
scatters them back to ``Shard(1)``). Plain hidden states under a sharded head get that sum from
:func:`~rollfeed.models.tp.sum_grad_over_tp` instead (``reduce_hidden_grad``).

Worked example: ``V = 10`` over a 1-D mesh of 3 ranks, ``Shard(0)``: torch chunks dim 0 in
``ceil(10 / 3) = 4`` rows -> rank 0 rows ``[0, 4)``, rank 1 ``[4, 8)``, rank 2 ``[8, 10)``;
``HeadShard(vocab_start=8, ...)`` on rank 2 with a ``[2, H]`` local weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from rollfeed.models.errors import LMHeadError
from rollfeed.models.tp import full_vocab_size


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadShard:
    """What this rank scores: ``hidden [..., H]`` and ``weight [V_local, H]`` as local tensors, the
    TP group (None: unsharded), ``vocab_start``, and whether the scorer must sum the hidden
    gradient over the group itself (``reduce_hidden_grad``)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    vocab_start: int
    reduce_hidden_grad: bool


def head_vocab_size(
    weight: torch.Tensor, *, tp_group: dist.ProcessGroup | None, vocab_start: int
) -> int:
    """The full vocabulary ``V``: a ``DTensor`` weight's global rows; for a plain shard under
    ``tp_group``, the sum of the shards' widths (one all-reduce: call it once, on every TP rank)."""
    if isinstance(weight, DTensor):
        _refuse_manual(tp_group, vocab_start)
        return weight.shape[0]
    return full_vocab_size(weight.shape[0], tp_group, weight.device)


def _refuse_manual(tp_group: dist.ProcessGroup | None, vocab_start: int) -> None:
    if tp_group is not None or vocab_start:
        raise LMHeadError(
            "the LM-head weight is a DTensor, whose mesh and placement say how it is sharded; "
            "drop tp_group= / vocab_start= (they describe plain-tensor shards only)",
            tensor="lm_head.weight",
        )


def head_shard(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
) -> HeadShard:
    """Local tensors and TP coordinates for ``hidden [..., H]`` (``[1, N, H]`` in an HF head) and
    the head weight (module doc).

    ``tp_group`` / ``vocab_start``: the manual description of a plain-tensor shard; given with a
    ``DTensor`` weight they would say the same thing twice, possibly differently: refused.
    """
    if not isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):  # a replicated head behind a sharded body
            hidden = hidden.full_tensor()
        return HeadShard(
            hidden=hidden,
            weight=weight,
            tp_group=tp_group,
            vocab_start=vocab_start,
            reduce_hidden_grad=tp_group is not None,
        )
    _refuse_manual(tp_group, vocab_start)
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1:
        raise LMHeadError(
            f"the LM-head weight is a DTensor on a {mesh.ndim}-D mesh with placements "
            f"{placements}; the scorer takes a head sharded over one tensor-parallel axis "
            "(FSDP's own dimension is gathered before the forward)",
            tensor="lm_head.weight",
        )
    (placement,) = placements
    if isinstance(placement, Replicate):
        local = hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
        return HeadShard(
            hidden=local,
            weight=weight.to_local(),
            tp_group=None,
            vocab_start=0,
            reduce_hidden_grad=False,
        )
    if not (isinstance(placement, Shard) and placement.dim == 0):
        raise LMHeadError(
            f"the LM-head weight is a DTensor placed {placement}; the scorer takes Shard(0) "
            "(vocabulary-parallel, e.g. ColwiseParallel on the head) or Replicate()",
            tensor="lm_head.weight",
        )
    local_weight = weight.to_local()
    start = _shard_start(weight.shape[0], mesh.size(), mesh.get_local_rank())
    if local_weight.shape[0] != min(weight.shape[0] - start, _chunk(weight.shape[0], mesh.size())):
        raise LMHeadError(
            f"the LM-head shard holds {local_weight.shape[0]} rows at vocab_start {start} of "
            f"{weight.shape[0]}; torch's Shard(0) chunking would give "
            f"{_chunk(weight.shape[0], mesh.size())} per rank (an uneven custom shard)",
            tensor="lm_head.weight",
        )
    if isinstance(hidden, DTensor):
        replicated = hidden.redistribute(placements=[Replicate()])
        # Each rank's gradient covers its vocabulary shard only: a Partial sum, which DTensor's
        # backward reduces (all-reduce, or reduce-scatter back to a sequence-parallel Shard(1)).
        local_hidden = replicated.to_local(grad_placements=[Partial()])
        reduce = False
    else:
        local_hidden, reduce = hidden, True
    return HeadShard(
        hidden=local_hidden,
        weight=local_weight,
        tp_group=mesh.get_group(),
        vocab_start=start,
        reduce_hidden_grad=reduce,
    )


def _chunk(rows: int, parts: int) -> int:
    return -(-rows // parts)


def _shard_start(rows: int, parts: int, rank: int) -> int:
    return min(rank * _chunk(rows, parts), rows)
