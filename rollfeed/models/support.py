"""Support-conditioned logprobs and entropy from materialised logits (the plain path).

With ``l = logits / temperature`` over the recorded support ``S`` of each row::

    m = max_S l,  Z = Σ_S exp(l − m),  logp = l_y − m − log Z,
    H_S = log Z − Σ_S exp(l − m)(l − m) / Z

Support semantics (sets, padding, fallback rows, labels outside the support) are described in
:mod:`rollfeed.models.candidates`; the TP reductions in :mod:`rollfeed.models.tp`. The idea of
replaying the sampler's kept set in the trainer is DeepSeek-V3.2's "Keep Sampling Mask".
"""

from __future__ import annotations

import dataclasses

import torch

from rollfeed.collate import RaggedRows
from rollfeed.deprecation import renamed_attribute, renamed_keywords
from rollfeed.models.candidate_scores import kept_rows, score_candidates
from rollfeed.models.candidates import MissingLabel, candidate_pairs, compute_dtype, plan_rows
from rollfeed.models.errors import SupportInputError
from rollfeed.models.support_checks import support_rows
from rollfeed.models.tp import ProcessGroup, full_vocab_size


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SupportScores:
    """Result of every support scorer: :func:`support_logprobs` and
    :func:`~rollfeed.models.fused_support_logprobs` score ``N`` given rows;
    :class:`~rollfeed.models.PolicyScorer` scores a whole packed row of ``S`` tokens, gathered over
    the ``cp`` group into canonical coordinates (``N = S``, entry ``j`` scores ``labels[j]``).

    Attributes:
        logprobs: ``[N]`` label logprob normalised over the row's support (0 on invalid rows).
        entropy: ``[N]`` entropy of the support-restricted distribution, or None when not asked.
        valid_mask: ``[N]`` bool, rows that were scored (a recorded support, or a fallback row).
        support_logprobs: with ``return_support_logprobs=True``, ``log p^S(v) = l_v −
            logsumexp_{u∈S} l_u`` of every slot of the given support rows
            (:class:`~rollfeed.collate.RaggedRows` with the support's offsets, aligned slot for
            slot; a padded ``[N, W]`` support gives rows of ``W`` slots, ``.padded()`` is
            ``[N, W]`` again), differentiable like ``logprobs``. Slots that are no member of the
            row's set hold ``-inf``: ``-1`` padding, the later slots of a repeated id (its first
            slot holds the value), and every slot of a row not scored over its support (fallback
            and unscored rows). Until the next release ``kept_logprobs`` reads it too, with a
            ``DeprecationWarning``.
            :class:`~rollfeed.models.PolicyScorer` returns this rank's own rows (under ``cp``,
            not gathered), aligned with the support it was given.
        metrics: counters, 0-d int64 tensors (the models' convention, see :mod:`rollfeed.models`):
            ``rows_valid``, ``rows_fallback`` (full-vocab rows, including missing labels),
            ``rows_missing_label``, ``rows_singleton``, ``duplicate_ids``; the fused path adds
            ``pairs_projected``; :class:`~rollfeed.models.PolicyScorer` adds ``rows_replayed``
            and ``rows_fallen_back`` (routing rows that kept the model's own routing). The
            scorers count this rank's rows (under ``cp``, its own shard).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    valid_mask: torch.Tensor
    support_logprobs: RaggedRows | None = None
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    kept_logprobs = renamed_attribute("SupportScores", "kept_logprobs", "support_logprobs")


# The scorers' renamed keywords (rollfeed.deprecation): the old one works until the next release.
RENAMED_KEYWORDS = {"return_kept_logprobs": "return_support_logprobs"}


@renamed_keywords("support_logprobs", **RENAMED_KEYWORDS)
def support_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    support: RaggedRows | torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    compute_entropy: bool = False,
    return_support_logprobs: bool = False,
    entropy_requires_grad: bool = False,
    fallback_mask: torch.Tensor | None = None,
    missing_label: MissingLabel = "error",
    tp_group: ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
) -> SupportScores:
    """Score ``labels`` under ``logits`` renormalised over each row's recorded support.

    Args:
        logits: ``[N, V_local]``, the whole vocabulary or this rank's shard under TP; any float
            dtype, scored in fp32 (fp64 stays fp64). Only support columns (and whole fallback rows)
            are read, so the gradient is zero outside them.
        labels: ``[N]`` int, the sampled token of each row (global ids).
        support: :class:`~rollfeed.collate.RaggedRows` of ``N`` rows of int32/int64 global token
            ids (cost ∝ the ids, ``nnz``), or a padded ``[N, W]`` tensor (taken as rows of ``W``
            slots, cost ∝ ``N·W``: ``RaggedRows.from_padded(support)`` trims it); ``-1`` is
            padding wherever it sits (any other negative id raises); repeats count once.
        temperature: the sampler's temperature, a scalar or ``[N]``; logits are divided by it.
            Must be finite and ``>= torch.finfo(compute dtype).tiny`` on every scored row
            (:class:`TemperatureError`).
        compute_entropy: also return the support entropy ``H_S`` (a detached metric).
        return_support_logprobs: also return ``support_logprobs``, the support logprob of every
            kept id (:class:`SupportScores`); under TP the kept ids' logits ride in the SUM
            all-reduce.
        entropy_requires_grad: let the entropy carry gradients (an entropy loss term).
        fallback_mask: ``[N]`` bool; rows scored over the full vocabulary (a named, counted policy,
            e.g. a loss-bearing synthetic EOS the sampler never produced).
        missing_label: ``"error"`` raises :class:`SupportLabelError` naming rows whose label is
            not in their support; ``"full_vocab"`` scores those rows over the full vocabulary.
        tp_group: TP group when ``logits`` is vocab-parallel: one MAX and one SUM all-reduce.
        vocab_start: first global id of this rank's shard.
        vocab_size: the full vocabulary ``V`` that support ids and scored labels must lie in
            (:class:`VocabularyRangeError`); default ``V_local`` without TP, and under TP one
            extra all-reduce of ``V_local`` per call (pass it to save that).

    Returns:
        :class:`SupportScores` (``logprobs [N]``, ``entropy [N]`` or None, ``valid_mask [N]``,
        ``support_logprobs`` or None).

    Only the ``P`` candidate logits (each row's distinct ids this rank owns, and the labels of
    fallback rows) are gathered, and every reduction runs over them (work ``O(P + N)``, plus the
    fallback rows' full rows); the gradient is zero outside them.

    Example (V=4, temperature 1)::

        logits = [[0., 1., 2., 3.]]; labels = [2]
        support = RaggedRows(offsets=[0, 2], values=[2, 3])   # or the padded [[2, 3, -1]]
        logp   = 2 − logsumexp([2, 3]) = −1.3133;  support_logprobs rows [[−1.3133, −0.3133]]
    """
    if logits.dim() != 2:
        raise SupportInputError(
            f"logits must be [N, V_local], got shape {tuple(logits.shape)}; flatten leading dims "
            "before scoring",
            tensor="logits",
        )
    rows, width = logits.shape
    cdt = compute_dtype(logits.dtype)
    if vocab_size is None:
        # Under TP this costs one more 1-element all-reduce and host sync per call: no rank knows
        # V from its shard, and an id >= V is owned by no rank (it would score nothing, silently).
        # PolicyScorer finds V once, at construction, and passes it.
        vocab_size = full_vocab_size(width, tp_group, logits.device)
    given, support = support, support_rows(support, rows)
    uniform = given.shape[1] if isinstance(given, torch.Tensor) else None  # a padded [N, W]
    plan = plan_rows(
        labels,
        support,
        rows=rows,
        vocab_start=vocab_start,
        local_width=width,
        vocab_size=vocab_size,
        temperature=temperature,
        dtype=cdt,
        fallback_mask=fallback_mask,
        missing_label=missing_label,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
        uniform_width=uniform,
    )
    pairs = candidate_pairs(plan, labels, vocab_start)
    t = plan.temperature
    # (row, id) pairs are distinct, so the gather's backward adds each gradient once: no order.
    values = logits[pairs.rows, pairs.cols].to(cdt) / t[pairs.rows]

    dense_lse = dense_mean = None
    if plan.fallback_rows is not None:
        dense = logits[plan.fallback_rows].to(cdt) / t[plan.fallback_rows, None]
        dense_lse = dense.logsumexp(-1)
        if compute_entropy:
            dense_mean = (torch.softmax(dense, -1) * dense).sum(-1)

    out = score_candidates(
        values,
        pairs,
        plan,
        dense_lse=dense_lse,
        dense_mean=dense_mean,
        tp_group=tp_group,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
        return_support_logprobs=return_support_logprobs,
    )
    return SupportScores(
        logprobs=out.logp,
        entropy=out.entropy,
        valid_mask=plan.valid,
        support_logprobs=kept_rows(plan, out.kept),
        metrics=plan.metrics,
    )
