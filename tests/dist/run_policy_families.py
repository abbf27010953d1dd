"""PolicyScorer over a cp group of 2 on the MoE families with their attention features (2 ranks).

DeepSeek-V3 (MLA), gpt-oss (sliding window, sinks), GLM-4.5 and MiniMax-M2 (sigmoid routers),
with replayed routing, contiguous or zigzag layout: every rank's canonical-coordinate logprobs,
entropies and valid mask equal the single-rank scorer's on the whole row, and the parameter
gradients summed over the cp group equal the single-rank gradients. Float64, 1e-10 absolute,
except where DeepSeek-V3's and GLM-4.5's float32 routers compute the mixing weights (float32
agreement: ``tests.models.family_cases.tolerance``); DeepSeek-V3 with recorded weights shows MLA
under cp to 1e-10. The single-rank run itself equals each sample alone through the stock model
(tests/models/test_packing_families.py).

The hybrid families too (:mod:`tests.models.hybrid_cases`): Qwen3-Next and Qwen3.5-MoE (Gated
DeltaNet under cp: one key head per rank), Llama-4 (chunked attention, NoPE query scaling from
each rank's position ids), both layouts each, recorded router weights and float64 norms, to 1e-10
(the single-rank run equals each sample alone: tests/models/test_packing_hybrid.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rollfeed.collate import MicroBatch, PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import CPGroup, PolicyScorer
from tests.dist.launch import run_rank
from tests.dist.policy_cases import loss_weights
from tests.models.family_cases import SCORED, routed_samples, scoring_model, tolerance
from tests.models.hybrid_cases import HYBRIDS, float64_norms, hybrid_model, hybrid_samples
from tests.models.hybrid_cases import LENGTHS as HYBRID_LENGTHS

LENGTHS = [7, 10, 3, 9]


def whole_row(mb: MicroBatch):
    """The same row read whole, as one rank does with no cp group (the single-rank run)."""
    one = dataclasses.replace(mb.config, cp_size=1, cp_layout="contiguous")
    return to_tensor_micro_batch(dataclasses.replace(mb, config=one), cp_rank=0)


def run(family: str, layout: str, cp: CPGroup, *, recorded: bool = False) -> None:
    hybrid = family in HYBRIDS
    name = f"{family}/{layout}/recorded={recorded}"
    if hybrid:
        samples = hybrid_samples(family, 5, HYBRID_LENGTHS, weights=recorded)
        build = lambda: float64_norms(hybrid_model(family, 21))  # noqa: E731
        lengths, seq_len = HYBRID_LENGTHS, 112
    else:
        samples = routed_samples(family, 5, LENGTHS, weights=recorded)
        build = lambda: scoring_model(family, 21)  # noqa: E731
        lengths, seq_len = LENGTHS, 48
    config = PlanConfig(seq_len=seq_len, cp_size=cp.size, cp_layout=layout)
    (mb,) = prepare_batch(samples, config, dp_size=1)[0]
    w = loss_weights(mb.length, seed=3)
    options = dict(compute_entropy=True, entropy_requires_grad=True, replay_weights=recorded)
    single = PolicyScorer(build(), **options)
    one = single.score(whole_row(mb))
    ((one.logprobs * w[0]).sum() + (one.entropy * w[1]).sum()).backward()

    scorer = PolicyScorer(build(), cp=cp, **options)
    out = scorer.score(to_tensor_micro_batch(mb, cp_rank=cp.rank))
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    tol = tolerance(family, recorded_weights=recorded or hybrid)
    assert torch.equal(out.valid_mask, one.valid_mask), name
    assert torch.allclose(out.logprobs, one.logprobs, **tol), name
    assert torch.allclose(out.entropy, one.entropy, **tol), name
    replayed = out.metrics["rows_replayed"].clone()
    dist.all_reduce(replayed, group=cp.group)
    assert int(replayed) == sum(lengths) - len(lengths), (name, int(replayed))
    single_params = dict(single.model.named_parameters())
    for pname, p in scorer.model.named_parameters():
        q = single_params[pname]
        assert (p.grad is None) == (q.grad is None), (name, pname)
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, group=cp.group)
        tol = tolerance(family, pname, recorded_weights=recorded or hybrid)
        assert torch.allclose(p.grad, q.grad, **tol), (name, pname)


def main() -> None:
    assert dist.get_world_size() == 2
    cp = CPGroup(group=dist.group.WORLD, rank=dist.get_rank(), size=2)
    # Each layout twice (the layouts only change which tokens a rank holds: tested per family
    # in tests/dist/run_policy_cp.py), gpt-oss's sinks and windows under zigzag.
    for family, layout in zip(
        SCORED, ("contiguous", "zigzag", "zigzag", "contiguous"), strict=True
    ):
        run(family, layout, cp)
    run("deepseek_v3", "zigzag", cp, recorded=True)  # MLA under cp, to 1e-10
    for family in HYBRIDS:
        for layout in ("contiguous", "zigzag"):
            run(family, layout, cp, recorded=True)


if __name__ == "__main__":
    run_rank(main)
