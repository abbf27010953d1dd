"""Support scoring in the LM head's place, for one call of the model's own forward.

Sharded trainers (FSDP2 ``fully_shard``, DTensor tensor parallelism) act through hooks that run
only when a module is called: FSDP gathers a module's parameters before its forward and reduce-
scatters their gradients after its backward; a ``ColwiseParallel`` head converts its input and
output. So the scorer calls the model itself, and only the head's ``forward`` is swapped, for that
call, for the fused support scorer (:func:`~rollfeed.models.fused_support_logprobs`): every hook
fires as in training, the head's weight is the gathered (or TP-local) tensor the forward sees, its
gradient lands where FSDP expects it, and no ``[N, V]`` logits exist.

The swapped head returns, where the logits would be, a ``[1, N, 2]`` tensor of the scores
(logprob, entropy) per input position, so the loss depends on the model's output (FSDP's pre-
backward hooks hang on it). With ``return_support_logprobs`` the kept ids' logprobs ride along in
the same tensor, ``[1, N + ceil(nnz / 2), 2]``: rows ``N:`` hold the ``nnz`` values in order
(and a ``-inf`` pad when ``nnz`` is odd), so a loss over them reaches the head through the
model's output too. Under a ``DTensor`` head it is returned as a ``Shard(-1)`` DTensor of
identical per-rank blocks: the head's output hook either keeps that layout (``Shard(-1)``, the
default) or all-gathers it (``Replicate()``), and each rank reads back its own block; the backward
of the gather sends each block's gradient to its own rank only. Labels, support, temperature and
options reach the head through the :class:`HeadCall` bound to the swapped forward, never through
module state that outlives the call.

Worked example, ``N = 3`` positions, one TP rank of two, head output hook ``Replicate()``::

    head returns   DTensor [1, 3, 4] Shard(-1), local block [1, 3, 2] = (logp, entropy)
    model output   [1, 3, 4] (both ranks' identical blocks) -> this rank reads [..., 2r : 2r + 2]
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rollfeed.collate import RaggedRows
from rollfeed.models.candidates import MissingLabel
from rollfeed.models.errors import LMHeadError
from rollfeed.models.fused import fused_support_logprobs
from rollfeed.models.head_shard import head_shard
from rollfeed.models.support import SupportScores
from rollfeed.models.tp import ProcessGroup

# Config entries of HF models whose forward transforms the head's output (soft-capping, scaling,
# cropping); the value that leaves the logits unchanged, when there is one.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logits_soft_cap": None,
    "logits_scaling": 1.0,
    "logit_scale": 1.0,
    "output_multiplier": 1.0,
    "unpadded_vocab_size": None,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadCall:
    """One scoring call: ``labels [N]``, ``support`` ragged rows (``N`` of them),
    ``temperature`` scalar or ``[N]``,
    ``fallback_mask [N]`` or None, and the options of :func:`fused_support_logprobs`
    (``tp_group`` / ``vocab_start`` for a plain-tensor shard; a DTensor head says its own).
    ``rows [N]``: the hidden state each row is scored from, an index into the head's input
    tokens (a row holding prefix trees scores a shared prefix's last token once per branch);
    None: row ``i`` from token ``i``."""

    labels: torch.Tensor
    support: RaggedRows
    temperature: float | torch.Tensor
    fallback_mask: torch.Tensor | None
    chunk_size: int
    compute_entropy: bool
    entropy_requires_grad: bool
    return_support_logprobs: bool
    missing_label: MissingLabel
    tp_group: ProcessGroup | None
    vocab_start: int
    vocab_size: int
    rows: torch.Tensor | None = None


@dataclass(kw_only=True, slots=True)
class _Scored:
    """What the swapped head leaves for :func:`support_head`'s reader (filled during the call)."""

    packed: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    kept: RaggedRows | None = None
    metrics: dict[str, torch.Tensor] | None = None
    block: int = 0
    blocks: int = 1


def check_head(model: nn.Module) -> nn.Module:
    """The model's LM head, if the scorer can take its place exactly; else :class:`LMHeadError`."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise LMHeadError(
            f"{type(model).__name__} has no LM head with a weight (get_output_embeddings()); "
            "score a causal LM (...ForCausalLM)"
        )
    if getattr(head, "bias", None) is not None:
        raise LMHeadError(
            f"the LM head of {type(model).__name__} has a bias, which support scoring does not "
            "add; score a head without bias",
            tensor="lm_head.bias",
        )
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(text, name, None)
        if value is not None and value != neutral:
            raise LMHeadError(
                f"{type(model).__name__} transforms its logits after the LM head "
                f"(config.{name}={value!r}); support scores from the head's output would not be "
                "the model's. Such models are not supported",
                tensor="logits",
            )
    return head


@contextmanager
def support_head(head: nn.Module, call: HeadCall) -> Iterator[Any]:
    """Swap ``head.forward`` for support scoring while the block runs; yield ``read``, which turns
    the model output's ``logits`` into this rank's :class:`SupportScores` (``[N]`` each)."""
    scored = _Scored()
    own = head.__dict__.get("forward")  # an instance-level forward someone else installed
    head.forward = functools.partial(_scoring_forward, head, call, scored)
    try:
        yield functools.partial(_read, call, scored)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _scoring_forward(
    head: nn.Module, call: HeadCall, scored: _Scored, hidden: torch.Tensor
) -> torch.Tensor:
    weight = head.weight
    shard = head_shard(hidden, weight, tp_group=call.tp_group, vocab_start=call.vocab_start)
    local = shard.hidden.reshape(-1, shard.hidden.shape[-1])
    if call.rows is not None:
        local = local.index_select(0, call.rows)
    scores = fused_support_logprobs(
        local,
        shard.weight,
        call.labels,
        call.support,
        chunk_size=call.chunk_size,
        temperature=call.temperature,
        compute_entropy=call.compute_entropy,
        return_support_logprobs=call.return_support_logprobs,
        entropy_requires_grad=call.entropy_requires_grad,
        fallback_mask=call.fallback_mask,
        missing_label=call.missing_label,
        tp_group=shard.tp_group,
        vocab_start=shard.vocab_start,
        vocab_size=call.vocab_size,
        reduce_hidden_grad=shard.reduce_hidden_grad,
    )
    logp = scores.logprobs
    entropy = torch.zeros_like(logp) if scores.entropy is None else scores.entropy.to(logp.dtype)
    # Stacked from [1, N] rows, not unsqueezed: FSDP warns on a view as a module's output.
    packed = torch.stack([logp[None], entropy[None]], -1)
    kept = scores.support_logprobs
    if kept is not None:
        values = kept.values.to(logp.dtype)
        if values.numel() % 2:
            values = torch.cat([values, values.new_full((1,), float("-inf"))])
        packed = torch.cat([packed, values.view(1, -1, 2)], 1)
    scored.packed, scored.valid, scored.metrics = packed, scores.valid_mask, scores.metrics
    scored.kept = kept
    if not isinstance(weight, DTensor):
        return packed
    mesh = weight.device_mesh
    scored.block, scored.blocks = mesh.get_local_rank(), mesh.size()
    return DTensor.from_local(packed, mesh, [Shard(-1)], run_check=False)


def _read(call: HeadCall, scored: _Scored, logits: torch.Tensor) -> SupportScores:
    if scored.packed is None:
        raise LMHeadError(
            "the model's forward did not call its LM head's forward (it computes logits another "
            "way), so support scores cannot take the logits' place",
            tensor="logits",
        )
    packed = scored.packed
    out = logits.to_local() if isinstance(logits, DTensor) else logits
    n = packed.shape[1]
    rows = call.labels.shape[0]
    if out.shape[-1] == 2 * scored.blocks and scored.blocks > 1:
        out = out[..., 2 * scored.block : 2 * scored.block + 2]  # gathered by the head's hook
    elif out.data_ptr() != packed.data_ptr():
        # Not gathered, so it must be the very tensor the head returned: anything else means the
        # forward changed it (soft-capping, scaling, casting, cropping).
        raise LMHeadError(
            "the model's forward changed its LM head's output before returning it (logit "
            f"transforms or a cast: got {tuple(out.shape)} {out.dtype}, the head returned "
            f"{tuple(packed.shape)} {packed.dtype}); such models are not supported",
            tensor="logits",
        )
    if tuple(out.shape) != (1, n, 2) or out.dtype != packed.dtype:
        raise LMHeadError(
            f"the LM head's output came back as {tuple(out.shape)} {out.dtype}, the head returned "
            f"{tuple(packed.shape)} {packed.dtype}; the model's forward transforms its logits",
            tensor="logits",
        )
    entropy = None
    if call.compute_entropy:
        entropy = out[0, :rows, 1] if call.entropy_requires_grad else out[0, :rows, 1].detach()
    kept = scored.kept
    if kept is not None:
        kept = kept.with_values(out[0, rows:].reshape(-1)[: kept.nnz])
    assert scored.valid is not None and scored.metrics is not None
    return SupportScores(
        logprobs=out[0, :rows, 0],
        entropy=entropy,
        valid_mask=scored.valid,
        support_logprobs=kept,
        metrics=scored.metrics,
    )
