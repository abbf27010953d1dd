"""Row planning and the shared score-over-candidates math of both support scorers.

:func:`rollfeed.models.support_logprobs` (logits) and :func:`rollfeed.models.fused_support_logprobs`
(hidden states) reduce to one problem: per row ``n``, candidate logits ``values[n, :]`` (already
divided by the temperature) with a member mask, the label's logit, and a few *fallback* rows scored
over the whole vocabulary, given as this rank's log-sum-exp. :func:`score_candidates` turns that
into ``logp`` and entropy with one MAX and one SUM all-reduce over the TP group.

Support semantics (fixed here, for both paths):

- ``support[n]`` lists global token ids; ``-1`` is padding and contributes nothing, any other
  negative id raises :class:`VocabularyRangeError`;
- an id repeated within a row counts **once** (the support is a set); repeats are counted in
  ``metrics["duplicate_ids"]``;
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

The input checks' verdicts are read back in one host sync together with what the caller must
read anyway (:meth:`RowChecks.verify`: the fused path's pair count), before any collective; the
scores' finiteness is one host sync after the reductions, where every TP rank holds the same sums
and so raises with the others.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from rollfeed.models.errors import (
    NonFiniteLogitError,
    SupportInputError,
    SupportLabelError,
    TemperatureError,
    VocabularyRangeError,
)
from rollfeed.models.tp import ProcessGroup, all_reduce_max, all_reduce_sum_local_grad

MissingLabel = Literal["error", "full_vocab"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RowPlan:
    """Which rows are scored and how, for one call (identical on every TP rank except ``local``).

    ``member [N, W]``: first occurrence of an id >= 0, on rows scored over their support.
    ``local [N, W]``: ``member`` and the id lies in this rank's shard.
    ``fallback [N]``: rows scored over the full vocabulary.
    ``valid [N] = member.any(-1) | fallback``.
    ``label_owned [N]``: a scored row whose label lies in this rank's shard.
    ``fallback_rows [F]``: indices of the fallback rows, or None when no row can fall back.
    ``temperature [N]``: per-row temperature in the compute dtype.
    ``checks``: the input checks' verdicts, still on the device (:meth:`RowChecks.verify`).
    """

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
class RowChecks:
    """The input checks of one call, computed on the device (``[N]`` / ``[N, W]`` bool masks of
    the offending rows and ids). Nothing is scored from a plan before :meth:`verify` read them."""

    labels: torch.Tensor
    support: torch.Tensor
    temperature: torch.Tensor
    vocab_size: int
    bad_support: torch.Tensor
    bad_label: torch.Tensor
    bad_missing: torch.Tensor
    bad_temperature: torch.Tensor

    def verify(self, *read: torch.Tensor) -> list[int]:
        """Raise the first failed check's typed error; else return the 0-d integer tensors
        ``read`` as Python ints, read back with the verdicts in one host sync."""
        masks = (self.bad_support, self.bad_label, self.bad_missing, self.bad_temperature)
        values = torch.stack([*(m.any().long() for m in masks), *(r.long() for r in read)])
        out = values.tolist()  # the one host sync of the checks
        if any(out[: len(masks)]):
            _raise(self.labels, self.support, self.temperature, self.vocab_size, *masks)
        return out[len(masks) :]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp32 for half/bfloat16/fp32 inputs, fp64 when any input is fp64 (the reference tests)."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def plan_rows(
    labels: torch.Tensor,
    support: torch.Tensor,
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
) -> RowPlan:
    """Check the inputs and decide per row: support, fallback or unscored.

    ``vocab_size``: the full vocabulary ``V`` (under TP the sum of the shards' widths; see
    :func:`rollfeed.models.tp.full_vocab_size`): support ids and scored rows' labels are checked
    against ``[0, V)`` (``-1`` pads), scored rows' temperatures against finite and ``>=
    torch.finfo(dtype).tiny``. The verdicts stay on the device in ``checks``: the caller reads them
    (:meth:`RowChecks.verify`) before it scores anything.

    Costs one host sync to list fallback rows (when any row can fall back: ``fallback_mask`` given
    or ``missing_label="full_vocab"``).

    Example: ``support = [[5, 3, 5, -1], [-1, -1, -1, -1]]``, ``labels = [3, 0]`` →
    ``member = [[T, T, F, F], [F, F, F, F]]``, ``valid = [T, F]``, one duplicate id.
    """
    _check(
        labels, support, rows, fallback_mask, missing_label, compute_entropy, entropy_requires_grad
    )
    t = _temperatures(temperature, rows, dtype, support.device)
    ordered, perm = support.sort(dim=-1)
    repeat_sorted = torch.zeros_like(ordered, dtype=torch.bool)
    repeat_sorted[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    repeat = torch.zeros_like(repeat_sorted).scatter_(1, perm, repeat_sorted)
    member = (support >= 0) & ~repeat
    has_support = member.any(-1)
    label_in = (member & (support == labels[:, None])).any(-1)

    fallback = torch.zeros_like(has_support) if fallback_mask is None else fallback_mask.clone()
    missing = has_support & ~fallback & ~label_in
    if missing_label == "full_vocab":
        fallback |= missing
    member = member & ~fallback[:, None]
    valid = has_support | fallback
    checks = RowChecks(
        labels=labels,
        support=support,
        temperature=t,
        vocab_size=vocab_size,
        bad_support=(support >= vocab_size) | (support < -1),
        bad_label=valid & ((labels < 0) | (labels >= vocab_size)),
        bad_missing=missing if missing_label == "error" else torch.zeros_like(missing),
        bad_temperature=valid & ~(torch.isfinite(t) & (t >= torch.finfo(dtype).tiny)),
    )
    label_owned = valid & (labels >= vocab_start) & (labels < vocab_start + local_width)
    local = member & (support >= vocab_start) & (support < vocab_start + local_width)

    can_fall_back = fallback_mask is not None or missing_label == "full_vocab"
    zero = torch.zeros((), dtype=torch.int64, device=support.device)
    metrics = {
        "rows_valid": valid.sum(),
        "rows_fallback": fallback.sum(),
        "rows_missing_label": zero if missing_label == "error" else missing.sum(),
        "rows_singleton": (member.sum(-1) == 1).sum(),
        "duplicate_ids": repeat.sum(),
    }
    return RowPlan(
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


def _check(
    labels: torch.Tensor,
    support: torch.Tensor,
    rows: int,
    fallback_mask: torch.Tensor | None,
    missing_label: str,
    compute_entropy: bool,
    entropy_requires_grad: bool,
) -> None:
    if support.dim() != 2 or support.shape[0] != rows:
        raise SupportInputError(
            f"support must be [N, W] with N={rows} rows, got shape {tuple(support.shape)}; "
            "flatten leading dims before scoring",
            tensor="support",
        )
    if support.dtype not in (torch.int32, torch.int64) or support.shape[1] == 0:
        raise SupportInputError(
            f"support must be int32/int64 with W >= 1 columns, got {support.dtype} with "
            f"W={support.shape[1]}; pad empty rows with -1",
            tensor="support",
        )
    if labels.shape != (rows,) or labels.dtype not in (torch.int32, torch.int64):
        raise SupportInputError(
            f"labels must be int32/int64 of shape ({rows},), "
            f"got {labels.dtype} {tuple(labels.shape)}",
            tensor="labels",
        )
    if fallback_mask is not None and (
        fallback_mask.shape != (rows,) or fallback_mask.dtype != torch.bool
    ):
        raise SupportInputError(
            f"fallback_mask must be bool of shape ({rows},), got "
            f"{fallback_mask.dtype} {tuple(fallback_mask.shape)}",
            tensor="fallback_mask",
        )
    if missing_label not in ("error", "full_vocab"):
        raise SupportInputError(
            f"missing_label must be 'error' or 'full_vocab', got {missing_label!r}"
        )
    if entropy_requires_grad and not compute_entropy:
        raise SupportInputError("entropy_requires_grad=True needs compute_entropy=True")


def _raise(
    labels: torch.Tensor,
    support: torch.Tensor,
    t: torch.Tensor,
    vocab: int,
    bad_support: torch.Tensor,
    bad_label: torch.Tensor,
    bad_missing: torch.Tensor,
    bad_temperature: torch.Tensor,
) -> None:
    if bool(bad_support.any()):
        n, k = (int(i) for i in bad_support.nonzero()[0])
        raise VocabularyRangeError(
            f"support[{n}, {k}] = {int(support[n, k])} is not a token id of the vocabulary "
            f"[0, {vocab}); pad with -1 (the only padding id), and score with the model the ids "
            "were sampled from",
            tensor="support",
            pos=n,
        )
    if bool(bad_label.any()):
        n = int(bad_label.nonzero()[0, 0])
        raise VocabularyRangeError(
            f"labels[{n}] = {int(labels[n])} is outside the vocabulary [0, {vocab}) on a scored "
            "row; give the row an empty support (all -1) if it should not be scored",
            tensor="labels",
            pos=n,
        )
    if bool(bad_missing.any()):
        bad = bad_missing.nonzero().squeeze(1)[:8].tolist()
        raise SupportLabelError(
            f"{int(bad_missing.sum())} row(s) have a label outside their support, first rows "
            f"{bad} (labels {labels[bad].tolist()}); fix the capture, or pass "
            "missing_label='full_vocab' to score those rows over the full vocabulary",
            tensor="labels",
            pos=bad[0],
        )
    bad = bad_temperature.nonzero().squeeze(1)[:8].tolist()
    raise TemperatureError(
        f"{int(bad_temperature.sum())} scored row(s) have a temperature that is not finite and "
        f">= {torch.finfo(t.dtype).tiny:.4g} (the smallest normal {t.dtype}: below it 1 / "
        f"temperature overflows), first rows {bad} (temperatures {t[bad].tolist()}); record the "
        "sampler's temperature for every sampled token",
        tensor="temperature",
        pos=bad[0],
    )


def _temperatures(
    temperature: float | torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    if not isinstance(temperature, torch.Tensor) and not (
        math.isfinite(temperature) and temperature >= tiny
    ):
        raise TemperatureError(
            f"temperature must be finite and >= {tiny:.4g} (the smallest normal {dtype}: below "
            f"it 1 / temperature overflows), got {temperature}; pass the sampler's temperature",
            tensor="temperature",
        )
    t = torch.as_tensor(temperature, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(rows)
    if t.shape != (rows,):
        raise SupportInputError(
            f"temperature must be a scalar or [N={rows}], got shape {tuple(t.shape)}",
            tensor="temperature",
        )
    return t


def score_candidates(
    values: torch.Tensor,
    plan: RowPlan,
    label_value: torch.Tensor,
    *,
    dense_lse: torch.Tensor | None = None,
    dense_mean: torch.Tensor | None = None,
    tp_group: ProcessGroup | None = None,
    compute_entropy: bool = False,
    entropy_requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Support-normalised ``logp [N]`` and entropy ``[N]`` (or None).

    Args (logits already divided by the temperature, in the compute dtype):
        values: ``[N, W]`` candidate logits, read where ``plan.local`` (elsewhere they must be
            finite and get zero gradient).
        label_value: ``[N]`` label logit, read where ``plan.label_owned``.
        dense_lse, dense_mean: ``[F]`` for the fallback rows (in row order): this rank's
            ``logsumexp_v l_v`` over its shard and ``Σ_v softmax(l)_v l_v`` (entropy only).

    A fallback row enters as one pseudo-candidate per rank with logit ``dense_lse``:
    ``Σ_v e^{l_v − m} = e^{lse − m}`` and ``Σ_v e^{l_v − m}(l_v − m) = e^{lse − m}(mean − m)``.

    Collectives: one MAX of the detached row max ``[N]``; one SUM of the stacked ``[2, N]``
    (``Σw``, label logit) or ``[3, N]`` (plus ``Σ w·(l − m)``). Ranks with no member of a row
    contribute ``-inf`` to the max and 0 to the sums.
    """
    local = plan.local
    neg_inf = torch.tensor(float("-inf"), dtype=values.dtype, device=values.device)
    row_max = torch.where(local, values.detach(), neg_inf).amax(-1)
    rows = plan.fallback_rows if dense_lse is not None else None
    if rows is not None and dense_lse is not None:
        row_max = row_max.index_put((rows,), dense_lse.detach())
    m = all_reduce_max(row_max, tp_group)
    # Rows with no candidate anywhere keep -inf; 0 keeps exp/log finite and they are masked below.
    m = torch.where(torch.isfinite(m), m, 0)

    shifted = torch.where(local, values - m[:, None], 0)
    w = torch.where(local, shifted.exp(), 0)
    sums = [w.sum(-1), torch.where(plan.label_owned, label_value, 0)]
    if compute_entropy:
        ew, es = (w, shifted) if entropy_requires_grad else (w.detach(), shifted.detach())
        sums.append((ew * es).sum(-1))
    if rows is not None and dense_lse is not None:
        d_w = (dense_lse - m[rows]).exp()
        sums[0] = sums[0].index_put((rows,), d_w)
        if compute_entropy:
            assert dense_mean is not None
            d_h = d_w * (dense_mean - m[rows])
            sums[2] = sums[2].index_put((rows,), d_h if entropy_requires_grad else d_h.detach())

    total = all_reduce_sum_local_grad(torch.stack(sums), tp_group)
    z = torch.where(plan.valid, total[0], 1)
    logp = torch.where(plan.valid, total[1] - m - z.log(), 0)
    entropy = None
    if compute_entropy and entropy_requires_grad:
        entropy = torch.where(plan.valid, z.log() - total[2] / z, 0)
    elif compute_entropy:
        z, h_num = z.detach(), total[2].detach()
        entropy = torch.where(plan.valid, z.log() - h_num / z, 0)
    _check_finite(values, plan, logp, entropy)
    return logp, entropy


def _check_finite(
    values: torch.Tensor, plan: RowPlan, logp: torch.Tensor, entropy: torch.Tensor | None
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
    local = values[first][plan.local[first]].detach().tolist()
    raise NonFiniteLogitError(
        f"{int(bad.sum())} scored row(s) have a non-finite score, first rows {rows} (row {first}: "
        f"logprob {float(logp[first])}, its candidate logits / temperature "
        f"{float(plan.temperature[first]):.4g} on this rank {local[:8]}): a NaN or inf logit is a "
        "fault of the model (look for NaN activations or weights), or the temperature scales a "
        f"logit past the range of {values.dtype}; such a row is never scored",
        tensor="logits",
        pos=first,
    )
