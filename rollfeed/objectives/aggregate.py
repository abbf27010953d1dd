"""aggregate: one micro batch's share of the step's loss, normalised over the whole step.

A step's loss tokens are spread over dp ranks, micro batches and (within a row) cp ranks. A loss
that each rank normalises by its own tokens weighs a token by how its rank's batch happened to
be packed: a silent bias. :func:`aggregate` normalises by the step's own counts, which every micro
batch carries (``mb.step_counts``, :class:`~rollfeed.collate.StepCounts`: planned by every rank
from the step index, exact after truncation, no collective), so that the shares of every rank and
micro batch add up to the loss one process would compute over the whole step. With the gradients
summed over ranks, not averaged (:func:`rollfeed.models.sum_gradients`), the gradient is that
loss's gradient too.

Modes (``ℓ_t`` a loss token's term; ``L`` the step's loss tokens; ``L_s`` sample ``s``'s;
``M`` the step's samples with at least one loss token)::

    token_mean            Σ_t ℓ_t / L                     every loss token of the step alike
    seq_mean_token_mean   Σ_s (Σ_{t∈s} ℓ_t / L_s) / M     each sample's mean, then their mean
    seq_mean_token_sum    Σ_s (Σ_{t∈s} ℓ_t) / M           each sample's sum, then their mean

These are the loss aggregation modes RL trainers name ``token-mean``, ``seq-mean-token-mean`` and
``seq-mean-token-sum``. A sample without a loss token takes no part in the sequence means. A step
without a loss token gives a 0 whose gradient is 0 (every rank still runs its backward).

Worked example: one step of two samples with loss terms ``[1, 2, 3]`` and ``[4]`` (``L = 4``,
``M = 2``) on two micro batches::

    token_mean            (1 + 2 + 3) / 4 + 4 / 4               = 2.5
    seq_mean_token_mean   (1 + 2 + 3) / 3 / 2 + 4 / 1 / 2       = 3.0
    seq_mean_token_sum    (1 + 2 + 3) / 2 + 4 / 2               = 5.0
"""

from __future__ import annotations

from typing import Literal

import torch

from rollfeed.collate import TensorMicroBatch
from rollfeed.objectives.errors import ObjectiveInputError, ObjectiveMissingInputError

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def aggregate(
    terms_loss: torch.Tensor, mb: TensorMicroBatch, *, mode: Aggregation = "token_mean"
) -> torch.Tensor:
    """This micro batch's share of the step's loss (0-d, in ``terms_loss``'s dtype).

    Args:
        terms_loss: ``[N]`` per-token terms lined up with ``mb.loss_mask`` (e.g.
            ``policy_loss(...).loss``); only loss tokens count, whatever the others hold.
        mb: the micro batch, with the step's counts (``mb.step_counts``, from the loader or
            ``prepare_batch``).
        mode: one of :data:`AGGREGATIONS` (see the module doc).

    Raises:
        ObjectiveInputError: an unknown ``mode``, or terms not ``[N]``.
        ObjectiveMissingInputError: a micro batch without step counts.
    """
    if mode not in AGGREGATIONS:
        raise ObjectiveInputError(f"aggregation mode must be one of {AGGREGATIONS}, got {mode!r}")
    counts = mb.step_counts
    if counts is None:
        raise ObjectiveMissingInputError(
            "the micro batch carries no step counts (mb.step_counts is None), so its share of "
            "the step's loss is unknown: take micro batches from the loader or prepare_batch, "
            "which plan the whole step",
            tensor="step_counts",
        )
    mask = mb.loss_mask
    if terms_loss.shape != mask.shape:
        raise ObjectiveInputError(
            f"terms_loss must be [{mask.numel()}] like mb.loss_mask, got {tuple(terms_loss.shape)}",
            tensor="terms_loss",
        )
    terms = torch.where(mask, terms_loss, 0.0)
    if mode == "token_mean":
        return terms.sum() / max(counts.loss_tokens, 1)
    samples = max(counts.samples_with_loss, 1)
    if mode == "seq_mean_token_sum":
        return terms.sum() / samples
    # each token's sample: the slot its position lies in (slots past the samples: padding)
    bounds = mb.cu_seqlens.to(device=mask.device, dtype=torch.int64)
    slots = bounds.numel() - 1
    slot = (torch.searchsorted(bounds, mb.positions.long(), right=True) - 1).clamp(0, slots - 1)
    per_slot = torch.ones(slots, dtype=terms.dtype, device=mask.device)
    per_sample = counts.sample_loss_tokens.to(device=mask.device, dtype=terms.dtype)
    per_slot[: per_sample.numel()] = per_sample.clamp_min(1)  # 0 only where no loss token is
    return (terms / per_slot[slot]).sum() / samples
