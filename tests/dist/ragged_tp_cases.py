"""Vocabulary-parallel scoring of a ragged support on real ranks (called from a torchrun script).

Every rank of a TP group of 2 builds the same float64 batch (widths up to 2,000, repeats, fallback
rows), takes its uneven vocabulary shard and scores the ragged support: logprobs, entropy, kept
logprobs and the gradients of its logits / weight shard and of the hidden states equal the padded
math over the unsharded logits, with one MAX and one SUM all-reduce in forward (the kept ids'
logits ride in the SUM), and no tensor as wide as the widest row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollfeed.collate import RaggedRows
from rollfeed.models import fused_support_logprobs, support_logprobs
from tests.dist.shape_record import ShapeRecord
from tests.models.reference import padded_reference, ragged_batch

N, V, H, W = 40, 2203, 8, 2000
TOL = {"rtol": 1e-12, "atol": 1e-12}


class _Counting:
    """Wraps ``dist.all_reduce`` to record ``(op, shape)`` of each call while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self._inner = dist.all_reduce

    def __enter__(self) -> _Counting:
        inner = self._inner

        def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
            self.calls.append((str(op).rsplit(".", 1)[-1], tuple(tensor.shape)))
            return inner(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._inner  # type: ignore[assignment]


def _loss(logp, entropy, kept):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(9)
    up = torch.randn(2, N, generator=g, dtype=torch.float64)
    kw = torch.randn(kept.shape, generator=g, dtype=torch.float64)
    return (
        (logp * up[0]).sum()
        + (entropy * up[1]).sum()
        + torch.where(torch.isfinite(kept), kept * kw, 0).sum()
    )


def check_ragged_tp(group, tp_rank: int) -> None:  # type: ignore[no-untyped-def]
    base, extra = divmod(V, 2)
    v0 = tp_rank * base + min(tp_rank, extra)
    v1 = v0 + base + (tp_rank < extra)
    b = ragged_batch(N, V, seed=13, max_width=W, hidden=H)
    support, width = b["support"], b["padded"].shape[1]
    fallback = torch.zeros(N, dtype=torch.bool)
    fallback[[4, 10]] = True
    kw = {
        "temperature": torch.linspace(0.7, 1.3, N, dtype=torch.float64),
        "compute_entropy": True,
        "entropy_requires_grad": True,
        "return_support_logprobs": True,
        "fallback_mask": fallback,
        "missing_label": "full_vocab",
        "vocab_size": V,
        "tp_group": group,
        "vocab_start": v0,
    }
    h_ref, w_ref = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    lp, ent, kept, valid = padded_reference(
        h_ref @ w_ref.T,
        b["labels"],
        b["padded"],
        temperature=kw["temperature"],
        fallback_mask=fallback,
    )
    ref_gh, ref_gw = torch.autograd.grad(_loss(lp, ent, kept), (h_ref, w_ref))
    sum_shape = (3 * N + support.nnz,)

    def padded(s):  # type: ignore[no-untyped-def]
        return RaggedRows(support.offsets, s.support_logprobs.values).padded(
            width=width, fill=float("-inf")
        )

    # Plain path on this rank's logits shard.
    full = (b["hidden"] @ b["weight"].T).clone().requires_grad_()
    lp_f, ent_f, kept_f, _ = padded_reference(
        full, b["labels"], b["padded"], temperature=kw["temperature"], fallback_mask=fallback
    )
    (ref_logits_grad,) = torch.autograd.grad(_loss(lp_f, ent_f, kept_f), full)
    local = (b["hidden"] @ b["weight"][v0:v1].T).clone().requires_grad_()
    with _Counting() as fwd:
        got = support_logprobs(local, b["labels"], support, **kw)
    assert fwd.calls == [("MAX", (N,)), ("SUM", sum_shape)], fwd.calls
    assert torch.equal(got.valid_mask, valid)
    torch.testing.assert_close(got.logprobs, lp, **TOL)
    torch.testing.assert_close(got.entropy, ent, **TOL)
    torch.testing.assert_close(padded(got), kept, **TOL)
    with _Counting() as bwd:
        (grad,) = torch.autograd.grad(_loss(got.logprobs, got.entropy, padded(got)), local)
    assert bwd.calls == [], bwd.calls
    torch.testing.assert_close(grad, ref_logits_grad[:, v0:v1], **TOL)

    # Fused path on the weight shard.
    h = b["hidden"].clone().requires_grad_()
    w = b["weight"][v0:v1].clone().requires_grad_()
    with _Counting() as fwd:
        got = fused_support_logprobs(h, w, b["labels"], support, chunk_size=256, **kw)
    assert fwd.calls == [("MAX", (N,)), ("SUM", sum_shape)], fwd.calls
    torch.testing.assert_close(got.logprobs, lp, **TOL)
    torch.testing.assert_close(got.entropy, ent, **TOL)
    gh, gw = torch.autograd.grad(_loss(got.logprobs, got.entropy, padded(got)), (h, w))
    torch.testing.assert_close(gh, ref_gh, **TOL)
    torch.testing.assert_close(gw, ref_gw[v0:v1], **TOL)
    # Forward and backward of both scorers under the TP group, recorded: nothing [N, W]-wide.
    with ShapeRecord() as rec:
        for s in (
            support_logprobs(local, b["labels"], support, **kw),
            fused_support_logprobs(h, w, b["labels"], support, chunk_size=256, **kw),
        ):
            k = s.support_logprobs.values
            (
                s.logprobs.sum() + s.entropy.sum() + torch.where(torch.isfinite(k), k, 0).sum()
            ).backward()
    wide = rec.matching(vocab={width, width + 1}, rows={N})
    assert wide == [], wide
