"""Support-conditioned logprobs and entropy from materialised logits (the plain path).

With ``l = logits / temperature`` over the recorded support ``S`` of each row::

    m = max_S l,  Z = Σ_S exp(l − m),  logp = l_y − m − log Z,  H_S = log Z − Σ_S exp(l − m)(l − m) / Z

Support semantics (sets, padding, fallback rows, labels outside the support) are described in
:mod:`rollfeed.models.candidates`; the TP reductions in :mod:`rollfeed.models.tp`.
"""

from __future__ import annotations

import dataclasses

import torch

from rollfeed.models.candidates import (
    check_ids,
    check_inputs,
    compute_dtype,
    score_candidates,
    support_members,
    support_metrics,
)
from rollfeed.models.tp import ProcessGroup, vocab_shard


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SupportScores:
    """Result of a support scorer.

    Attributes:
        logprobs: ``[N]`` label logprob normalised over the row's support (0 on invalid rows).
        entropy: ``[N]`` entropy of the support-restricted distribution, or None when not asked.
        valid_mask: ``[N]`` bool, rows that were scored (non-empty support or fallback).
        metrics: 0-d int64 tensors: ``rows_valid``, ``rows_fallback``, ``rows_singleton``,
            ``label_outside_support``, ``duplicate_ids`` (no host sync until ``.item()``).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    valid_mask: torch.Tensor
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def support_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    support: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
    fallback_mask: torch.Tensor | None = None,
    tp_group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    validate: bool = True,
) -> SupportScores:
    """Score ``labels`` under ``logits`` renormalised over each row's recorded support.

    Args:
        logits: ``[N, V_local]`` (the whole vocabulary, or this rank's shard under TP); any float
            dtype, scored in fp32 (fp64 stays fp64). Only the support columns (plus full rows for
            fallback rows) are read, so gradients are sparse in the vocabulary.
        labels: ``[N]`` int, the sampled token of each row (global ids).
        support: ``[N, K]`` int32/int64 global token ids, ``-1`` padding (see
            :mod:`rollfeed.models.candidates` for the exact semantics; repeats count once).
        temperature: the sampler's temperature; logits are divided by it.
        compute_entropy: also return the support entropy ``H_S``.
        entropy_requires_grad: let the entropy carry gradients (for an entropy loss term);
            otherwise it is a detached metric.
        fallback_mask: ``[N]`` bool; those rows are scored over the full vocabulary (a named,
            counted policy, e.g. a synthetic EOS with no recorded support). Selecting them costs a
            host sync.
        tp_group: TP group when ``logits`` is vocab-parallel; one MAX and one SUM all-reduce per call.
        vocab_start, vocab_size: this rank's first id and the full vocabulary size; default to
            an even split ``rank · V_local`` and ``world · V_local``.
        validate: check id ranges (one host sync). Pass False when ids were checked upstream.

    Returns:
        :class:`SupportScores` with ``logprobs [N]``, ``entropy [N]`` or None, ``valid_mask [N]``.

    Example (V=4, temperature 1)::

        logits  = [[0., 1., 2., 3.]]; labels = [2]; support = [[2, 3, -1]]
        logp    = 2 − logsumexp([2, 3]) = −1.3133
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V_local], got shape {tuple(logits.shape)}")
    rows, width = logits.shape
    check_inputs(
        rows=rows,
        labels=labels,
        support=support,
        fallback_mask=fallback_mask,
        temperature=temperature,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
    )
    v0, vocab = vocab_shard(width, tp_group, vocab_start, vocab_size)
    member, repeats = support_members(support)
    valid = member.any(-1) if fallback_mask is None else member.any(-1) | fallback_mask
    if validate:
        check_ids(labels, support, valid, vocab)
    cdt = compute_dtype(logits.dtype)

    local = member & (support >= v0) & (support < v0 + width)
    dense_rows = dense_values = None
    if fallback_mask is not None:
        local &= ~fallback_mask[:, None]
        dense_rows = fallback_mask.nonzero().squeeze(1)
        dense_values = logits[dense_rows].to(cdt) / temperature
    index = (support.long() - v0).clamp(0, width - 1)
    values = logits.gather(1, index).to(cdt) / temperature
    label_owned = (labels >= v0) & (labels < v0 + width)
    label_index = (labels.long() - v0).clamp(0, width - 1)
    label_value = logits.gather(1, label_index[:, None]).squeeze(1).to(cdt) / temperature

    logp, entropy = score_candidates(
        values,
        local,
        label_value,
        label_owned,
        valid,
        dense_rows=dense_rows,
        dense_values=dense_values,
        tp_group=tp_group,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
    )
    return SupportScores(
        logprobs=logp,
        entropy=entropy,
        valid_mask=valid,
        metrics=support_metrics(member, repeats, support, labels, valid, fallback_mask),
    )
