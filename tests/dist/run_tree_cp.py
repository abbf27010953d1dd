"""Tree-packed scoring over a cp group of 2 (2 ranks, gloo): the tree row split over cp.

For a dense Qwen3 (its RMSNorms in float64, :func:`tests.models.test_tree_policy.float64_rms_norms`)
and a Qwen3-MoE with replayed routes (read once per prefix), contiguous and zigzag layouts, the
cases of :mod:`tests.models.tree_policy_cases` (groups of 1, 2 and 8, a 3-turn conversation with
2 branches per turn) planned as trees for cp 2: every rank's gathered logprobs, entropies and
valid rows equal the single-rank tree scorer's on the whole tree row and the one-sample-at-a-time
reference; each rank's kept logprobs equal the single-rank ones of the flat rows it holds; the
parameter gradients summed over the cp group equal the single-rank gradients and those of each
sample alone (the MoE: 1e-5 of each parameter's largest, its router in float32). Float64, 1e-10.
Rank 0 prints the largest differences measured.
A Qwen3-Next (Gated DeltaNet forked at each branch point, its key heads split over cp) scores the
same cases over cp 2 as on one rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rollfeed.collate import RaggedRows, to_tensor_micro_batch
from rollfeed.models import CPGroup, PolicyScorer
from tests.dist.launch import run_rank
from tests.dist.policy_cases import reference
from tests.models.hybrid_cases import hybrid_model
from tests.models.test_tree_policy import float64_rms_norms
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe
from tests.models.tree_policy_cases import tree_micro_batch, weights

TOL = 1e-10


def whole_row(mb):
    """The same tree row read whole, as one rank does with no cp group (the reference)."""
    one = dataclasses.replace(mb.config, cp_size=1, cp_layout="contiguous")
    return to_tensor_micro_batch(dataclasses.replace(mb, config=one), cp_rank=0)


def model(build):
    return float64_rms_norms(build(seed=21))


def run(build, layout: str, cp: CPGroup) -> None:
    name = f"{build.__name__}/{layout}"
    routed = build is tiny_qwen3_moe
    stock = model(build)
    stock.set_attn_implementation("sdpa")
    mb = tree_micro_batch(stock if routed else None, cp=2, layout=layout)

    single = PolicyScorer(model(build), compute_entropy=True, entropy_requires_grad=True)
    whole = whole_row(mb)
    one = single.score(whole, return_support_logprobs=True)
    w = weights(mb.length, seed=3)
    support = whole.fields["sampling_mask"]
    kw = torch.randn(support.nnz, generator=torch.Generator().manual_seed(4)).double()
    kept = lambda k, x: torch.where(torch.isfinite(k.values), k.values * x, 0).sum()  # noqa: E731
    # two backward passes, as the cp scorer's below
    ((one.logprobs * w[0]).sum() + (one.entropy * w[1]).sum()).backward(retain_graph=True)
    kept(one.support_logprobs, kw).backward()
    ref_lp, ref_ent, ref_valid = reference(stock, mb)
    if cp.rank == 0:  # the gradients of each sample alone, compared on rank 0
        ((ref_lp * w[0]).sum() + (ref_ent * w[1]).sum()).backward()
    assert torch.equal(one.valid_mask, ref_valid), name
    assert torch.allclose(one.logprobs, ref_lp, atol=TOL, rtol=0), name

    scorer = PolicyScorer(model(build), cp=cp, compute_entropy=True, entropy_requires_grad=True)
    tmb = to_tensor_micro_batch(mb, cp_rank=cp.rank)
    assert tmb.tree.input_ids.numel() == mb.tree.length // 2, name
    out = scorer.score(tmb, return_support_logprobs=True)
    own = support.take(tmb.positions)
    assert own.equal(tmb.fields["sampling_mask"]), name
    own_kw = RaggedRows(support.offsets, kw).take(tmb.positions).values
    # the loss in two backward passes: without the kept logprobs' term first, as the
    # reference's loss (it has none), then the term itself (the MoE's float32 router rounds
    # two passes' sum apart from one pass's, 1e-6)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward(retain_graph=True)
    stock_params = dict(stock.named_parameters())
    worst_rel = 0.0
    for pname, p in scorer.model.named_parameters():
        if p.grad is None:
            continue
        summed = p.grad.clone()
        dist.all_reduce(summed, group=cp.group)
        if cp.rank == 0:
            want = stock_params[pname].grad
            worst_rel = max(worst_rel, ((summed - want).abs().max() / want.abs().max()).item())
    # the MoE router's softmax computes in float32 whatever the dtype: a tree sums a shared
    # token's gradient before it, the reference after (measured 9.5e-7)
    assert worst_rel < (1e-5 if routed else TOL), (name, worst_rel)
    kept(out.support_logprobs, own_kw).backward()
    want_kept = RaggedRows(support.offsets, one.support_logprobs.values.detach()).take(
        tmb.positions
    )
    torch.testing.assert_close(
        out.support_logprobs.values.detach(), want_kept.values, atol=TOL, rtol=0
    )
    assert torch.equal(out.valid_mask, ref_valid), name
    for got, want in ((out.logprobs, ref_lp), (out.entropy, ref_ent), (out.logprobs, one.logprobs)):
        torch.testing.assert_close(got.detach(), want.detach(), atol=TOL, rtol=0, msg=name)
    if routed:
        assert int(out.metrics["rows_replayed"]) > 0, name
    single_params = dict(single.model.named_parameters())
    worst = 0.0
    for pname, p in scorer.model.named_parameters():
        q = single_params[pname]
        assert (p.grad is None) == (q.grad is None), (name, pname)
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp.group)
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    assert worst < TOL, (name, worst)
    if cp.rank == 0:
        lp = (out.logprobs - ref_lp).abs().max().item()
        ent = (out.entropy - ref_ent).abs().max().item()
        print(  # quoted by the test's report: the largest differences measured
            f"cp 2 {name}: logprobs {lp:.1e}, entropy {ent:.1e} abs against each sample alone; "
            f"gradients {worst_rel:.1e} rel against each sample alone, {worst:.1e} abs against "
            "one rank",
            flush=True,
        )


def run_gated_deltanet(cp: CPGroup) -> None:
    plain = hybrid_model("qwen3_next", 5)
    plain.set_attn_implementation("sdpa")
    mb = tree_micro_batch(plain, seed=5, cp=2, layout="zigzag")
    single = PolicyScorer(hybrid_model("qwen3_next", 5)).score(whole_row(mb))
    scorer = PolicyScorer(hybrid_model("qwen3_next", 5), cp=cp)
    with torch.no_grad():
        out = scorer.score(to_tensor_micro_batch(mb, cp_rank=cp.rank))
    assert torch.equal(out.valid_mask, single.valid_mask)
    torch.testing.assert_close(out.logprobs, single.logprobs.detach(), atol=TOL, rtol=0)
    if cp.rank == 0:
        lp = (out.logprobs - single.logprobs).abs().max().item()
        print(f"cp 2 qwen3_next/zigzag: logprobs {lp:.1e} abs against one rank", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    cp = CPGroup(group=dist.group.WORLD, rank=dist.get_rank(), size=2)
    for layout in ("contiguous", "zigzag"):
        run(tiny_qwen3, layout, cp)
        run(tiny_qwen3_moe, layout, cp)
    run_gated_deltanet(cp)


if __name__ == "__main__":
    run_rank(main)
