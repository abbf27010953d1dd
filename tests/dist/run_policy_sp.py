"""PolicyScorer under Ulysses SP 2: TensorMicroBatches from the planner, split for CP/SP 2.

For a dense Qwen3 and a Qwen3-MoE with replayed routing, contiguous and zigzag layouts, every rank's
canonical-coordinate logprobs, entropies and valid mask equal the single-rank scorer's on the
whole row, and the parameter gradients summed over the SP group equal the single-rank gradients
(float64, tolerance 1e-10 absolute). The single-rank result is itself checked against the
independent per-sample reference.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from rollfeed.collate import prepare_batch, to_tensor_micro_batch
from rollfeed.models.policy import PolicyScorer
from rollfeed.models.ulysses import SequenceParallel
from tests.dist.policy_cases import loss_weights, make_samples, own_routing, reference
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe

TOL = 1e-10
LENGTHS = [7, 10, 3, 9]


def run(build, layout: str, sp: SequenceParallel, routed: bool) -> None:
    name = f"{build.__name__}/{layout}"
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

    scorer = PolicyScorer(build(seed=21), sp=sp, compute_entropy=True, entropy_requires_grad=True)
    tmb = to_tensor_micro_batch(mb, cp_rank=sp.rank, cp_size=sp.size, cp_layout=layout)
    out = scorer.score(tmb)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    assert torch.equal(out.valid_mask, one.valid_mask), name
    assert torch.allclose(out.logprobs, one.logprobs, atol=TOL, rtol=0), name
    assert torch.allclose(out.entropy, one.entropy, atol=TOL, rtol=0), name
    if routed:
        assert out.metrics["rows_replayed"] > 0, name
    worst = 0.0
    for (pname, p), q in zip(
        scorer.model.named_parameters(), single.model.parameters(), strict=True
    ):
        assert (p.grad is None) == (q.grad is None), (name, pname)
        if p.grad is not None:
            dist.all_reduce(p.grad, group=sp.group)
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    assert worst < TOL, (name, worst)


def main() -> None:
    dist.init_process_group("gloo")
    sp = SequenceParallel(group=dist.group.WORLD, rank=dist.get_rank(), size=dist.get_world_size())
    for layout in ("contiguous", "zigzag"):
        run(tiny_qwen3, layout, sp, routed=False)
        run(tiny_qwen3_moe, layout, sp, routed=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every check has passed here. Interpreter teardown after a backward that ran gloo collectives
    # sometimes aborts ("terminate called without an active exception"); skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
