"""Batches of kept-set rows built from the label's trainer and sampler logprobs, for the
objectives' numerics tests and the ``objectives`` adversarial family.

A row is a :class:`Row`: its kept set is ``width`` ids ``0 .. width − 1`` with the label (id 0)
first; the trainer's logits put ``log p^S(a) = lp`` on the label and share the rest evenly, the
sampler's mask logprobs put ``lq`` on the label and share the rest (a floor keeps every logprob a
number: ``-1e5`` for the trainer, ``-9000`` for the sampler). ``lq_label`` overrides the label's
mask logprob alone (``-9999``, ``-inf``, NaN), ``mask=False`` writes no mask logprobs, ``width=0``
no kept set (the trainer's logprob is then a leaf of its own, as a fallback row's).

Example: ``Row(lp=-0.5, lq=-0.8)`` -> trainer ``log p^S = [-0.5, log((1 − e^-0.5)/2) x 2]``,
sampler ``[-0.8, log((1 − e^-0.8)/2) x 2]``, ``log r = 0.3``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rollfeed.collate import RaggedRows
from rollfeed.objectives import SupportDistribution, support_distribution


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    lp: float = -0.5
    lq: float = -0.5
    adv: float = 1.0
    loss: bool = True
    width: int = 3
    mask: bool = True
    lq_label: float | None = None
    inference: float | None = None  # default: lq


def _share(label: float, others: int, floor: float) -> float:
    rest = -math.expm1(label) if label > -math.inf else 1.0
    return max(math.log(rest / others), floor) if rest > 0 else floor


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """Leaves ``z [nnz]`` (kept logits) and ``extra [N]`` (rows without a kept set), the rows
    and the tensors of the inputs, in ``dtype``."""

    rows: tuple[Row, ...]
    z: torch.Tensor
    extra: torch.Tensor
    support: RaggedRows
    mask: RaggedRows
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    inference: torch.Tensor

    def support_logprobs(self) -> RaggedRows:
        """``log p^S`` of every slot (a log-softmax of ``z`` per row), with gradient."""
        row = self.support.row_index()
        n = self.support.n_rows
        top = torch.full((n,), -math.inf, dtype=self.z.dtype).scatter_reduce(
            0, row, self.z.detach(), "amax"
        )
        top = torch.where(torch.isfinite(top), top, 0.0)
        total = torch.zeros(n, dtype=self.z.dtype).index_add(0, row, torch.exp(self.z - top[row]))
        return self.support.with_values(self.z - (top + torch.log(total))[row])

    def logprobs(self, kept: RaggedRows) -> torch.Tensor:
        """``[N]`` the label's trainer logprob: its slot 0, or the row's own leaf."""
        has = self.support.lengths() > 0
        first = kept.values[self.support.offsets[:-1].clamp(max=max(kept.nnz - 1, 0))]
        return torch.where(has, first, self.extra) if kept.nnz else self.extra


def batch(rows: list[Row], dtype: torch.dtype = torch.float64) -> Batch:
    z, lq, lengths, mask_lengths, extra = [], [], [], [], []
    for r in rows:
        lengths.append(r.width)
        extra.append(r.lp)
        if r.width:
            z += [r.lp] + [_share(r.lp, r.width - 1, -1e5)] * (r.width - 1)
        if r.mask and r.width:
            label = r.lq if r.lq_label is None else r.lq_label
            lq += [label] + [_share(r.lq, r.width - 1, -9000.0)] * (r.width - 1)
            mask_lengths.append(r.width)
        else:
            mask_lengths.append(0)
    lengths_t = torch.tensor(lengths)
    ids = torch.cat([torch.arange(w) for w in lengths]) if sum(lengths) else torch.zeros(0)
    return Batch(
        rows=tuple(rows),
        z=torch.tensor(z, dtype=dtype).requires_grad_(),
        extra=torch.tensor(extra, dtype=dtype).requires_grad_(),
        support=RaggedRows.from_lengths(lengths_t, ids.long()),
        mask=RaggedRows.from_lengths(torch.tensor(mask_lengths), torch.tensor(lq, dtype=dtype)),
        labels=torch.zeros(len(rows), dtype=torch.int64),
        loss_mask=torch.tensor([r.loss for r in rows]),
        advantages=torch.tensor([r.adv for r in rows], dtype=dtype),
        inference=torch.tensor(
            [r.lq if r.inference is None else r.inference for r in rows], dtype=dtype
        ),
    )


def kept_of(b: Batch, loss_mask: torch.Tensor | None = None, **options) -> tuple:  # type: ignore[no-untyped-def]
    """``(support_logprobs, SupportDistribution, label logprobs)`` of the batch."""
    kept_lp = b.support_logprobs()
    kept: SupportDistribution = support_distribution(
        b.support,
        kept_lp,
        b.mask,
        labels=b.labels,
        loss_mask=b.loss_mask if loss_mask is None else loss_mask,
        inference_logprobs=b.inference,
        **options,
    )
    return kept_lp, kept, b.logprobs(kept_lp)
