"""The shared score-over-candidates math of both support scorers, over ragged pairs.

With ``l = logits / temperature`` over the support ``S`` of each row::

    m = max_S l,  Z = Σ_S exp(l − m),  logp = l_y − m − log Z,
    H_S = log Z − Σ_S exp(l − m)(l − m) / Z,   log p^S(v) = l_v − m − log Z  (v ∈ S)

Every per-row quantity is a segment reduction over the ``P`` candidate pairs
(:mod:`rollfeed.models.segments`), so the work is ``O(P + N)`` however wide the widest row.
"""

from __future__ import annotations

import dataclasses

import torch

from rollfeed.collate import RaggedRows
from rollfeed.models.candidates import CandidatePairs, RowPlan
from rollfeed.models.errors import NonFiniteLogitError
from rollfeed.models.segments import segment_max, segment_sum
from rollfeed.models.tp import ProcessGroup, all_reduce_max, all_reduce_sum_local_grad


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CandidateScores:
    """``logp [N]``, ``entropy [N]`` or None, ``kept [nnz]`` (aligned with the support's slots)
    or None."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    kept: torch.Tensor | None


def score_candidates(
    values: torch.Tensor,
    pairs: CandidatePairs,
    plan: RowPlan,
    *,
    dense_lse: torch.Tensor | None = None,
    dense_mean: torch.Tensor | None = None,
    tp_group: ProcessGroup | None = None,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
    return_support_logprobs: bool = False,
) -> CandidateScores:
    """Support-normalised ``logp [N]``, entropy ``[N]`` (or None), and, with
    ``return_support_logprobs``, ``log p^S`` of every slot ``[nnz]`` (``-inf`` on slots that are
    no member: padding, a repeat's later slots, every slot of a row not scored over its support).

    Args (logits already divided by the temperature, in the compute dtype):
        values: ``[P]`` the logits of ``pairs`` (members first, then label-only pairs).
        dense_lse, dense_mean: ``[F]`` for the fallback rows (in row order): this rank's
            ``logsumexp_v l_v`` over its shard and ``Σ_v softmax(l)_v l_v`` (entropy only).

    A fallback row enters as one pseudo-candidate per rank with logit ``dense_lse``:
    ``Σ_v e^{l_v − m} = e^{lse − m}`` and ``Σ_v e^{l_v − m}(l_v − m) = e^{lse − m}(mean − m)``.

    Collectives: one MAX of the detached row max ``[N]``; one SUM of the stacked ``[2, N]``
    (``Σw``, label logit) or ``[3, N]`` (plus ``Σ w·(l − m)``), flattened and followed by the
    ``[nnz]`` member logits (zero where another rank owns the id) when
    ``return_support_logprobs``. Ranks with no member of a row contribute ``-inf`` to the max and
    0 to the sums.
    """
    n = plan.valid.shape[0]
    k = pairs.members
    member_values, member_rows = values[:k], pairs.rows[:k]
    row_max = segment_max(member_values, member_rows, n)
    rows = plan.fallback_rows if dense_lse is not None else None
    if rows is not None and dense_lse is not None:
        row_max = row_max.index_put((rows,), dense_lse.detach())
    m = all_reduce_max(row_max, tp_group)
    # Rows with no candidate anywhere keep -inf; 0 keeps exp/log finite and they are masked below.
    m = torch.where(torch.isfinite(m), m, 0)

    shifted = member_values - m[member_rows]
    w = shifted.exp()
    label_at = pairs.label_at
    label_value = (
        torch.where(label_at >= 0, values[label_at.clamp(min=0)], 0)
        if len(values)
        else (values.new_zeros(n))
    )
    sums = [segment_sum(w, member_rows, n), label_value]
    if compute_entropy:
        ew, es = (w, shifted) if entropy_requires_grad else (w.detach(), shifted.detach())
        sums.append(segment_sum(ew * es, member_rows, n))
    if rows is not None and dense_lse is not None:
        d_w = (dense_lse - m[rows]).exp()
        sums[0] = sums[0].index_put((rows,), d_w)
        if compute_entropy:
            assert dense_mean is not None
            d_h = d_w * (dense_mean - m[rows])
            sums[2] = sums[2].index_put((rows,), d_h if entropy_requires_grad else d_h.detach())

    stacked = torch.stack(sums)
    kept_z = None
    if return_support_logprobs:
        local = values.new_zeros(plan.ids.shape[0]).index_put((pairs.member_slots,), member_values)
        flat = all_reduce_sum_local_grad(torch.cat([stacked.reshape(-1), local]), tp_group)
        total, kept_z = flat[: stacked.numel()].view_as(stacked), flat[stacked.numel() :]
    else:
        total = all_reduce_sum_local_grad(stacked, tp_group)
    z = torch.where(plan.valid, total[0], 1)
    log_z = z.log()
    logp = torch.where(plan.valid, total[1] - m - log_z, 0)
    entropy = None
    if compute_entropy and entropy_requires_grad:
        entropy = torch.where(plan.valid, log_z - total[2] / z, 0)
    elif compute_entropy:
        z_d, h_num = z.detach(), total[2].detach()
        entropy = torch.where(plan.valid, z_d.log() - h_num / z_d, 0)
    _check_finite(member_values, member_rows, plan, logp, entropy)
    kept = None
    if kept_z is not None:
        slot_rows = plan.slot_rows
        # The same association as logp's, so a label's slot holds its logprob bit for bit.
        kept = torch.where(plan.member, kept_z - m[slot_rows] - log_z[slot_rows], float("-inf"))
    return CandidateScores(logp=logp, entropy=entropy, kept=kept)


def kept_rows(plan: RowPlan, kept: torch.Tensor | None) -> RaggedRows | None:
    """``kept [nnz]`` as rows aligned with the support's (its offsets)."""
    return None if kept is None else RaggedRows(plan.support.offsets, kept)


def _check_finite(
    member_values: torch.Tensor,
    member_rows: torch.Tensor,
    plan: RowPlan,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
) -> None:
    """Raise :class:`NonFiniteLogitError` for scored rows whose score is NaN or inf.

    Read from the reduced scores, so every TP rank holds the same verdict (a NaN in one rank's
    shard reaches every rank through the SUM) and they raise together. One host sync.
    """
    finite = torch.isfinite(logp.detach())
    if entropy is not None:
        finite &= torch.isfinite(entropy.detach())
    bad = plan.valid & ~finite
    if not bool(bad.any()):
        return
    rows = bad.nonzero().squeeze(1)[:8].tolist()
    first = rows[0]
    local = member_values[member_rows == first].detach().tolist()
    raise NonFiniteLogitError(
        f"{int(bad.sum())} scored row(s) have a non-finite score, first rows {rows} (row {first}: "
        f"logprob {float(logp[first])}, its candidate logits / temperature "
        f"{float(plan.temperature[first]):.4g} on this rank {local[:8]}): a NaN or inf logit is a "
        "fault of the model (look for NaN activations or weights), or the temperature scales a "
        f"logit past the range of {member_values.dtype}; such a row is never scored",
        tensor="logits",
        pos=first,
    )
