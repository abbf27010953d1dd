"""KeptDistribution: the sampler's and the trainer's distributions over each row's kept set ``S``.

Inputs are ragged rows aligned slot for slot (:class:`~rollfeed.collate.RaggedRows`, ``n`` rows):
the kept ids, the trainer's ``log p^S(v) = z_v − logsumexp_{u∈S} z_u`` of every kept id (with
gradient; :attr:`rollfeed.models.SupportScores.kept_logprobs`), and the sampler's logprob of every
kept id (``sampling_mask_logprobs``: :func:`rollfeed.objectives.aligned_mask_logprobs` takes its
rows from a micro batch). A row of mask logprobs is either as long as its kept set or empty (the row
has no mask logprobs).

Slot rules (padding is explicit, never a sentinel id):

- a slot is a *member* of ``S`` if its id is ``>= 0`` and the trainer's logprob there is finite:
  the scorer gives ``-inf`` on every slot that is no member (padding, the later slots of a
  repeated id, so a repeated id counts once at its first slot, and every slot of a fallback
  row), and ``kept_logprobs`` from elsewhere must follow that rule; a repeat is counted in
  ``duplicate_ids`` (an id's slot at ``-inf`` in a row that has members);
- a member is *valid* if the sampler's logprob there is a number ``> -9999`` (``-inf``, vLLM's JSON
  clamp at ``-9999`` and NaN are not): it stays in ``S`` for ``p^S`` but gets zero weight and no
  gradient, and ``q`` is renormalised over the valid slots: ``log q^S(v) = s_v − logsumexp_valid s``
  with ``log_mass = logsumexp_valid s`` (the sampler's mass on the valid slots before, a metric);
- ``q^S(a)`` of the sampled token ``a`` (the row's label) is read at the label's slot where that is
  valid, else from ``inference_logprobs`` (counted in ``rows_inference_q``).

A loss token is *centered* when its row was scored over its support (a member exists and the label
is among the ids) and has at least one valid slot. Counters (0-d int64, loss tokens only):
``rows_centered``, ``rows_singleton``, ``rows_unscored`` (fallback rows, rows without a kept set),
``rows_missing_label`` (a kept set without the label), ``rows_no_mask_logprobs`` (no mask row, or
no valid slot in it), ``rows_inference_q``, ``slots_invalid``, ``duplicate_ids``.

Worked example, one row: ids ``[4, 2, 7]`` (label 4), trainer ``log p^S = log [0.5, 0.3, 0.2]``,
sampler ``log [0.6, 0.3, 0.0]`` with the last slot at ``-inf``::

    valid [T, T, F]   log_mass = log 0.9   q^S = [0.6667, 0.3333, -]   q^S(a) = 0.6667
"""

from __future__ import annotations

import dataclasses

import torch

from rollfeed.collate import RaggedRows
from rollfeed.objectives.errors import ObjectiveInputError

# vLLM writes -inf as -9999 in JSON: a logprob at or below it is no number of the sampler's.
SAMPLER_LOGPROB_FLOOR = -9999.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KeptDistribution:
    """``q^S`` and ``p^S`` of ``N`` rows over their ``nnz`` kept slots (see the module doc).

    row: ``[nnz]`` int64, the row of every slot. valid: ``[nnz]`` bool.
    log_p: ``[nnz]`` trainer ``log p^S``, with gradient on valid slots, 0 elsewhere (no gradient).
    log_q: ``[nnz]`` detached sampler ``log q^S`` renormalised over the valid slots, ``-inf``
    elsewhere. log_q_label: ``[N]`` detached ``log q^S(a)``. log_mass: ``[N]`` detached
    ``logsumexp`` of the valid sampler logprobs (0 on rows without one). centered, loss_mask:
    ``[N]`` bool. counts: name -> 0-d int64 tensor.
    """

    row: torch.Tensor
    valid: torch.Tensor
    log_p: torch.Tensor
    log_q: torch.Tensor
    log_q_label: torch.Tensor
    log_mass: torch.Tensor
    centered: torch.Tensor
    loss_mask: torch.Tensor
    counts: dict[str, torch.Tensor]

    @property
    def n_rows(self) -> int:
        return self.loss_mask.numel()


def kept_distribution(
    support: RaggedRows,
    kept_logprobs: RaggedRows,
    mask_logprobs: RaggedRows,
    *,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    inference_logprobs: torch.Tensor,
) -> KeptDistribution:
    """The kept-set distributions of ``N`` rows (module doc).

    Args:
        support: ``N`` rows of int32/int64 kept ids (``-1`` slots are padding).
        kept_logprobs: trainer ``log p^S`` aligned with ``support`` (float, with gradient).
        mask_logprobs: sampler logprobs, each row as long as its kept set or empty.
        labels: ``[N]`` sampled token ids. loss_mask: ``[N]`` bool.
        inference_logprobs: ``[N]`` sampler logprob of the label, used where the label's mask
            logprob is missing or invalid.
    """
    n = _check(support, kept_logprobs, mask_logprobs, labels, loss_mask, inference_logprobs)
    cdt = kept_logprobs.dtype
    device = kept_logprobs.device
    row = support.row_index()
    ids = support.values.long()
    trainer = kept_logprobs.values
    member = (ids >= 0) & torch.isfinite(trainer.detach())
    has_row = mask_logprobs.lengths() > 0
    # Each mask value's slot in the support rows (a gather, no boolean index: no host sync).
    mask_row = mask_logprobs.row_index()
    at = support.offsets[mask_row] + (
        torch.arange(mask_logprobs.nnz, device=device) - mask_logprobs.offsets[mask_row]
    )
    sampler = torch.full((support.nnz,), float("nan"), dtype=cdt, device=device)
    sampler = sampler.index_copy(0, at, mask_logprobs.values.detach().to(cdt))
    sampler_ok = torch.isfinite(sampler) & (sampler > SAMPLER_LOGPROB_FLOOR)
    valid = member & sampler_ok

    neg_inf = torch.tensor(float("-inf"), dtype=cdt, device=device)
    top = torch.full((n,), float("-inf"), dtype=cdt, device=device)
    top = top.scatter_reduce(0, row, torch.where(valid, sampler, neg_inf), "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    mass = torch.zeros(n, dtype=cdt, device=device)
    mass = mass.index_add(0, row, torch.where(valid, torch.exp(sampler - top[row]), 0.0))
    has_q = mass > 0
    log_mass = torch.where(has_q, top + torch.log(torch.where(has_q, mass, 1.0)), 0.0)
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
    log_q_label = torch.where(q_label_ok, q_at_label, inference_logprobs.detach().to(cdt))
    centered = loss_mask & scored & has_q
    loss_slot = loss_mask[row]
    count = lambda mask: mask.sum(dtype=torch.int64)  # noqa: E731
    counts = {
        "rows_centered": count(centered),
        "rows_singleton": count(loss_mask & scored & (members == 1)),
        "rows_unscored": count(loss_mask & ~scored & ~missing),
        "rows_missing_label": count(loss_mask & missing),
        "rows_no_mask_logprobs": count(loss_mask & scored & ~has_q),
        "rows_inference_q": count(loss_mask & ~q_label_ok),
        "slots_invalid": count(loss_slot & member & has_row[row] & ~sampler_ok),
        "duplicate_ids": count(loss_slot & scored[row] & ~member & (ids >= 0)),
    }
    return KeptDistribution(
        row=row,
        valid=valid,
        log_p=torch.where(valid, trainer, torch.zeros((), dtype=cdt, device=device)),
        log_q=log_q,
        log_q_label=log_q_label,
        log_mass=log_mass,
        centered=centered,
        loss_mask=loss_mask,
        counts=counts,
    )


def _check(support, kept, mask, labels, loss_mask, inference) -> int:  # type: ignore[no-untyped-def]
    for name, value in (("support", support), ("kept_logprobs", kept), ("mask_logprobs", mask)):
        if not isinstance(value, RaggedRows):
            raise ObjectiveInputError(
                f"{name} must be RaggedRows, got {type(value).__name__}; a padded [N, W] tensor "
                "converts with RaggedRows.from_padded",
                tensor=name,
            )
    n = support.n_rows
    if support.dtype not in (torch.int32, torch.int64):
        raise ObjectiveInputError(f"support ids must be int32/int64, got {support.dtype}")
    if not kept.dtype.is_floating_point or not mask.dtype.is_floating_point:
        raise ObjectiveInputError(
            f"kept_logprobs and mask_logprobs must be float, got {kept.dtype} and {mask.dtype}"
        )
    for name, t, dtype in (
        ("labels", labels, None),
        ("loss_mask", loss_mask, torch.bool),
        ("inference_logprobs", inference, None),
    ):
        if t.shape != (n,) or (dtype is not None and t.dtype != dtype):
            raise ObjectiveInputError(
                f"{name} must be [{n}]{' ' + str(dtype) if dtype else ''} (one per kept-set "
                f"row), got {t.dtype} {tuple(t.shape)}",
                tensor=name,
            )
    for name, rows in (("kept_logprobs", kept), ("mask_logprobs", mask)):
        if rows.n_rows != n:
            raise ObjectiveInputError(
                f"{name} has {rows.n_rows} rows, the support {n}", tensor=name
            )
    if support.device.type != "cpu":  # on an accelerator the alignment check would sync
        return n
    if not torch.equal(kept.offsets, support.offsets):
        bad = int(torch.nonzero(kept.offsets != support.offsets)[0]) - 1
        raise ObjectiveInputError(
            "kept_logprobs rows must align slot for slot with the support rows",
            tensor="kept_logprobs",
            pos=max(bad, 0),
        )
    held, want = mask.lengths(), support.lengths()
    bad_rows = (held != 0) & (held != want)
    if bool(bad_rows.any()):
        at = int(torch.nonzero(bad_rows)[0])
        raise ObjectiveInputError(
            f"mask_logprobs row {at} holds {int(held[at])} values for a kept set of "
            f"{int(want[at])} slots (a row is as long as its kept set, or empty)",
            tensor="mask_logprobs",
            pos=at,
        )
    return n
