"""The input checks of a support scorer: shapes and options at once, values on the device.

Shapes, dtypes and options raise :class:`SupportInputError` before anything is computed
(:func:`check_inputs`, :func:`support_rows`). The value checks (ids in the vocabulary, labels of
scored rows, labels in their support, temperatures) are computed on the device as masks
(:class:`RowChecks`) and read back in one host sync with what the caller must read anyway; the
first failure raises its typed error naming the row and slot.

A padded support ``[N, W]`` is taken as ``N`` rows of ``W`` slots each (its ``-1`` entries are
padding wherever they sit), so slot ``k`` of row ``n`` is column ``k`` and every message names
``support[n, k]`` the same way for both forms. Example: ``[[5, -1], [3, 4]]`` →
``RaggedRows(offsets=[0, 2, 4], values=[5, -1, 3, 4])``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rollfeed.collate import RaggedRows
from rollfeed.models.errors import (
    SupportInputError,
    SupportLabelError,
    TemperatureError,
    VocabularyRangeError,
)


def support_rows(support: torch.Tensor | RaggedRows, rows: int) -> RaggedRows:
    """The support as :class:`~rollfeed.collate.RaggedRows` of ``rows`` rows: given ragged, as is;
    a padded ``[rows, W]`` tensor as rows of ``W`` slots (a view, no copy)."""
    if isinstance(support, RaggedRows):
        if support.n_rows != rows or support.dtype not in (torch.int32, torch.int64):
            raise SupportInputError(
                f"support must be RaggedRows of N={rows} rows of int32/int64 ids, got "
                f"{support.n_rows} rows of {support.dtype}",
                tensor="support",
            )
        return support
    if not isinstance(support, torch.Tensor):
        raise SupportInputError(
            f"support must be RaggedRows or a padded [N, W] tensor, got {type(support).__name__}",
            tensor="support",
        )
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
    width = support.shape[1]
    offsets = torch.arange(rows + 1, dtype=torch.int64, device=support.device) * width
    return RaggedRows(offsets, support.reshape(-1))


def check_inputs(
    labels: torch.Tensor,
    rows: int,
    fallback_mask: torch.Tensor | None,
    missing_label: str,
    compute_entropy: bool,
    entropy_requires_grad: bool,
) -> None:
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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RowChecks:
    """The input checks of one call, computed on the device: ``bad_support [nnz]`` (per slot),
    ``bad_label``, ``bad_missing``, ``bad_temperature [N]`` (per row). Nothing is scored from a
    plan before :meth:`verify` read them."""

    labels: torch.Tensor
    support: RaggedRows
    slot_rows: torch.Tensor
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
            self._raise()
        return out[len(masks) :]

    def _raise(self) -> None:
        labels, t, vocab = self.labels, self.temperature, self.vocab_size
        if bool(self.bad_support.any()):
            j = int(self.bad_support.nonzero()[0, 0])
            n = int(self.slot_rows[j])
            k = j - int(self.support.offsets[n])
            raise VocabularyRangeError(
                f"support[{n}, {k}] = {int(self.support.values[j])} is not a token id of the "
                f"vocabulary [0, {vocab}); pad with -1 (the only padding id), and score with the "
                "model the ids were sampled from",
                tensor="support",
                pos=n,
            )
        if bool(self.bad_label.any()):
            n = int(self.bad_label.nonzero()[0, 0])
            raise VocabularyRangeError(
                f"labels[{n}] = {int(labels[n])} is outside the vocabulary [0, {vocab}) on a "
                "scored row; give the row an empty support (all -1) if it should not be scored",
                tensor="labels",
                pos=n,
            )
        if bool(self.bad_missing.any()):
            bad = self.bad_missing.nonzero().squeeze(1)[:8].tolist()
            raise SupportLabelError(
                f"{int(self.bad_missing.sum())} row(s) have a label outside their support, first "
                f"rows {bad} (labels {labels[bad].tolist()}); fix the capture, or pass "
                "missing_label='full_vocab' to score those rows over the full vocabulary",
                tensor="labels",
                pos=bad[0],
            )
        bad = self.bad_temperature.nonzero().squeeze(1)[:8].tolist()
        raise TemperatureError(
            f"{int(self.bad_temperature.sum())} scored row(s) have a temperature that is not "
            f"finite and >= {torch.finfo(t.dtype).tiny:.4g} (the smallest normal {t.dtype}: "
            f"below it 1 / temperature overflows), first rows {bad} (temperatures "
            f"{t[bad].tolist()}); record the sampler's temperature for every sampled token",
            tensor="temperature",
            pos=bad[0],
        )


def temperatures(
    temperature: float | torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[rows]`` temperatures in ``dtype`` from a scalar or ``[rows]``."""
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
