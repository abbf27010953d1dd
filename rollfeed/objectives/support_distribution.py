"""SupportDistribution: the sampler's and the trainer's distributions over each row's kept set
(support) ``S``.

Inputs are ragged rows aligned slot for slot (:class:`~rollfeed.collate.RaggedRows`, ``n`` rows):
the kept ids, the trainer's ``log p^S(v) = z_v − logsumexp_{u∈S} z_u`` of every kept id (with
gradient; :attr:`rollfeed.models.SupportScores.support_logprobs`), and the sampler's logprob of
every kept id (``sampling_mask_logprobs``: :func:`rollfeed.objectives.micro_batch_rows` takes its
rows from a micro batch). A row of mask logprobs is either as long as its kept set or empty (the row
has no mask logprobs).

Slot rules (padding is explicit, never a sentinel id):

- a slot is a *member* of ``S`` if its id is ``>= 0`` and the trainer's logprob there is finite:
  the scorer gives ``-inf`` on every slot that is no member (padding, the later slots of a
  repeated id, so a repeated id counts once at its first slot, and every slot of a fallback
  row), and ``support_logprobs`` from elsewhere must follow that rule; a repeat is counted in
  ``duplicate_ids`` (an id's slot at ``-inf`` in a row that has members);
- a member is *valid* if the sampler's logprob there is a number ``> -9999`` (``-inf`` and vLLM's
  JSON clamp at ``-9999`` and below are "no logprob"): an invalid member stays in ``S`` for
  ``p^S`` but gets zero weight and no gradient, and ``q`` is renormalised over the valid slots:
  ``log q^S(v) = s_v − logsumexp_valid s`` with ``log_mass = logsumexp_valid s`` (the sampler's
  mass on the valid slots before, a metric);
- ``q^S(a)`` of the sampled token ``a`` (the row's label) is read at the label's slot where that is
  valid, else from ``inference_logprobs`` (counted in ``rows_inference_q``); where neither holds a
  number, the token has *no sampler logprob*: ``no_sampler_logprob="drop"`` (the default) leaves
  it out of the loss (``loss_mask`` false, counted in ``no_sampler_logprob``),
  ``"error"`` raises :class:`~rollfeed.objectives.NoSamplerLogprobError`;
- a NaN or ``+inf`` where a logprob should be (any mask logprob, the trainer's logprob of a kept
  id, a loss token's ``inference_logprobs``) is no "missing" value but broken data: an
  :class:`~rollfeed.objectives.ObjectiveInputError` naming the tensor and the row.

A loss token is *centered* when its row was scored over its support (a member exists and the label
is among the ids) and has at least one valid slot. Counters (0-d int64, loss tokens only):
``rows_centered``, ``rows_singleton``, ``rows_unscored`` (fallback rows, rows without a kept set),
``rows_no_support`` (of those, rows without any kept id), ``rows_missing_label`` (a kept set
without the label), ``rows_no_mask_logprobs`` (no mask row, or no valid slot in it),
``rows_inference_q``, ``slots_invalid``, ``duplicate_ids``, and ``no_sampler_logprob`` (tokens
dropped from the given loss mask).

Worked example, one row: ids ``[4, 2, 7]`` (label 4), trainer ``log p^S = log [0.5, 0.3, 0.2]``,
sampler ``log [0.6, 0.3, 0.0]`` with the last slot at ``-inf``::

    valid [T, T, F]   log_mass = log 0.9   q^S = [0.6667, 0.3333, -]   q^S(a) = 0.6667
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import torch

from rollfeed.collate import RaggedRows
from rollfeed.deprecation import RenamedKeys, renamed_attribute, renamed_keywords
from rollfeed.objectives.support_checks import (
    NoSamplerLogprob,
    check_rows,
    not_a_logprob,
    verify_values,
)

# vLLM writes -inf as -9999 in JSON: a logprob at or below it is no number of the sampler's.
SAMPLER_LOGPROB_FLOOR = -9999.0


class ObjectiveMetrics(RenamedKeys):
    """The objectives' counters and metrics (``counts``, :attr:`PolicyTerms.metrics`,
    :func:`~rollfeed.objectives.finish_metrics`): a dict whose renamed keys still read, with a
    ``DeprecationWarning`` (:class:`rollfeed.deprecation.RenamedKeys`)."""

    owner = "metrics"
    renamed: ClassVar[Mapping[str, str]] = {"rows_no_kept_set": "rows_no_support"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SupportDistribution:
    """``q^S`` and ``p^S`` of ``N`` rows over their ``nnz`` kept slots (see the module doc).

    row: ``[nnz]`` int64, the row of every slot. valid: ``[nnz]`` bool.
    log_p: ``[nnz]`` trainer ``log p^S``, with gradient on valid slots, 0 elsewhere (no gradient).
    log_q: ``[nnz]`` detached sampler ``log q^S`` renormalised over the valid slots, ``-inf``
    elsewhere. log_q_label: ``[N]`` detached ``log q^S(a)`` (0 where the token has none).
    log_mass: ``[N]`` detached ``logsumexp`` of the valid sampler logprobs (0 on rows without
    one). log_p_valid: ``[N]`` detached ``log Σ_valid p^S`` (0 where every member is
    valid). centered: ``[N]`` bool. loss_mask: ``[N]`` bool, the loss tokens that have a sampler
    logprob (the given mask less the dropped ones). no_support, no_mask_logprobs: ``[N]`` bool,
    the loss tokens score centering cannot center for want of an input: no kept id at all, or a
    kept set of two or more members without a valid mask logprob (a singleton's correction is 0
    either way). counts: name -> 0-d int64 tensor.
    """

    row: torch.Tensor
    valid: torch.Tensor
    log_p: torch.Tensor
    log_q: torch.Tensor
    log_q_label: torch.Tensor
    log_mass: torch.Tensor
    log_p_valid: torch.Tensor
    centered: torch.Tensor
    loss_mask: torch.Tensor
    no_support: torch.Tensor
    no_mask_logprobs: torch.Tensor
    counts: dict[str, torch.Tensor]

    @property
    def n_rows(self) -> int:
        return self.loss_mask.numel()

    no_kept_set = renamed_attribute("SupportDistribution", "no_kept_set", "no_support")


@renamed_keywords("support_distribution", kept_logprobs="support_logprobs")
def support_distribution(
    support: RaggedRows,
    support_logprobs: RaggedRows,
    mask_logprobs: RaggedRows,
    *,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    inference_logprobs: torch.Tensor,
    no_sampler_logprob: NoSamplerLogprob = "drop",
) -> SupportDistribution:
    """The kept-set distributions of ``N`` rows (module doc); reads its value checks back in one
    host sync (:mod:`rollfeed.objectives.support_checks`).

    Args:
        support: ``N`` rows of int32/int64 kept ids (``-1`` slots are padding).
        support_logprobs: trainer ``log p^S`` aligned with ``support`` (float, with gradient).
        mask_logprobs: sampler logprobs, each row as long as its kept set or empty.
        labels: ``[N]`` sampled token ids. loss_mask: ``[N]`` bool.
        inference_logprobs: ``[N]`` sampler logprob of the label, used where the label's mask
            logprob is missing or invalid.
        no_sampler_logprob: a loss token with no sampler logprob of its label: ``"drop"`` leaves
            it out of the loss (counted in ``no_sampler_logprob``), ``"error"`` raises
            :class:`~rollfeed.objectives.NoSamplerLogprobError`.
    """
    n = check_rows(
        support,
        support_logprobs,
        mask_logprobs,
        labels,
        loss_mask,
        inference_logprobs,
        no_sampler_logprob,
    )
    cdt = support_logprobs.dtype
    device = support_logprobs.device
    row = support.row_index()
    ids = support.values.long()
    trainer = support_logprobs.values
    detached = trainer.detach()
    member = (ids >= 0) & torch.isfinite(detached)
    has_row = mask_logprobs.lengths() > 0
    # Each mask value's slot in the support rows (a gather, no boolean index: no host sync).
    mask_row = mask_logprobs.row_index()
    at = support.offsets[mask_row] + (
        torch.arange(mask_logprobs.nnz, device=device) - mask_logprobs.offsets[mask_row]
    )
    given = mask_logprobs.values.detach().to(cdt)
    sampler = torch.full((support.nnz,), float("-inf"), dtype=cdt, device=device)
    sampler = sampler.index_copy(0, at, torch.where(not_a_logprob(given), float("-inf"), given))
    sampler_ok = torch.isfinite(sampler) & (sampler > SAMPLER_LOGPROB_FLOOR)
    valid = member & sampler_ok

    neg_inf = torch.tensor(float("-inf"), dtype=cdt, device=device)
    log_mass = _log_sum(sampler, valid, row, n)
    has_q = torch.isfinite(log_mass)
    log_mass = torch.where(has_q, log_mass, 0.0)
    log_q = torch.where(valid, sampler - log_mass[row], neg_inf)

    is_label = (ids == labels.long()[row]) & (ids >= 0)
    label_slot = is_label & member
    per_row = lambda mask: torch.zeros(n, dtype=torch.int64, device=device).index_add(  # noqa: E731
        0, row, mask.long()
    )
    members = per_row(member)
    scored = (members > 0) & (per_row(label_slot) > 0)
    missing = (per_row(ids >= 0) > 0) & (per_row(is_label) == 0)
    q_label_ok = per_row(label_slot & valid) > 0
    q_at_label = torch.zeros(n, dtype=cdt, device=device).index_add(
        0, row, torch.where(label_slot & valid, log_q, 0.0)
    )
    inference = inference_logprobs.detach().to(cdt)
    inference_ok = torch.isfinite(inference) & (inference > SAMPLER_LOGPROB_FLOOR)
    dropped = loss_mask & ~q_label_ok & ~inference_ok
    verify_values(
        mask_rows=mask_row,
        bad_mask=not_a_logprob(mask_logprobs.values.detach()),
        slot_rows=row,
        bad_kept=(ids >= 0) & not_a_logprob(detached),
        bad_inference=loss_mask & not_a_logprob(inference),
        dropped=dropped,
        policy=no_sampler_logprob,
        inference=inference,
    )
    loss = loss_mask & ~dropped
    log_q_label = torch.where(q_label_ok, q_at_label, torch.where(inference_ok, inference, 0.0))
    centered = loss & scored & has_q
    no_support = loss & (per_row(ids >= 0) == 0)
    loss_slot = loss[row]
    count = lambda mask: mask.sum(dtype=torch.int64)  # noqa: E731
    counts = ObjectiveMetrics(
        {
            "rows_centered": count(centered),
            "rows_singleton": count(loss & scored & (members == 1)),
            "rows_unscored": count(loss & ~scored & ~missing),
            "rows_missing_label": count(loss & missing),
            "rows_no_mask_logprobs": count(loss & scored & ~has_q),
            "rows_no_support": count(no_support),
            "rows_inference_q": count(loss & ~q_label_ok),
            "slots_invalid": count(loss_slot & member & has_row[row] & ~sampler_ok),
            "duplicate_ids": count(loss_slot & scored[row] & ~member & (ids >= 0)),
            "no_sampler_logprob": count(dropped),
        }
    )
    return SupportDistribution(
        row=row,
        valid=valid,
        log_p=torch.where(valid, trainer, torch.zeros((), dtype=cdt, device=device)),
        log_q=log_q,
        log_q_label=log_q_label,
        log_mass=log_mass,
        log_p_valid=_log_valid_mass(detached, member, valid, row, n),
        centered=centered,
        loss_mask=loss,
        no_support=no_support,
        no_mask_logprobs=loss & scored & (members > 1) & ~has_q,
        counts=counts,
    )


def _log_sum(values: torch.Tensor, on: torch.Tensor, row: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: ``logsumexp`` of ``values`` over each row's ``on`` slots (``-inf`` for none)."""
    masked = torch.where(on, values, float("-inf"))
    top = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
    top = top.scatter_reduce(0, row, masked, "amax")
    shift = torch.where(torch.isfinite(top), top, 0.0)
    total = torch.zeros(n, dtype=values.dtype, device=values.device)
    total = total.index_add(0, row, torch.exp(masked - shift[row]))
    return shift + torch.log(total)


def _log_valid_mass(
    trainer: torch.Tensor, member: torch.Tensor, valid: torch.Tensor, row: torch.Tensor, n: int
) -> torch.Tensor:
    """``[n]`` ``log Σ_valid p^S``: ``log1p(−Σ_invalid p^S)`` while the invalid members' mass is
    below a half (exactly 0 without one: the trainer's rounding of ``Σ p^S = 1`` is not the
    sampler's mismatch), the valid slots' ``logsumexp`` beyond."""
    lp = trainer
    invalid = torch.zeros(n, dtype=lp.dtype, device=lp.device).index_add(
        0, row, torch.where(member & ~valid, lp, float("-inf")).exp()
    )
    small = invalid < 0.5
    return torch.where(
        small, torch.log1p(-torch.where(small, invalid, 0.0)), _log_sum(lp, valid, row, n)
    )
