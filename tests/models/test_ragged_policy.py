"""PolicyScorer over a ragged ``sampling_mask``: scores, per-kept-id logprobs and their gradients
equal the padded math over each sample's stock forward, and no tensor is as wide as the widest
row."""

from __future__ import annotations

import dataclasses

import torch

from rollfeed.collate import PlanConfig, RaggedRows, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer
from tests.dist.policy_cases import make_samples, stock_forward
from tests.dist.shape_record import ShapeRecord
from tests.models.reference import padded_reference
from tests.models.tiny import VOCAB, tiny_qwen3

TOL = 1e-10  # float64 end to end; packed vs per-sample runs differ only in summation order
LENGTHS = [9, 4, 12, 6]
WIDE = 100  # one row keeps 100 ids, no other dim of the tiny model or the row


def _micro_batch():
    samples = make_samples(0, LENGTHS)
    plan = prepare_batch(samples, PlanConfig(seq_len=40, pad_to_multiple_of=8), dp_size=1)
    (mb,) = plan[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    rows = tmb.fields["sampling_mask"]
    # Widen one scored row to WIDE distinct ids, its label first.
    lengths, parts = rows.lengths().clone(), []
    wide = int(((rows.lengths() > 0) & (tmb.labels >= 0)).nonzero()[3, 0])
    for n in range(rows.n_rows):
        part = rows.values[rows.offsets[n] : rows.offsets[n + 1]]
        if n == wide:
            others = torch.tensor([v for v in range(VOCAB) if v != int(tmb.labels[n])][: WIDE - 1])
            part = torch.cat([tmb.labels[n : n + 1], others]).to(part.dtype)
            lengths[n] = WIDE
        parts.append(part)
    ragged = RaggedRows.from_lengths(lengths, torch.cat(parts))
    return mb, dataclasses.replace(tmb, fields={**tmb.fields, "sampling_mask": ragged})


def _row_logits(model, mb, length: int) -> torch.Tensor:
    """Each sample alone through the stock forward, laid out in row coordinates ``[S, V]``."""
    out = torch.zeros(length, VOCAB, dtype=torch.float64)
    for sample, start in zip(mb.samples, mb.starts, strict=True):
        logits = stock_forward(model, torch.as_tensor(sample.token_ids))
        out = out.index_put((torch.arange(start, start + logits.shape[0]),), logits)
    return out


def _weights(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    up = torch.randn(rows, generator=g, dtype=torch.float64)
    return up, torch.randn(rows, width, generator=g, dtype=torch.float64)


def _loss(logp: torch.Tensor, kept: torch.Tensor, up: torch.Tensor, kw: torch.Tensor):  # type: ignore[no-untyped-def]
    """``kept`` and ``kw`` alike: ragged values ``[nnz]`` or padded ``[S, W]``."""
    return (logp * up).sum() + torch.where(torch.isfinite(kept), kept * kw, 0).sum()


def test_ragged_mask_kept_logprobs_match_padded_math_with_gradients() -> None:
    mb, tmb = _micro_batch()
    support = tmb.fields["sampling_mask"]
    width = support.width()
    assert width == WIDE
    up, kw = _weights(mb.length, width)
    kw_ragged = RaggedRows.from_padded(kw, like=support).values
    scorer = PolicyScorer(tiny_qwen3(seed=11))
    with ShapeRecord() as rec:
        out = scorer.score(tmb, return_support_logprobs=True)
        kept = out.support_logprobs
        assert kept is not None and torch.equal(kept.offsets, support.offsets)
        _loss(out.logprobs, kept.values, up, kw_ragged).backward()
    assert rec.matching(vocab={WIDE, WIDE + 1}, rows={mb.length}) == []
    padded_kept = kept.padded(width=width, fill=float("-inf"))

    ref_model = tiny_qwen3(seed=11)
    ref_model.set_attn_implementation("sdpa")
    logits = _row_logits(ref_model, mb, mb.length)
    labels = torch.where(tmb.labels < 0, 0, tmb.labels)
    lp, _, ref_kept, valid = padded_reference(
        logits, labels, support.padded(fill=-1), temperature=tmb.temperatures.double()
    )
    assert torch.equal(out.valid_mask, valid)
    torch.testing.assert_close(out.logprobs, lp, atol=TOL, rtol=0)
    torch.testing.assert_close(padded_kept, ref_kept, atol=TOL, rtol=0)
    assert int(torch.isfinite(padded_kept).sum()) > WIDE + 20  # the wide row and others
    _loss(lp, ref_kept, up, kw).backward()
    want = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in scorer.model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=0, msg=name)

    # The padded field scores the same; without the keyword no kept logprobs are made.
    padded_mb = dataclasses.replace(
        tmb, fields={**tmb.fields, "sampling_mask": support.padded(fill=-1)}
    )
    with torch.no_grad():
        again = scorer.score(padded_mb)
    assert again.support_logprobs is None
    torch.testing.assert_close(again.logprobs, out.logprobs, atol=1e-13, rtol=0)
