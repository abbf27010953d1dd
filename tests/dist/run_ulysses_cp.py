"""Ulysses over a real cp group: a tiny Qwen3 over one packed row, split contiguously and zigzag.

Each rank compares its cp run with the whole-row run on one rank (cp 1): per-token logprobs and
entropies (full vocabulary) in canonical coordinates and, after summing parameter gradients over the
cp group, every parameter gradient. Float64; tolerance 1e-10 absolute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollfeed.models import CPGroup
from rollfeed.models.packing_attention import packed_layout
from rollfeed.models.ulysses import gather_sequence, heads_to_seq, seq_to_heads
from tests.dist.launch import run_rank
from tests.models.tiny import tiny_qwen3

TOL = 1e-10
LENGTHS = [5, 4, 3]  # the first boundary (5) falls inside rank 0's contiguous shard of 6
S = sum(LENGTHS)


def row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (S,), generator=gen)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    weights = torch.randn(2, S, generator=gen, dtype=torch.float64)
    return ids, pos, cu, weights


def token_scores(model, ids, pos, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logprob of the next id, entropy) for local rows; labels are the next local id."""
    logits = model(input_ids=ids[None], position_ids=pos[None], packing=layout).logits[0]
    logp = torch.log_softmax(logits, -1)
    return logp, -(logp.exp() * logp).sum(-1)


def loss_of(logp_full: torch.Tensor, ent: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    labels = torch.roll(ids, -1)
    lp = logp_full.gather(1, labels[:, None])[:, 0]
    return lp, (lp * w[0]).sum() + (ent * w[1]).sum()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_all_to_all(cp: CPGroup) -> None:
    """[S/cp, H, d] <-> [S, H/cp, d] against slicing a tensor every rank knows, values and grads."""
    full = torch.arange(6 * 4 * 3, dtype=torch.float64).reshape(6, 4, 3)
    rows, heads = 6 // cp.size, 4 // cp.size
    local = full[cp.rank * rows : (cp.rank + 1) * rows].clone().requires_grad_(True)
    by_heads = seq_to_heads(local, cp, seq_dim=0, head_dim=1)
    assert torch.equal(by_heads, full[:, cp.rank * heads : (cp.rank + 1) * heads])
    back = heads_to_seq(by_heads, cp, seq_dim=0, head_dim=1)
    assert torch.equal(back, local)
    # d/dlocal of sum(by_heads * g) with g = the same slice of a known tensor: its own rows of G,
    # gathered from every rank's head slice.
    g_full = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (by_heads * g_full[:, cp.rank * heads : (cp.rank + 1) * heads]).sum().backward()
    assert torch.equal(local.grad, g_full[cp.rank * rows : (cp.rank + 1) * rows])


def check_layout(name: str, local_index: torch.Tensor, cp: CPGroup, use_cu: bool, **config) -> None:
    ids, pos, cu, w = row()
    ref_model = tiny_qwen3(seed=1, **config)
    logp, ent = token_scores(ref_model, ids, pos, packed_layout(pos))
    ref_lp, ref_loss = loss_of(logp, ent, ids, w)
    ref_loss.backward()
    ref_grads = grads(ref_model)

    model = tiny_qwen3(seed=1, **config)
    layout = packed_layout(
        pos[local_index], cp=cp, canonical_index=local_index, cu_seqlens=cu if use_cu else None
    )
    logp_l, ent_l = token_scores(model, ids[local_index], pos[local_index], layout)
    logp_full = gather_sequence(logp_l, cp, canonical_index=local_index)
    ent_full = gather_sequence(ent_l, cp, canonical_index=local_index)
    lp, loss = loss_of(logp_full, ent_full, ids, w)
    loss.backward()
    cp_grads = grads(model)
    for g in cp_grads.values():
        dist.all_reduce(g, group=cp.group)
    assert torch.allclose(lp, ref_lp, atol=TOL, rtol=0), (name, (lp - ref_lp).abs().max())
    assert torch.allclose(ent_full, ent, atol=TOL, rtol=0), name
    assert cp_grads.keys() == ref_grads.keys(), name
    worst = max((cp_grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    assert worst < TOL, (name, worst)
    # The comparison is not vacuous: the cp loss has gradients everywhere the reference has.
    assert all(ref_grads[k].abs().sum() > 0 for k in ref_grads), name


def main() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    cp = CPGroup(group=dist.group.WORLD, rank=rank, size=size)
    half = S // size
    contiguous = torch.arange(rank * half, (rank + 1) * half)
    check_all_to_all(cp)
    check_layout("contiguous", contiguous, cp, use_cu=False)
    # One KV head for two ranks: replicated to the query heads before the all-to-all.
    check_layout("contiguous/1-kv-head", contiguous, cp, use_cu=False, num_key_value_heads=1)
    check_layout("contiguous+cu", contiguous, cp, use_cu=True)
    quarter = S // (2 * size)
    chunks = torch.arange(S).reshape(2 * size, quarter)
    zigzag = torch.cat([chunks[rank], chunks[2 * size - 1 - rank]])
    check_layout("zigzag", zigzag, cp, use_cu=True)


if __name__ == "__main__":
    run_rank(main)
