"""PolicyScorer under Ulysses SP 2 (2 ranks) or SP 2 x TP 2 (4 ranks, vocabulary-parallel LM head).

TensorMicroBatches come from the planner, split for CP/SP 2. For a dense Qwen3 and a Qwen3-MoE with
replayed routing, contiguous and zigzag layouts, every rank's canonical-coordinate logprobs,
entropies and valid mask equal the single-rank scorer's on the whole row, and the parameter
gradients summed over the SP group equal the single-rank gradients (the LM-head shard: its rows of
the single-rank gradient). Float64, tolerance 1e-10 absolute. The single-rank result is itself
checked against the independent per-sample reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollfeed.collate import prepare_batch, to_tensor_micro_batch
from rollfeed.models.policy import PolicyScorer
from rollfeed.models.ulysses import SequenceParallel
from tests.dist.launch import exit_rank
from tests.dist.policy_cases import loss_weights, make_samples, own_routing, reference
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


def run(build, layout: str, sp: SequenceParallel, routed: bool, tp=None) -> None:
    name = f"{build.__name__}/{layout}/tp={'none' if tp is None else tp[1]}"
    samples = make_samples(5, LENGTHS)
    if routed:
        sdpa = build(seed=21)
        sdpa.set_attn_implementation("sdpa")
        routing = own_routing(sdpa, [s.token_ids for s in samples])
        samples = make_samples(5, LENGTHS, own_routing=routing)
    plan = prepare_batch(samples, seq_len=48, dp_size=1, cp_size=sp.size, cp_layout=layout)
    (mb,) = plan[0]
    w = loss_weights(mb.length, seed=3)

    single = PolicyScorer(build(seed=21), compute_entropy=True, entropy_requires_grad=True)
    whole = to_tensor_micro_batch(mb)  # cp_size 1: the whole row
    one = single.score(whole)
    ((one.logprobs * w[0]).sum() + (one.entropy * w[1]).sum()).backward()

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
        model, sp=sp, compute_entropy=True, entropy_requires_grad=True, **tp_options
    )
    tmb = to_tensor_micro_batch(mb, cp_rank=sp.rank, cp_size=sp.size, cp_layout=layout)
    out = scorer.score(tmb)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
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
            dist.all_reduce(p.grad, group=sp.group)
            want = q.grad
            if pname == "lm_head.weight" and tp is not None:
                start = tp_options["vocab_start"]
                want = q.grad[start : start + p.shape[0]]
            worst = max(worst, (p.grad - want).abs().max().item())
    assert worst < TOL, (name, worst)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2:
        sp = SequenceParallel(group=dist.group.WORLD, rank=rank, size=2)
        for layout in ("contiguous", "zigzag"):
            run(tiny_qwen3, layout, sp, routed=False)
            run(tiny_qwen3_moe, layout, sp, routed=True)
    else:
        assert world == 4
        # rank = 2 * tp_rank + sp_rank; every rank creates every group, in the same order.
        sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        tp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tp_rank, sp_rank = divmod(rank, 2)
        sp = SequenceParallel(group=sp_groups[tp_rank], rank=sp_rank, size=2)
        tp = (tp_groups[sp_rank], tp_rank, 2)
        run(tiny_qwen3, "contiguous", sp, routed=False, tp=tp)
        run(tiny_qwen3_moe, "zigzag", sp, routed=True, tp=tp)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()
