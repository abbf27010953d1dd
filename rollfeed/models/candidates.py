"""Support membership, input checks and the shared score-over-candidates math.

Both entry points (:func:`rollfeed.models.support_logprobs` on logits and
:func:`rollfeed.models.fused_support_logprobs` on hidden states) reduce to the same problem: per row
``n`` a set of candidate logits ``values[n, :]`` (already divided by the temperature) with a member
mask, the label's logit, and optionally a few *fallback* rows scored over the whole (local)
vocabulary. :func:`score_candidates` turns that into ``logp`` and entropy with exactly one MAX and one
SUM all-reduce over the TP group (see :mod:`rollfeed.models.tp`).

Support semantics (fixed here, for both paths):

- ``support[n]`` lists token ids; every negative entry is padding and contributes nothing (the
  capture side writes trailing ``-1``; where a ``-1`` sits does not change the score);
- an id repeated within a row counts **once**: the support is a set. Repeats are counted in
  ``metrics["duplicate_ids"]``;
- a row with no id is invalid: ``valid_mask = False``, logprob and entropy 0, zero gradient —
  unless ``fallback_mask[n]`` is set, in which case the row is scored over the full vocabulary
  (its support, if any, is ignored) and counted in ``metrics["rows_fallback"]``;
- a label outside its row's support is *not* repaired: the score is ``l_y − logsumexp_S l`` (which
  may be positive) and the row is counted in ``metrics["label_outside_support"]``. Callers that
  prefer a full-vocab score for such rows pass them in ``fallback_mask``.
"""

from __future__ import annotations

import torch

from rollfeed.models.tp import ProcessGroup, all_reduce_max, all_reduce_sum_local_grad


class SupportInputError(ValueError):
    """Bad shapes, dtypes or ids given to a support scorer."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bfloat16/fp32 inputs, fp64 for fp64 inputs (the float64 reference tests)."""
    return torch.promote_types(dtype, torch.float32)


def check_inputs(
    *,
    rows: int,
    labels: torch.Tensor,
    support: torch.Tensor,
    fallback_mask: torch.Tensor | None,
    temperature: float,
    compute_entropy: bool,
    entropy_requires_grad: bool,
) -> None:
    """Shape/dtype checks that need no host sync."""
    if support.dim() != 2 or support.shape[0] != rows:
        raise SupportInputError(
            f"support must be [N, K] with N={rows} rows, got shape {tuple(support.shape)}; "
            "flatten leading dims before scoring"
        )
    if support.dtype not in (torch.int32, torch.int64) or support.shape[1] == 0:
        raise SupportInputError(
            f"support must be int32/int64 with K >= 1 columns, got {support.dtype} with "
            f"K={support.shape[1]}; pad empty rows with -1"
        )
    if labels.shape != (rows,) or labels.dtype not in (torch.int32, torch.int64):
        raise SupportInputError(
            f"labels must be int32/int64 of shape ({rows},), got {labels.dtype} {tuple(labels.shape)}"
        )
    if fallback_mask is not None and (
        fallback_mask.shape != (rows,) or fallback_mask.dtype != torch.bool
    ):
        raise SupportInputError(
            f"fallback_mask must be bool of shape ({rows},), got "
            f"{fallback_mask.dtype} {tuple(fallback_mask.shape)}"
        )
    if not temperature > 0:
        raise SupportInputError(f"temperature must be > 0, got {temperature}")
    if entropy_requires_grad and not compute_entropy:
        raise SupportInputError("entropy_requires_grad=True needs compute_entropy=True")


def check_ids(
    labels: torch.Tensor, support: torch.Tensor, scored: torch.Tensor, vocab_size: int
) -> None:
    """Value checks (one host sync): support ids in ``[-1, V)``, labels of scored rows in ``[0, V)``."""
    bad_support = (support < -1) | (support >= vocab_size)
    bad_label = scored & ((labels < 0) | (labels >= vocab_size))
    if bool(bad_support.any() | bad_label.any()):
        if bool(bad_support.any()):
            n, k = (int(i) for i in bad_support.nonzero()[0])
            raise SupportInputError(
                f"support[{n}, {k}] = {int(support[n, k])} is outside [-1, {vocab_size}): ids are "
                "token ids of the full vocabulary and -1 is the only padding value"
            )
        n = int(bad_label.nonzero()[0, 0])
        raise SupportInputError(
            f"labels[{n}] = {int(labels[n])} is outside [0, {vocab_size}) on a scored row; give "
            "the row an empty support (all -1) if it should not be scored"
        )


def support_members(support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``member [N, K]`` (id >= 0 and first occurrence in its row) and the count of repeated ids.

    Example: ``support = [[5, 3, 5, -1]]`` → ``member = [[True, True, False, False]]``, 1 repeat.
    Sorting keeps this ``O(N·K log K)`` in time and ``O(N·K)`` in memory for wide rows.
    """
    ordered, perm = support.sort(dim=-1)
    repeat_sorted = torch.zeros_like(ordered, dtype=torch.bool)
    repeat_sorted[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    repeat = torch.zeros_like(repeat_sorted).scatter_(1, perm, repeat_sorted)
    return (support >= 0) & ~repeat, repeat.sum()


def support_metrics(
    member: torch.Tensor,
    repeats: torch.Tensor,
    support: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    fallback: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Counters as 0-d int64 tensors (no host sync; call ``.item()`` when logging)."""
    by_support = member.any(-1) if fallback is None else member.any(-1) & ~fallback
    sizes = member.sum(-1)
    label_in = (member & (support == labels[:, None])).any(-1)
    zero = torch.zeros((), dtype=torch.int64, device=support.device)
    return {
        "rows_valid": valid.sum(),
        "rows_fallback": zero if fallback is None else fallback.sum(),
        "rows_singleton": (by_support & (sizes == 1)).sum(),
        "label_outside_support": (by_support & ~label_in).sum(),
        "duplicate_ids": repeats,
    }


def score_candidates(
    values: torch.Tensor,
    member: torch.Tensor,
    label_value: torch.Tensor,
    label_owned: torch.Tensor,
    valid: torch.Tensor,
    *,
    dense_rows: torch.Tensor | None = None,
    dense_values: torch.Tensor | None = None,
    tp_group: ProcessGroup | None = None,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Support-normalised ``logp [N]`` and entropy ``[N]`` (or None) from candidate logits.

    Args (all logits already divided by the temperature, in the compute dtype):
        values: ``[N, K]`` candidate logits; entries where ``member`` is False are ignored (they
            must be finite; they get zero gradient).
        member: ``[N, K]`` bool, True where the candidate is in the row's set *on this rank*.
        label_value: ``[N]`` label logit, read where ``label_owned`` (this rank owns the label id).
        valid: ``[N]`` bool, rows that are scored (same on every TP rank); others give 0.
        dense_rows, dense_values: ``[F]`` row indices and ``[F, V_local]`` logits of rows scored
            over the whole vocabulary (their ``member`` row must be all False).

    One MAX all-reduce of the detached row max ``[N]`` and one SUM all-reduce of a stacked
    ``[2, N]`` (``Σw``, label logit) or ``[3, N]`` (plus ``Σ w·(l − m)`` for entropy).
    """
    neg_inf = torch.tensor(float("-inf"), dtype=values.dtype, device=values.device)
    row_max = torch.where(member, values.detach(), neg_inf).amax(-1)
    if dense_rows is not None and dense_values is not None:
        row_max = row_max.index_put((dense_rows,), dense_values.detach().amax(-1))
    m = all_reduce_max(row_max, tp_group)
    # Rows with no candidate anywhere keep -inf; 0 keeps exp/log finite and they are masked later.
    m = torch.where(torch.isfinite(m), m, 0)

    shifted = torch.where(member, values - m[:, None], 0)
    w = torch.where(member, shifted.exp(), 0)
    sums = [w.sum(-1), torch.where(label_owned, label_value, 0)]
    if compute_entropy:
        ew, es = (w, shifted) if entropy_requires_grad else (w.detach(), shifted.detach())
        sums.append((ew * es).sum(-1))
    if dense_rows is not None and dense_values is not None:
        d_shifted = dense_values - m[dense_rows, None]
        d_w = d_shifted.exp()
        sums[0] = sums[0].index_put((dense_rows,), d_w.sum(-1))
        if compute_entropy:
            if not entropy_requires_grad:
                d_w, d_shifted = d_w.detach(), d_shifted.detach()
            sums[2] = sums[2].index_put((dense_rows,), (d_w * d_shifted).sum(-1))

    total = all_reduce_sum_local_grad(torch.stack(sums), tp_group)
    z = torch.where(valid, total[0], 1)
    logp = torch.where(valid, total[1] - m - z.log(), 0)
    if not compute_entropy:
        return logp, None
    if entropy_requires_grad:
        return logp, torch.where(valid, z.log() - total[2] / z, 0)
    z, h_num = z.detach(), total[2].detach()
    return logp, torch.where(valid, z.log() - h_num / z, 0)
