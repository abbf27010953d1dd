"""The input checks of :func:`~rollfeed.objectives.support_distribution`.

:func:`check_rows` holds types, shapes and row alignment to each other before anything is
computed (alignment only on the CPU: on an accelerator it would sync). :func:`verify_values`
reads every value verdict of one call back in one host sync and raises the first failed one's
typed error, naming the tensor and the row:

- a NaN or ``+inf`` where a logprob should be (a mask logprob, a kept id's trainer logprob, a loss
  token's ``inference_logprobs``): :class:`ObjectiveInputError`;
- a loss token without the sampler's logprob of its label under
  ``no_sampler_logprob="error"``: :class:`NoSamplerLogprobError`.

Example: ``inference_logprobs = [-0.2, nan]`` with both tokens in the loss ->
``ObjectiveInputError("inference_logprobs[1] = nan is not a logprob ...", tensor=
"inference_logprobs", pos=1)``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rollfeed.collate import RaggedRows
from rollfeed.objectives.errors import NoSamplerLogprobError, ObjectiveInputError

NoSamplerLogprob = Literal["drop", "error"]
NO_SAMPLER_LOGPROB = ("drop", "error")


def not_a_logprob(values: torch.Tensor) -> torch.Tensor:
    """NaN or ``+inf``: a value no logprob can take (``-inf`` is a probability of 0)."""
    return torch.isnan(values) | torch.isposinf(values)


def check_rows(support, kept, mask, labels, loss_mask, inference, policy) -> int:  # type: ignore[no-untyped-def]
    """The row count ``N`` of consistent inputs, else :class:`ObjectiveInputError`."""
    if policy not in NO_SAMPLER_LOGPROB:
        raise ObjectiveInputError(
            f"no_sampler_logprob must be one of {NO_SAMPLER_LOGPROB}, got {policy!r}"
        )
    for name, value in (("support", support), ("support_logprobs", kept), ("mask_logprobs", mask)):
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
            f"support_logprobs and mask_logprobs must be float, got {kept.dtype} and {mask.dtype}"
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
    if not inference.dtype.is_floating_point:
        raise ObjectiveInputError(
            f"inference_logprobs must be float, got {inference.dtype}", tensor="inference_logprobs"
        )
    for name, rows in (("support_logprobs", kept), ("mask_logprobs", mask)):
        if rows.n_rows != n:
            raise ObjectiveInputError(
                f"{name} has {rows.n_rows} rows, the support {n}", tensor=name
            )
    if support.device.type != "cpu":  # on an accelerator the alignment check would sync
        return n
    if not torch.equal(kept.offsets, support.offsets):
        bad = int(torch.nonzero(kept.offsets != support.offsets)[0]) - 1
        raise ObjectiveInputError(
            "support_logprobs rows must align slot for slot with the support rows",
            tensor="support_logprobs",
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


def verify_values(
    *,
    mask_rows: torch.Tensor,
    bad_mask: torch.Tensor,
    slot_rows: torch.Tensor,
    bad_kept: torch.Tensor,
    bad_inference: torch.Tensor,
    dropped: torch.Tensor,
    policy: NoSamplerLogprob,
    inference: torch.Tensor,
) -> None:
    """Raise the first failed value check (module doc); one host sync for all of them.

    ``bad_mask [nnz_mask]`` with ``mask_rows``, ``bad_kept [nnz]`` with ``slot_rows``,
    ``bad_inference`` and ``dropped`` ``[N]``."""
    refuse = dropped if policy == "error" else torch.zeros_like(dropped)
    checks = (bad_mask, bad_kept, bad_inference, refuse)
    if not any(torch.stack([c.any() for c in checks]).tolist()):
        return
    for name, bad, rows in (
        ("mask_logprobs", bad_mask, mask_rows),
        ("support_logprobs", bad_kept, slot_rows),
    ):
        if bool(bad.any()):
            row = int(rows[int(torch.nonzero(bad)[0])])
            raise ObjectiveInputError(
                f"{name} row {row} holds a NaN or +inf where a logprob should be (a kept id "
                "with no logprob is -inf, or -9999 as vLLM writes it in JSON)",
                tensor=name,
                pos=row,
            )
    if bool(bad_inference.any()):
        j = int(torch.nonzero(bad_inference)[0])
        raise ObjectiveInputError(
            f"inference_logprobs[{j}] = {float(inference[j])} is not a logprob on a loss token "
            "(write -inf, or leave the token out of the loss, where the sampler gave none)",
            tensor="inference_logprobs",
            pos=j,
        )
    j = int(torch.nonzero(refuse)[0])
    raise NoSamplerLogprobError(
        f"{int(refuse.sum())} loss token(s) have no sampler logprob of their label, first "
        f"token {j} (inference_logprobs {float(inference[j])}, -9999 or below and -inf are "
        "none, and no valid mask logprob at the label's slot); record the sampler's logprobs, "
        "or pass no_sampler_logprob='drop' to leave such tokens out of the loss (counted in "
        "metrics['no_sampler_logprob'])",
        tensor="inference_logprobs",
        pos=j,
    )
