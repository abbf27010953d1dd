"""The value checks of :func:`~rollfeed.objectives.policy_loss`, read back in one host sync.

Each check is a ``[N]`` bool of the tokens that fail it, computed on the device; :func:`verify`
stacks their ``any()`` into one tensor, reads it once and raises the first failed check's typed
error naming the tensor and the token:

- ``logprobs`` NaN or ``+inf``, ``advantages`` NaN or infinite, on a loss token:
  :class:`ObjectiveInputError`;
- ``positions`` outside ``[0, cu_seqlens[-1])``, repeated, or ``cu_seqlens`` not starting at 0 and
  rising: :class:`ObjectiveInputError` (a sample's sums would take tokens of no sample);
- a loss token score centering cannot center for want of its kept set or its mask logprobs
  (``ScoreCentering(missing="error")``): :class:`ObjectiveMissingInputError`, naming the field and
  how to write it;
- a loss token's term or its gradient beyond the dtype: :class:`ObjectiveOverflowError`.

Example: ``positions = [0, 1, 9]`` with ``cu_seqlens = [0, 5, 8]`` -> ``ObjectiveInputError(
"positions[2] = 9 is outside the micro batch's 8 positions ...", tensor="positions", pos=2)``.
"""

from __future__ import annotations

import torch

from rollfeed.objectives.errors import (
    ObjectiveInputError,
    ObjectiveMissingInputError,
    ObjectiveOverflowError,
)

_WRITE_MASK_LOGPROBS = (
    "write the sampler's logprob of every kept id as the payload field 'sampling_mask_logprobs' "
    "(PAYLOAD_FIELDS['sampling_mask_logprobs']: ragged with the same counts as 'sampling_mask', "
    "PayloadWriter.write({'sampling_mask': (counts, ids), 'sampling_mask_logprobs': (counts, "
    "logprobs)}, pos=..., sampled=...); the vLLM capture writes it under "
    "CaptureConfig(mask_logprobs=True), its default) and take it with micro_batch_rows(mb)"
)
_WRITE_KEPT_SETS = (
    "write each sampled token's kept set as the payload field 'sampling_mask' "
    "(PAYLOAD_FIELDS['sampling_mask'], PayloadWriter.write({'sampling_mask': (counts, ids)}, "
    "pos=..., sampled=...); the vLLM capture writes it)"
)


def position_checks(
    positions: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bad [N], bad_bounds 0-d)``: positions outside the row or repeated; ``cu_seqlens`` not
    starting at 0 or falling. Raises at once for a non-integer dtype (no value to read)."""
    for name, t in (("positions", positions), ("cu_seqlens", cu_seqlens)):
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise ObjectiveInputError(f"{name} must hold integers, got {t.dtype}", tensor=name)
    pos = positions.long()
    bounds = cu_seqlens.to(device=pos.device, dtype=torch.int64)
    bad = (pos < 0) | (pos >= bounds[-1])
    if pos.numel() > 1:
        order = torch.sort(pos)
        repeat = order.values[1:] == order.values[:-1]
        bad = bad | torch.zeros_like(bad).scatter(0, order.indices[1:], repeat)
    bad_bounds = (bounds[0] != 0) | (bounds.diff() < 0).any()
    return bad, bad_bounds.to(pos.device)


def verify(
    *,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    bad_logprobs: torch.Tensor,
    bad_advantages: torch.Tensor,
    positions: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    bad_positions: torch.Tensor,
    bad_bounds: torch.Tensor,
    no_support: torch.Tensor,
    no_mask_logprobs: torch.Tensor,
    overflow: torch.Tensor,
    log_ratio: torch.Tensor,
) -> None:
    """Raise the first failed check of the module doc; one host sync when none fails."""
    checks = (
        bad_logprobs,
        bad_advantages,
        bad_positions,
        bad_bounds,
        no_support,
        no_mask_logprobs,
        overflow,
    )
    if not any(torch.stack([c.any() for c in checks]).tolist()):
        return
    first = lambda bad: int(torch.nonzero(bad.reshape(-1))[0])  # noqa: E731
    for name, bad, values in (
        ("logprobs", bad_logprobs, logprobs),
        ("advantages", bad_advantages, advantages),
    ):
        if bool(bad.any()):
            j = first(bad)
            value = float(values[j].detach())
            raise ObjectiveInputError(
                f"{name}[{j}] = {value} on a loss token is not a number the loss can "
                "use (logprobs: NaN or +inf; advantages: NaN or infinite)",
                tensor=name,
                pos=j,
            )
    if bool(bad_bounds.any()):
        raise ObjectiveInputError(
            f"cu_seqlens must start at 0 and never fall, got {cu_seqlens.tolist()[:16]}",
            tensor="cu_seqlens",
        )
    if bool(bad_positions.any()):
        j = first(bad_positions)
        raise ObjectiveInputError(
            f"positions[{j}] = {int(positions[j])} is outside the micro batch's "
            f"{int(cu_seqlens[-1])} positions or repeats one (take positions and cu_seqlens "
            "from the same micro batch: mb.positions, mb.cu_seqlens)",
            tensor="positions",
            pos=j,
        )
    if bool(no_support.any()):
        j = first(no_support)
        raise ObjectiveMissingInputError(
            f"score centering needs the kept set of every loss token; token {j} has none: "
            f"{_WRITE_KEPT_SETS}, or pass ScoreCentering(missing='skip') to leave such tokens "
            "uncentered (counted in rows_no_support)",
            tensor="support",
            pos=j,
        )
    if bool(no_mask_logprobs.any()):
        j = first(no_mask_logprobs)
        raise ObjectiveMissingInputError(
            f"score centering needs the sampler's logprob of every kept id; loss token {j} has "
            f"a kept set and no valid mask logprob ({int(no_mask_logprobs.sum())} such tokens): "
            f"{_WRITE_MASK_LOGPROBS}; or pass ScoreCentering(missing='skip') to leave such "
            "tokens uncentered (counted in rows_no_mask_logprobs)",
            tensor="mask_logprobs",
            pos=j,
        )
    j = first(overflow)
    raise ObjectiveOverflowError(
        f"the policy term of loss token {j} (log r = {float(log_ratio[j]):.6g}) or its gradient "
        f"does not fit {log_ratio.dtype}: bound the weight (TruncatedIS(cap=...), "
        "MaskedIS(high=...), a TrustRegion cap, a SequenceWeight cap or band), or leave the "
        "token out of the loss",
        tensor="logprobs",
        pos=j,
    )
