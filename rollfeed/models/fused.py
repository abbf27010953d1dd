"""Support scoring straight from hidden states and the LM-head weight (the fused path).

Only candidate logits are projected: for each scored row the distinct support ids this rank owns
plus the label when it is not one of them, i.e. ``P ≈ N · |S|`` dot products instead of an
``[N, V_local]`` matmul. Fallback rows (scored over the whole vocabulary) are projected a few rows
at a time and reduced on the spot to this rank's log-sum-exp, so no ``[N, V]`` tensor exists.

:class:`_FusedHeadProjection` (an ``autograd.Function``) saves only its inputs and recomputes each
chunk in backward, so backward memory is one chunk plus the gradient buffers; the weight gradient
is accumulated in fp32 (fp64 for fp64 inputs) whatever the weight dtype, in one buffer shared by
the pairs and the fallback rows. The pairs and every reduction over them are ragged
(:mod:`rollfeed.models.candidates`): no tensor is ``N`` times the widest row. Liger-Kernel's
fused linear cross entropy and SkyRL's candidate-row projection are the prior art for the
chunk-and-recompute design.
"""

from __future__ import annotations

import torch

from rollfeed.collate import RaggedRows
from rollfeed.deprecation import renamed_keywords
from rollfeed.models.candidate_scores import kept_rows, score_candidates
from rollfeed.models.candidates import MissingLabel, candidate_pairs, compute_dtype, plan_rows
from rollfeed.models.errors import SupportInputError
from rollfeed.models.segments import add_rows
from rollfeed.models.support import RENAMED_KEYWORDS, SupportScores
from rollfeed.models.support_checks import support_rows
from rollfeed.models.threads import serial_below
from rollfeed.models.tp import ProcessGroup, full_vocab_size, sum_grad_over_tp

DEFAULT_CHUNK_SIZE = 2048


class _FusedHeadProjection(torch.autograd.Function):
    """``(hidden [N, H], weight [V_local, H])`` → candidate dots and fallback-row statistics.

    Outputs: ``dots [P]`` with ``dots[p] = <hidden[pair_rows[p]], weight[pair_ids[p]]>`` (not yet
    divided by the temperature); for the fallback rows ``fb_rows [F]`` with ``l = h Wᵀ / t``,
    ``lse [F] = logsumexp_v l_v`` and ``mean [F] = Σ_v softmax(l)_v l_v`` (zeros unless
    ``want_mean``). ``chunk_size`` bounds the pairs (or fallback logits, in rows × V_local) held
    at once.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        pair_rows: torch.Tensor,
        pair_ids: torch.Tensor,
        fb_rows: torch.Tensor,
        fb_temp: torch.Tensor,
        chunk_size: int,
        want_mean: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = compute_dtype(hidden.dtype, weight.dtype)
        dots = torch.empty(pair_rows.shape[0], dtype=acc, device=hidden.device)
        with serial_below(chunk_size * hidden.shape[1], hidden.device):
            for s in range(0, pair_rows.shape[0], chunk_size):
                rows, ids = pair_rows[s : s + chunk_size], pair_ids[s : s + chunk_size]
                dots[s : s + chunk_size] = _rowwise_dot(
                    weight.index_select(0, ids).to(acc), hidden.index_select(0, rows).to(acc)
                )
        lse = torch.empty(fb_rows.shape[0], dtype=acc, device=hidden.device)
        mean = torch.zeros_like(lse)
        for sl, logits in _fallback_chunks(hidden, weight, fb_rows, fb_temp, chunk_size, acc):
            lse[sl] = logits.logsumexp(-1)
            if want_mean:
                mean[sl] = (torch.softmax(logits, -1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, pair_rows, pair_ids, fb_rows, fb_temp, lse, mean)
        ctx.chunk_size, ctx.want_mean = chunk_size, want_mean
        return dots, lse, mean

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, g_dots: torch.Tensor, g_lse: torch.Tensor, g_mean: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        hidden, weight, pair_rows, pair_ids, fb_rows, fb_temp, lse, mean = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        acc = lse.dtype
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        chunk = ctx.chunk_size
        with serial_below(chunk * hidden.shape[1], hidden.device):
            for s in range(0, pair_rows.shape[0], chunk):
                rows, ids = pair_rows[s : s + chunk], pair_ids[s : s + chunk]
                g = g_dots[s : s + chunk, None].to(acc)
                # each gather is a fresh temporary: scaled in place
                if grad_h is not None:
                    add_rows(grad_h, rows, weight.index_select(0, ids).to(acc).mul_(g))
                if grad_w is not None:
                    add_rows(grad_w, ids, hidden.index_select(0, rows).to(acc).mul_(g))
        for sl, logits in _fallback_chunks(hidden, weight, fb_rows, fb_temp, chunk, acc):
            p = (logits - lse[sl, None]).exp()
            # d lse / d l = p;  d mean / d l = p · (1 + l − mean)
            dl = g_lse[sl, None] * p
            if ctx.want_mean:
                dl = dl + g_mean[sl, None] * p * (1 + logits - mean[sl, None])
            dl = dl / fb_temp[sl, None]
            rows = fb_rows[sl]
            if grad_h is not None:
                add_rows(grad_h, rows, (dl.to(weight.dtype) @ weight).to(acc))
            if grad_w is not None:
                grad_w.addmm_(dl.T, hidden[rows].to(acc))
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            *(None,) * 6,
        )


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[c, H] · [c, H] → [c]``; ``a`` is the caller's own temporary (a gather), multiplied in
    place, so no second ``[c, H]`` is made. (A batched GEMV, ``bmm`` of ``[c, 1, H]`` by ``[c, H,
    1]``, ran at ~1 GFLOP/s on CPU: 72 ms of a 300 ms heavy-tailed step.)"""
    return a.mul_(b).sum(-1)


def _fallback_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    fb_rows: torch.Tensor,
    fb_temp: torch.Tensor,
    chunk_size: int,
    acc: torch.dtype,
):
    """Yield ``(slice, logits [c, V_local])`` for fallback rows, ``c · V_local <= chunk_size · H``.

    The matmul runs in the weight dtype (like the LM head it replaces); logits are then upcast.
    """
    per = max(1, chunk_size * weight.shape[1] // max(1, weight.shape[0]))
    for s in range(0, fb_rows.shape[0], per):
        sl = slice(s, s + per)
        h = hidden[fb_rows[sl]].to(weight.dtype)
        yield sl, (h @ weight.T).to(acc) / fb_temp[sl, None]


@renamed_keywords("fused_support_logprobs", **RENAMED_KEYWORDS)
def fused_support_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    support: RaggedRows | torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float | torch.Tensor = 1.0,
    compute_entropy: bool = False,
    return_support_logprobs: bool = False,
    entropy_requires_grad: bool = False,
    fallback_mask: torch.Tensor | None = None,
    missing_label: MissingLabel = "error",
    tp_group: ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
) -> SupportScores:
    """:func:`rollfeed.models.support_logprobs` of ``hidden @ weight.T`` without forming the logits.

    Args:
        hidden: ``[N, H]`` final hidden states (after the last norm).
        weight: ``[V_local, H]`` LM-head weight, or this rank's vocabulary shard under TP.
        labels, support, temperature, compute_entropy, return_support_logprobs,
            entropy_requires_grad, fallback_mask, missing_label, tp_group, vocab_start,
            vocab_size: as in :func:`support_logprobs` (a :class:`~rollfeed.collate.RaggedRows`
            support costs ∝ its ids; a padded one ∝ ``N·W`` for the planning, while only the
            kept pairs are projected either way).
        chunk_size: candidate pairs projected at once (fallback rows: ``chunk_size · H`` logits at
            once); bounds the temporaries to about ``2 · chunk_size · H`` elements.
        reduce_hidden_grad: under TP, all-reduce the hidden-state gradient over ``tp_group`` in
            backward (each rank only holds its shard's part). Pass False when the surrounding
            region already reduces it (e.g. Megatron-style activation sharding inside the TP
            group, whose gather reduce-scatters in backward).

    Collectives per call under TP: one MAX and one SUM all-reduce in forward (the projection is
    chunked but produces only ``[P]`` dots, scored together), plus one SUM of the ``[N, H]``
    hidden gradient in backward when ``reduce_hidden_grad``.

    Costs one host sync to check the inputs and count the candidate pairs (their count sets the
    shapes), and one to check that the scores are finite.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise SupportInputError(
            f"hidden must be [N, H] and weight [V_local, H], got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}; pass the final hidden states and the LM-head weight",
            tensor="hidden",
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise SupportInputError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    rows, width = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype, weight.dtype)
    if vocab_size is None:
        # Under TP this costs one more 1-element all-reduce and host sync per call: no rank knows
        # V from its shard, and an id >= V is owned by no rank (it would score nothing, silently).
        # PolicyScorer finds V once, at construction, and passes it.
        vocab_size = full_vocab_size(width, tp_group, hidden.device)
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
    # Each row's label is projected once: from its member slot, or as a label-only pair.
    pairs = candidate_pairs(plan, labels, vocab_start)
    t = plan.temperature
    fb_rows = plan.fallback_rows
    if fb_rows is None:
        fb_rows = torch.zeros(0, dtype=torch.long, device=hidden.device)
    h = sum_grad_over_tp(hidden, tp_group) if reduce_hidden_grad else hidden
    dots, fb_lse, fb_mean = _FusedHeadProjection.apply(
        h, weight, pairs.rows, pairs.cols, fb_rows, t[fb_rows], chunk_size, compute_entropy
    )
    with_fb = plan.fallback_rows is not None
    out = score_candidates(
        dots / t[pairs.rows],
        pairs,
        plan,
        dense_lse=fb_lse if with_fb else None,
        dense_mean=fb_mean if with_fb and compute_entropy else None,
        tp_group=tp_group,
        compute_entropy=compute_entropy,
        entropy_requires_grad=entropy_requires_grad,
        return_support_logprobs=return_support_logprobs,
    )
    metrics = {
        **plan.metrics,
        "pairs_projected": torch.tensor(pairs.rows.shape[0], device=hidden.device),
    }
    return SupportScores(
        logprobs=out.logp,
        entropy=out.entropy,
        valid_mask=plan.valid,
        support_logprobs=kept_rows(plan, out.kept),
        metrics=metrics,
    )
