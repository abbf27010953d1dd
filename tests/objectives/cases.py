"""A tiny-vocabulary batch of kept sets covering every slot and row rule, for the objectives."""

from __future__ import annotations

import math

import torch

from rollfeed.collate import RaggedRows
from rollfeed.models import support_logprobs
from rollfeed.objectives import support_distribution

V = 7
NEG = float("-inf")
# (ids, label, loss, fallback, sampler edits {slot: value}, has mask logprobs)
ROWS = [
    ([3, 1, 5], 3, True, False, {}, True),
    ([2], 2, True, False, {}, True),  # singleton
    ([4, 0, 6, 2], 4, True, False, {2: NEG}, True),
    ([1, 3, 3], 1, True, False, {}, True),  # a repeated id: its second slot does not count
    ([5, 2], 5, True, False, {1: -9999.0}, True),  # vLLM's JSON clamp
    ([0, 4, 1], 0, True, False, {2: -12345.0}, True),  # below the clamp
    ([6, 3], 6, True, False, {}, False),  # no mask logprobs
    ([2, 5], 2, True, True, {}, True),  # fallback row
    ([], 3, True, True, {}, False),  # no kept set, scored over the full vocabulary
    ([1, 4], 6, True, False, {}, True),  # the label is missing from its kept set
    ([3, 0, 2], 3, False, False, {}, True),  # no loss
    ([5, 6, 0, 1, 2], 5, True, False, {0: NEG}, True),  # the label's own slot is invalid
    ([0, 2, 4], 0, True, False, {}, True),
    ([6, 1, 4], 6, True, False, {}, True),
]
CU_SEQLENS = [0, 5, 10, 14]
INVALID_SLOTS = [(2, 2), (3, 2), (4, 1), (5, 2), (11, 0)]


def make_case(seed: int, rows: list | None = None) -> dict:
    """Logits ``[N, V]`` (float64 leaf), the rows as the reference reads them and as tensors."""
    rows = ROWS if rows is None else rows
    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    logits = (torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    ref_rows, mask_rows = [], []
    for n, (ids, label, loss, fallback, edits, has_mask) in enumerate(rows):
        distinct = list(dict.fromkeys(ids))
        # The sampler is the trainer with some noise: near the band of IcePop, some slots out.
        noise = torch.randn(len(distinct), generator=g, dtype=torch.float64) * 0.4
        q = torch.softmax(logits.detach()[n, distinct] + noise, 0)
        by_id = {v: math.log(float(x)) + math.log(0.9) for v, x in zip(distinct, q, strict=True)}
        sampler = [by_id[v] - (0.3 if k > 0 and v in ids[:k] else 0.0) for k, v in enumerate(ids)]
        for slot, value in edits.items():
            sampler[slot] = value
        ref_rows.append(
            dict(
                ids=ids,
                sampler=sampler if has_mask else None,
                label=label,
                loss=loss,
                fallback=fallback,
                adv=float(torch.randn(1, generator=g, dtype=torch.float64)),
                inference=-float(torch.rand(1, generator=g, dtype=torch.float64)) - 0.1,
            )
        )
        mask_rows.append(sampler if has_mask else [])
    lengths = torch.tensor([len(r[0]) for r in rows])
    support = RaggedRows.from_lengths(
        lengths, torch.tensor([v for r in rows for v in r[0]], dtype=torch.int64)
    )
    mask = RaggedRows.from_lengths(
        torch.tensor([len(m) for m in mask_rows]),
        torch.tensor([x for m in mask_rows for x in m], dtype=torch.float64),
    )
    return dict(
        logits=logits,
        rows=ref_rows,
        support=support,
        mask=mask,
        labels=torch.tensor([r[1] for r in rows]),
        loss_mask=torch.tensor([r[2] for r in rows]),
        fallback=torch.tensor([r[3] for r in rows]),
        advantages=torch.tensor([r["adv"] for r in ref_rows], dtype=torch.float64),
        inference=torch.tensor([r["inference"] for r in ref_rows], dtype=torch.float64),
    )


def scored(case: dict, logits: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    """The scorer's label logprobs and kept logprobs, and the kept-set distributions."""
    out = support_logprobs(
        case["logits"] if logits is None else logits,
        case["labels"],
        case["support"],
        return_support_logprobs=True,
        fallback_mask=case["fallback"],
        missing_label="full_vocab",
    )
    kept = support_distribution(
        case["support"],
        out.support_logprobs,
        case["mask"],
        labels=case["labels"],
        loss_mask=case["loss_mask"],
        inference_logprobs=case["inference"],
    )
    return out, kept


def samples_of(n: int) -> list[int]:
    return [next(i for i in range(3) if CU_SEQLENS[i] <= r < CU_SEQLENS[i + 1]) for r in range(n)]
