"""Per-rank checks of vocab-parallel support scoring (run under torchrun, gloo).

Every rank builds the same float64 batch, takes its (uneven) vocabulary shard, scores it with the
TP group and compares with the unsharded TP=1 result: values, the gradient of its logits / weight
shard, and the hidden-state gradient. ``torch.distributed.all_reduce`` is wrapped to count the
collectives of each forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollfeed.models import VocabularyRangeError, fused_support_logprobs, support_logprobs
from tests.dist.launch import run_rank
from tests.models.reference import random_batch

N, V, H, W = 47, 123, 16, 5
CALLS: list[tuple[str, tuple[int, ...]]] = []
_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # type: ignore[no-untyped-def]
    CALLS.append((str(op).rsplit(".", 1)[-1], tuple(tensor.shape)))
    return _all_reduce(tensor, op=op, group=group, async_op=async_op)


def _counted(fn):  # type: ignore[no-untyped-def]
    CALLS.clear()
    out = fn()
    return out, list(CALLS)


def _shard(rank: int, size: int) -> tuple[int, int]:
    """Uneven split of V: the first ``V % size`` ranks hold one extra id."""
    base, extra = divmod(V, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def main() -> None:
    dist.all_reduce = _counting_all_reduce  # type: ignore[assignment]
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    v0, v1 = _shard(rank, size)
    b = random_batch(N, V, seed=11, width=W, hidden=H)
    b["logits"] = b["hidden"] @ b["weight"].T
    # Rows whose members all sit on rank 0's shard, so every other rank holds no member of them.
    b["support"][1:4] = torch.tensor([[0, 1, 2, -1, -1], [3, -1, -1, -1, -1], [5, 2, 2, 4, -1]])
    b["labels"][1:4] = torch.tensor([1, 3, 4])
    fallback = torch.zeros(N, dtype=torch.bool)
    fallback[[0, 10, 17]] = True
    kw = {
        "temperature": torch.linspace(0.5, 1.5, N, dtype=torch.float64),
        "compute_entropy": True,
        "entropy_requires_grad": True,
        "fallback_mask": fallback,
        "missing_label": "full_vocab",
        "vocab_size": V,
    }
    up = torch.randn(2, N, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def loss(s):  # type: ignore[no-untyped-def]
        return (s.logprobs * up[0]).sum() + (s.entropy * up[1]).sum()

    # Plain path on logits.
    full = b["logits"].clone().requires_grad_()
    ref = support_logprobs(full, b["labels"], b["support"], **kw)
    (ref_grad,) = torch.autograd.grad(loss(ref), full)
    local = b["logits"][:, v0:v1].clone().requires_grad_()
    got, fwd = _counted(
        lambda: support_logprobs(
            local, b["labels"], b["support"], tp_group=group, vocab_start=v0, **kw
        )
    )
    assert fwd == [("MAX", (N,)), ("SUM", (3, N))], fwd
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-12, atol=1e-12)
    assert torch.equal(got.valid_mask, ref.valid_mask)
    (grad,), bwd = _counted(lambda: torch.autograd.grad(loss(got), local))
    assert bwd == [], bwd
    torch.testing.assert_close(grad, ref_grad[:, v0:v1], rtol=1e-10, atol=1e-12)

    no_entropy, fwd = _counted(
        lambda: support_logprobs(
            local,
            b["labels"],
            b["support"],
            tp_group=group,
            vocab_start=v0,
            missing_label="full_vocab",
        )
    )
    # Without vocab_size, the shards' widths are summed first to check ids against V.
    assert fwd == [("SUM", (1,)), ("MAX", (N,)), ("SUM", (2, N))], fwd
    assert no_entropy.entropy is None
    # An id >= V is owned by no shard: refused on every rank instead of scoring nothing.
    beyond = b["support"].clone()
    beyond[7, 0] = V
    try:
        support_logprobs(local, b["labels"], beyond, tp_group=group, vocab_start=v0, **kw)
    except VocabularyRangeError as err:
        assert f"support[7, 0] = {V}" in str(err), err
    else:
        raise AssertionError("an id outside the vocabulary was scored")

    # Fused path on hidden states and the weight shard.
    h_ref, w_ref = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    ref = fused_support_logprobs(h_ref, w_ref, b["labels"], b["support"], **kw)
    ref_gh, ref_gw = torch.autograd.grad(loss(ref), (h_ref, w_ref))
    for chunk_size in (4, 4096):
        h = b["hidden"].clone().requires_grad_()
        w = b["weight"][v0:v1].clone().requires_grad_()
        got, fwd = _counted(
            lambda h=h, w=w, c=chunk_size: fused_support_logprobs(
                h, w, b["labels"], b["support"], chunk_size=c, tp_group=group, vocab_start=v0, **kw
            )
        )
        assert fwd == [("MAX", (N,)), ("SUM", (3, N))], fwd
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-12, atol=1e-12)
        (gh, gw), bwd = _counted(lambda got=got, h=h, w=w: torch.autograd.grad(loss(got), (h, w)))
        assert bwd == [("SUM", (N, H))], bwd
        torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gw, ref_gw[v0:v1], rtol=1e-10, atol=1e-12)

    # A caller that reduces the hidden gradient itself: no collective in backward, partial grads.
    h = b["hidden"].clone().requires_grad_()
    w = b["weight"][v0:v1].clone().requires_grad_()
    got = fused_support_logprobs(
        h,
        w,
        b["labels"],
        b["support"],
        tp_group=group,
        vocab_start=v0,
        reduce_hidden_grad=False,
        **kw,
    )
    (gh,), bwd = _counted(lambda: torch.autograd.grad(loss(got), h))
    assert bwd == [], bwd
    _all_reduce(gh, group=group)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    print(f"rank {rank}/{size} shard [{v0}, {v1}) ok", flush=True)


if __name__ == "__main__":
    run_rank(main)
