"""Row planning of both support scorers: which rows are scored, which ids are candidates.

:func:`rollfeed.models.support_logprobs` (logits) and :func:`rollfeed.models.fused_support_logprobs`
(hidden states) reduce to one problem: per row ``n``, candidate logits (already divided by the
temperature) of the row's distinct support ids this rank owns, the label's logit, and a few
*fallback* rows scored over the whole vocabulary, given as this rank's log-sum-exp.
:func:`rollfeed.models.candidate_scores.score_candidates` turns that into ``logp`` and entropy with
one MAX and one SUM all-reduce over the TP group.

The support is ragged (:class:`~rollfeed.collate.RaggedRows`: ``offsets [N + 1]``, ids
``[nnz]``), and so is every per-id tensor here: work and memory follow the kept ids, never
``N`` times the widest row. A padded ``[N, W]`` support is taken as rows of ``W`` slots
(:func:`rollfeed.models.support_checks.support_rows`).

Support semantics (fixed here, for both paths):

- row ``n`` lists global token ids; ``-1`` is padding and contributes nothing, any other
  negative id raises :class:`VocabularyRangeError`;
- an id repeated within a row counts **once** (the support is a set): its first slot is the
  member, later slots are counted in ``metrics["duplicate_ids"]``;
- a row with no id is invalid (``valid_mask = False``; logprob and entropy 0, zero gradient) unless
  ``fallback_mask[n]``, which scores it over the full vocabulary (its support is then ignored);
- a label outside its row's support raises :class:`SupportLabelError` (``missing_label="error"``)
  or makes that row a fallback row (``missing_label="full_vocab"``, counted in
  ``metrics["rows_missing_label"]``);
- a support id ``>= V`` or a scored row's label outside ``[0, V)`` raises
  :class:`VocabularyRangeError`, ``V`` the *full* vocabulary also under TP (where such an id is
  owned by no rank and would score nothing);
- a scored row's temperature that is not finite and ``>=`` the compute dtype's smallest normal
  number (``torch.finfo(dtype).tiny``: below it ``1 / t`` overflows, so every gradient through
  ``l / t`` is inf or NaN) raises :class:`TemperatureError`; rows that are not scored may hold any
  temperature (they are computed with 1);
- a scored row whose score is not finite (a NaN or inf logit from the model, or a logit that the
  temperature scales past the dtype's range) raises :class:`NonFiniteLogitError` naming the row:
  a NaN logit is a fault of the model, never a score.

The input checks' verdicts are read back in one host sync together with the candidate counts
(which set the shapes), before any collective (:func:`candidate_pairs`); the scores' finiteness
is one host sync after the reductions, where every TP rank holds the same sums and so raises with
the others.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from rollfeed.collate import RaggedRows
from rollfeed.models.segments import segment_count
from rollfeed.models.support_checks import RowChecks, check_inputs, temperatures

MissingLabel = Literal["error", "full_vocab"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RowPlan:
    """Which rows are scored and how, for one call (identical on every TP rank except ``local``
    and ``label_owned``).

    ``support``: the rows as given; ``ids [nnz]`` int64 and ``slot_rows [nnz]`` (each slot's row).
    ``member [nnz]``: first occurrence of an id >= 0, on rows scored over their support.
    ``local [nnz]``: ``member`` and the id lies in this rank's shard.
    ``fallback [N]``: rows scored over the full vocabulary.
    ``valid [N]``: rows with a member id, or fallback rows.
    ``label_owned [N]``: a scored row whose label lies in this rank's shard.
    ``fallback_rows [F]``: indices of the fallback rows, or None when no row can fall back.
    ``temperature [N]``: per-row temperature in the compute dtype.
    ``checks``: the input checks' verdicts, still on the device (:meth:`RowChecks.verify`).
    """

    support: RaggedRows
    ids: torch.Tensor
    slot_rows: torch.Tensor
    member: torch.Tensor
    local: torch.Tensor
    fallback: torch.Tensor
    valid: torch.Tensor
    label_owned: torch.Tensor
    fallback_rows: torch.Tensor | None
    temperature: torch.Tensor
    metrics: dict[str, torch.Tensor]
    checks: RowChecks


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CandidatePairs:
    """The (row, id) pairs whose logits this rank computes, ``P`` of them.

    ``rows [P]``, ``cols [P]`` (the id minus ``vocab_start``: a column of the local logits or a
    row of the local head weight). The first ``members`` pairs are the local support members in
    slot order, ``member_slots [members]`` their slots in the support's values; the rest are the
    labels of the fallback rows whose label this rank owns (a row scored over its support holds
    its label in a member slot). ``label_at [N]``: the pair holding each row's label logit,
    ``-1`` where this rank holds none.

    Example (one rank, ``support`` rows ``[5, 3, 5]``, ``[]``; fallback row 1 with label 2)::

        rows [0, 0, 1]   cols [5, 3, 2]   members 2   member_slots [0, 1]   label_at [1, 2]
    """

    rows: torch.Tensor
    cols: torch.Tensor
    members: int
    member_slots: torch.Tensor
    label_at: torch.Tensor


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp32 for half/bfloat16/fp32 inputs, fp64 when any input is fp64 (the reference tests)."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def plan_rows(
    labels: torch.Tensor,
    support: RaggedRows,
    *,
    rows: int,
    vocab_start: int,
    local_width: int,
    vocab_size: int,
    temperature: float | torch.Tensor,
    dtype: torch.dtype,
    fallback_mask: torch.Tensor | None,
    missing_label: MissingLabel,
    compute_entropy: bool,
    entropy_requires_grad: bool,
    uniform_width: int | None = None,
) -> RowPlan:
    """Check the inputs and decide per row: support, fallback or unscored; per slot: member or not.

    ``vocab_size``: the full vocabulary ``V`` (under TP the sum of the shards' widths; see
    :func:`rollfeed.models.tp.full_vocab_size`): support ids and scored rows' labels are checked
    against ``[0, V)`` (``-1`` pads), scored rows' temperatures against finite and ``>=
    torch.finfo(dtype).tiny``. The verdicts stay on the device in ``checks``: the caller reads them
    (:meth:`RowChecks.verify`) before it scores anything.

    Repeats are found by one stable sort of the ``nnz`` keys ``row · (V + 2) + id + 1``: equal
    neighbours are one id twice in a row, and the first slot (stable order) stays the member.
    ``uniform_width``: every row has that many slots (a padded support), sorted row by row instead.
    Costs one host sync to list fallback rows (when any row can fall back: ``fallback_mask`` given
    or ``missing_label="full_vocab"``).

    Example: rows ``[5, 3, 5]``, ``[]`` (offsets ``[0, 3, 3]``), ``labels = [3, 0]`` →
    ``member = [T, T, F]``, ``valid = [T, F]``, one duplicate id.
    """
    check_inputs(labels, rows, fallback_mask, missing_label, compute_entropy, entropy_requires_grad)
    device = support.device
    t = temperatures(temperature, rows, dtype, device)
    ids = support.values.long()
    slot_rows = support.row_index()
    labels = labels.to(device)
    repeat = _repeats(ids, slot_rows, vocab_size, rows, uniform_width)
    member = (ids >= 0) & ~repeat
    has_support = segment_count(member, slot_rows, rows) > 0
    is_label = ids == labels[slot_rows]
    label_in = segment_count(member & is_label, slot_rows, rows) > 0

    fallback = torch.zeros_like(has_support) if fallback_mask is None else fallback_mask.clone()
    missing = has_support & ~fallback & ~label_in
    if missing_label == "full_vocab":
        fallback |= missing
    member = member & ~fallback[slot_rows]
    valid = has_support | fallback
    checks = RowChecks(
        labels=labels,
        support=support,
        slot_rows=slot_rows,
        temperature=t,
        vocab_size=vocab_size,
        bad_support=(ids >= vocab_size) | (ids < -1),
        bad_label=valid & ((labels < 0) | (labels >= vocab_size)),
        bad_missing=missing if missing_label == "error" else torch.zeros_like(missing),
        bad_temperature=valid & ~(torch.isfinite(t) & (t >= torch.finfo(dtype).tiny)),
    )
    label_owned = valid & (labels >= vocab_start) & (labels < vocab_start + local_width)
    local = member & (ids >= vocab_start) & (ids < vocab_start + local_width)

    can_fall_back = fallback_mask is not None or missing_label == "full_vocab"
    zero = torch.zeros((), dtype=torch.int64, device=device)
    metrics = {
        "rows_valid": valid.sum(),
        "rows_fallback": fallback.sum(),
        "rows_missing_label": zero if missing_label == "error" else missing.sum(),
        "rows_singleton": (segment_count(member, slot_rows, rows) == 1).sum(),
        "duplicate_ids": repeat.sum(),
    }
    return RowPlan(
        support=support,
        ids=ids,
        slot_rows=slot_rows,
        member=member,
        local=local,
        fallback=fallback,
        valid=valid,
        label_owned=label_owned,
        # A sync only when rows may fall back: their count sets the dense chunks' shapes.
        fallback_rows=fallback.nonzero().squeeze(1) if can_fall_back else None,
        # Unscored rows may hold any temperature (NaN on a prompt token): 1 keeps their
        # (masked) values and gradients finite.
        temperature=torch.where(valid, t, torch.ones_like(t)),
        metrics=metrics,
        checks=checks,
    )


def _repeats(
    ids: torch.Tensor, slot_rows: torch.Tensor, vocab: int, rows: int, uniform_width: int | None
) -> torch.Tensor:
    """``[nnz]`` bool: a slot whose id (>= 0) an earlier slot of its row holds."""
    if uniform_width:
        ordered, perm = ids.view(rows, uniform_width).sort(dim=1, stable=True)
        repeat_sorted = torch.zeros_like(ordered, dtype=torch.bool)
        repeat_sorted[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        return torch.zeros_like(repeat_sorted).scatter_(1, perm, repeat_sorted).view(-1)
    ordered, perm = (slot_rows * (vocab + 2) + ids.clamp(-1, vocab) + 1).sort(stable=True)
    repeat_sorted = torch.zeros_like(ordered, dtype=torch.bool)
    repeat_sorted[1:] = (ordered[1:] == ordered[:-1]) & (ids[perm[1:]] >= 0)
    return torch.empty_like(repeat_sorted).index_put_((perm,), repeat_sorted)


def candidate_pairs(plan: RowPlan, labels: torch.Tensor, vocab_start: int) -> CandidatePairs:
    """The pairs this rank projects (or gathers). Their counts, which set the shapes, are read
    back with the checks' verdicts in the call's one host sync (:meth:`RowChecks.verify`, which
    raises first)."""
    n = plan.valid.shape[0]
    labels = labels.to(plan.ids.device).long()
    hit = plan.local & (plan.ids == labels[plan.slot_rows])
    held = segment_count(hit, plan.slot_rows, n) > 0
    label_only = plan.label_owned & ~held
    members, extra = plan.checks.verify(plan.local.sum(), label_only.sum())
    slots = torch.nonzero_static(plan.local, size=members).squeeze(1)
    extra_rows = torch.nonzero_static(label_only, size=extra).squeeze(1)
    member_rows = plan.slot_rows[slots]
    rows = torch.cat([member_rows, extra_rows])
    cols = torch.cat([plan.ids[slots], labels[extra_rows]]) - vocab_start
    position = torch.arange(members + extra, device=rows.device)
    label_at = torch.full((n,), -1, dtype=torch.int64, device=rows.device)
    label_at = label_at.scatter_reduce(
        0, member_rows, torch.where(hit[slots], position[:members], -1), "amax"
    )
    label_at = label_at.index_put((extra_rows,), position[members:])
    return CandidatePairs(
        rows=rows, cols=cols, members=members, member_slots=slots, label_at=label_at
    )
