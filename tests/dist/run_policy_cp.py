"""PolicyScorer over a cp group of 2 (2 ranks) or cp 2 x tp 2 (4 ranks, vocabulary-parallel head).

TensorMicroBatches come from the planner, split for cp 2. For a dense Qwen3 and a Qwen3-MoE with
replayed routing, contiguous and zigzag layouts, every rank's canonical-coordinate logprobs,
entropies and valid mask equal the single-rank scorer's on the whole row, and the parameter
gradients summed over the cp group equal the single-rank gradients (the LM-head shard: its rows of
the single-rank gradient). Float64, tolerance 1e-10 absolute. The single-rank result is itself
checked against the independent per-sample reference. The support is given ragged, and each
rank's kept logprobs (its own rows, not gathered) equal the single-rank ones of the same rows; a
loss term over them, each rank its own rows, has cp-summed gradients equal to the single-rank
gradient. On 4 ranks the groups are built from the loader's ``Topology`` (rank order dp, cp, tp),
a cp group or micro batch that disagrees with it is refused with a typed error, and each TP pair
checks vocabulary-parallel ragged scoring (``tests/dist/ragged_tp_cases.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from rollfeed.collate import (
    MicroBatch,
    PlanConfig,
    RaggedRows,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.loaders import Topology
from rollfeed.models import CPGroup, CPGroupError, CPMismatchError, PolicyScorer
from tests.dist.launch import run_rank
from tests.dist.policy_cases import loss_weights, make_samples, own_routing, reference
from tests.dist.ragged_tp_cases import check_ragged_tp
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe

TOL = 1e-10
LENGTHS = [7, 10, 3, 9]


def shard_lm_head(model, tp_rank: int, tp_size: int) -> int:
    """Keep this TP rank's rows of the LM head; returns vocab_start."""
    full = model.lm_head.weight
    rows = full.shape[0] // tp_size
    head = torch.nn.Linear(full.shape[1], rows, bias=False, dtype=full.dtype)
    with torch.no_grad():
        head.weight.copy_(full[tp_rank * rows : (tp_rank + 1) * rows])
    model.lm_head = head
    return tp_rank * rows


def whole_row(mb: MicroBatch):
    """The same row read whole, as one rank does with no cp group (the single-rank reference)."""
    one = dataclasses.replace(mb.config, cp_size=1, cp_layout="contiguous")
    return to_tensor_micro_batch(dataclasses.replace(mb, config=one), cp_rank=0)


def kept_term(kept: RaggedRows, weights: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(kept.values), kept.values * weights, 0).sum()


def run(build, layout: str, cp: CPGroup, routed: bool, tp=None) -> None:
    name = f"{build.__name__}/{layout}/tp={'none' if tp is None else tp[1]}"
    samples = make_samples(5, LENGTHS)
    if routed:
        sdpa = build(seed=21)
        sdpa.set_attn_implementation("sdpa")
        routing = own_routing(sdpa, [s.token_ids for s in samples])
        samples = make_samples(5, LENGTHS, own_routing=routing)
    plan = prepare_batch(
        samples, PlanConfig(seq_len=48, cp_size=cp.size, cp_layout=layout), dp_size=1
    )
    (mb,) = plan[0]
    w = loss_weights(mb.length, seed=3)

    single = PolicyScorer(build(seed=21), compute_entropy=True, entropy_requires_grad=True)
    whole = whole_row(mb)
    one = single.score(whole, return_support_logprobs=True)
    whole_support = whole.fields["sampling_mask"]
    kw = torch.randn(whole_support.nnz, generator=torch.Generator().manual_seed(4)).double()
    loss = (one.logprobs * w[0]).sum() + (one.entropy * w[1]).sum()
    (loss + kept_term(one.support_logprobs, kw)).backward()

    ref_model = build(seed=21)
    ref_model.set_attn_implementation("sdpa")
    ref_lp, ref_ent, ref_valid = reference(ref_model, mb)
    assert torch.equal(one.valid_mask, ref_valid), name
    assert torch.allclose(one.logprobs, ref_lp, atol=TOL, rtol=0), name
    assert torch.allclose(one.entropy, ref_ent, atol=TOL, rtol=0), name

    model = build(seed=21)
    tp_options = {}
    if tp is not None:
        tp_group, tp_rank, tp_size = tp
        tp_options = {"tp_group": tp_group, "vocab_start": shard_lm_head(model, tp_rank, tp_size)}
    scorer = PolicyScorer(
        model, cp=cp, compute_entropy=True, entropy_requires_grad=True, **tp_options
    )
    tmb = to_tensor_micro_batch(mb, cp_rank=cp.rank)
    out = scorer.score(tmb, return_support_logprobs=True)
    # This rank's rows: its window of the whole row, slot for slot.
    own = whole_support.take(tmb.positions)
    assert own.equal(tmb.fields["sampling_mask"]), name
    own_kw = RaggedRows(whole_support.offsets, kw).take(tmb.positions).values
    loss = (out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()
    (loss + kept_term(out.support_logprobs, own_kw)).backward()
    assert torch.equal(out.support_logprobs.offsets, own.offsets), name
    want_kept = RaggedRows(whole_support.offsets, one.support_logprobs.values.detach())
    torch.testing.assert_close(
        out.support_logprobs.values.detach(), want_kept.take(tmb.positions).values, atol=TOL, rtol=0
    )
    assert int(torch.isfinite(out.support_logprobs.values).sum()) > 5, name
    assert torch.equal(out.valid_mask, one.valid_mask), name
    assert torch.allclose(out.logprobs, one.logprobs, atol=TOL, rtol=0), name
    assert torch.allclose(out.entropy, one.entropy, atol=TOL, rtol=0), name
    if routed:
        assert out.metrics["rows_replayed"] > 0, name
    worst = 0.0
    single_params = dict(single.model.named_parameters())
    for pname, p in scorer.model.named_parameters():
        q = single_params[pname]
        assert (p.grad is None) == (q.grad is None), (name, pname)
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp.group)
            want = q.grad
            if pname == "lm_head.weight" and tp is not None:
                start = tp_options["vocab_start"]
                want = q.grad[start : start + p.shape[0]]
            worst = max(worst, (p.grad - want).abs().max().item())
    assert worst < TOL, (name, worst)


def check_refusals(topo: Topology, cp: CPGroup, cp_group) -> None:
    """A cp group that is not the topology's, and micro batches split for another cp size."""
    with pytest.raises(CPGroupError, match=f"rank {1 - topo.cp_rank} of 2 disagrees"):
        CPGroup(group=cp_group, rank=1 - topo.cp_rank, size=2)
    with pytest.raises(CPGroupError, match="of 4 disagrees"):
        CPGroup(group=cp_group, rank=topo.cp_rank, size=4)
    samples = make_samples(5, LENGTHS)
    (mb4,) = prepare_batch(samples, PlanConfig(seq_len=48, cp_size=4), dp_size=1)[0]
    scorer = PolicyScorer(tiny_qwen3(seed=21), cp=cp)
    with pytest.raises(CPMismatchError, match=f"of 4 .* cp rank {cp.rank} of 2"):
        scorer.score(to_tensor_micro_batch(mb4, cp_rank=cp.rank))
    # A micro batch split for cp 2 handed to a scorer over the whole world (a cp group of 4).
    world = CPGroup(group=dist.group.WORLD, rank=dist.get_rank(), size=4)
    (mb2,) = prepare_batch(samples, PlanConfig(seq_len=48, cp_size=2), dp_size=1)[0]
    with pytest.raises(CPMismatchError, match=f"of 2 .* cp rank {world.rank} of 4"):
        PolicyScorer(tiny_qwen3(seed=21), cp=world).score(
            to_tensor_micro_batch(mb2, cp_rank=topo.cp_rank)
        )


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2:
        cp = CPGroup(group=dist.group.WORLD, rank=rank, size=2)
        for layout in ("contiguous", "zigzag"):
            run(tiny_qwen3, layout, cp, routed=False)
            run(tiny_qwen3_moe, layout, cp, routed=True)
        return
    assert world == 4
    # The loader's rank order (dp, cp, tp; tp innermost): rank = cp_rank * 2 + tp_rank. Every
    # rank creates every group, in the same order.
    topo = Topology.from_rank(rank, world, cp_size=2, tp_size=2)
    cp_groups = [dist.new_group([t, 2 + t]) for t in range(2)]  # one per tp coordinate
    tp_groups = [dist.new_group([2 * c, 2 * c + 1]) for c in range(2)]  # one per cp coordinate
    cp = CPGroup.from_topology(topo, group=cp_groups[topo.tp_rank])
    tp = (tp_groups[topo.cp_rank], topo.tp_rank, topo.tp_size)
    check_refusals(topo, cp, cp_groups[topo.tp_rank])
    check_ragged_tp(tp_groups[topo.cp_rank], topo.tp_rank)
    run(tiny_qwen3, "contiguous", cp, routed=False, tp=tp)
    run(tiny_qwen3_moe, "zigzag", cp, routed=True, tp=tp)


if __name__ == "__main__":
    run_rank(main)
