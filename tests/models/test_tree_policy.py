"""Tree-packed scoring equals one-sample-at-a-time scoring: logprobs, entropies, valid rows and
every parameter's gradient, for a dense and a MoE model with routes replayed (read once per
prefix), for groups of 1, 2 and 8 and a 3-turn conversation with 2 branches per turn; the kept
logprobs line up with the flat rows; the hybrid layers (Gated DeltaNet forked at each branch
point, Llama-4's chunked attention and NoPE scaling, gpt-oss's sliding window and sinks) keep
their semantics on trees. Float64: scores to 1e-10.

Gradients: the models' RMSNorms compute in float32 whatever the dtype, and a tree sums a shared
token's gradient from its branches *before* its norms' backward where the one-by-one reference
sums the copies after, so the two round apart at float32's 1e-7 (measured 1.2e-7 at the last
norm's input); the MoE router's softmax computes in float32 too. With the dense model's norms
computed in the input's dtype (:func:`float64_rms_norms`) they agree to 1e-10; with the models'
own, to 1e-6 of each parameter's largest gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from rollfeed.collate import to_tensor_micro_batch
from rollfeed.models import PolicyScorer
from tests.dist.policy_cases import reference
from tests.models.family_cases import reference_model, scoring_model
from tests.models.hybrid_cases import alone_forward, hand_routing, hybrid_model, rollfeed_model
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe
from tests.models.tree_policy_cases import flat_twin, tree_micro_batch, weights

TOL = dict(atol=1e-10, rtol=0)
FLOAT32_NORMS = 1e-6  # largest gradient error over the parameter's largest gradient


def float64_rms_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its (Qwen3) RMSNorms computed in the input's dtype: the same formula."""
    for module in model.modules():
        if type(module).__name__ in ("Qwen3RMSNorm", "Qwen3MoeRMSNorm"):
            module.forward = functools.partial(_rms_norm, module)
    return model


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check(scorer, mb, ref_model, *, exact: bool = False, **ref_options):
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    out = scorer.score(tmb)
    ref_lp, ref_ent, ref_valid = reference(ref_model, mb, **ref_options)
    assert torch.equal(out.valid_mask, ref_valid) and int(ref_valid.sum()) >= 40
    torch.testing.assert_close(out.logprobs, ref_lp, **TOL)
    torch.testing.assert_close(out.entropy, ref_ent, **TOL)
    w = weights(mb.length)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    ((ref_lp * w[0]).sum() + (ref_ent * w[1]).sum()).backward()
    got, want = _grads(scorer.model), _grads(ref_model)
    assert got.keys() == want.keys() and len(want) > 5
    for name in want:
        if exact:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
        else:
            error = (got[name] - want[name]).abs().max() / want[name].abs().max()
            assert error < FLOAT32_NORMS, (name, float(error))
    return out


@pytest.mark.parametrize(
    ("build", "exact", "layout"),
    [
        (tiny_qwen3, True, "contiguous"),
        (tiny_qwen3, True, "zigzag"),  # slots rounded up to 2, padding spans between them
        (tiny_qwen3, False, "contiguous"),
        (tiny_qwen3_moe, False, "contiguous"),
        (tiny_qwen3_moe, False, "zigzag"),
    ],
    ids=[
        "dense_float64_norms",
        "dense_float64_norms_zigzag",
        "dense",
        "moe_replayed",
        "moe_zigzag",
    ],
)
def test_tree_scores_and_grads_equal_each_sample_alone(build, exact: bool, layout: str) -> None:
    routed = build is tiny_qwen3_moe
    norms = float64_rms_norms if exact else (lambda model: model)
    stock = norms(build(seed=21))
    stock.set_attn_implementation("sdpa")
    mb = tree_micro_batch(stock if routed else None, layout=layout)
    if layout == "zigzag":
        assert -1 in mb.tree.owners  # padding spans in the tree row
    scorer = PolicyScorer(norms(build(seed=21)), compute_entropy=True, entropy_requires_grad=True)
    out = _check(scorer, mb, stock, exact=exact)
    if routed:  # every forwarded token of the tree row replayed once
        forwarded = sum(n for n, o in zip(mb.tree.lengths, mb.tree.owners, strict=True) if o >= 0)
        assert int(out.metrics["rows_replayed"]) == forwarded - len(mb.samples)


def test_kept_logprobs_line_up_with_the_flat_rows() -> None:
    mb = tree_micro_batch()
    tree = PolicyScorer(tiny_qwen3(seed=3)).score(
        to_tensor_micro_batch(mb, cp_rank=0), return_support_logprobs=True
    )
    flat = PolicyScorer(tiny_qwen3(seed=3)).score(
        to_tensor_micro_batch(flat_twin(mb), cp_rank=0), return_support_logprobs=True
    )
    assert torch.equal(tree.support_logprobs.offsets, flat.support_logprobs.offsets)
    torch.testing.assert_close(tree.support_logprobs.values, flat.support_logprobs.values, **TOL)
    assert int(torch.isfinite(tree.support_logprobs.values).sum()) > 40


@pytest.mark.parametrize("family", ["qwen3_next", "llama4", "gpt_oss"])
def test_hybrid_layers_keep_their_semantics_on_trees(family: str) -> None:
    """Gated DeltaNet (a branch starts from its prefix's final state and convolves its last
    inputs; the conversation's 2-token turns are shorter than the conv kernel), Llama-4's chunks
    of 8 counted along each path and NoPE scaling by depth, gpt-oss's 4-token window and sinks."""
    if family == "gpt_oss":
        stock = reference_model(family, 5)
        mb = tree_micro_batch(stock, seed=5)
        scorer = PolicyScorer(scoring_model(family, 5), compute_entropy=True)
        scorer.entropy_requires_grad = True
        _check(scorer, mb, stock)
        return
    plain = hybrid_model(family, 5)
    plain.set_attn_implementation("sdpa")
    mb = tree_micro_batch(plain, seed=5)
    scorer = PolicyScorer(hybrid_model(family, 5), compute_entropy=True, entropy_requires_grad=True)
    _check(
        scorer,
        mb,
        rollfeed_model(family, 5),
        forward=alone_forward,
        route=lambda model, routing: hand_routing(model, family, routing),
    )


def test_the_objectives_on_a_tree_micro_batch_equal_its_samples_packed_one_by_one() -> None:
    """A loss step (support distributions, truncated importance weights, a sequence weight over
    each sample's boundaries, the step's sequence-mean aggregation) reads the tree micro batch's
    flat rows as it reads the samples packed one by one: the same loss, the same gradients."""
    from rollfeed.objectives import (
        SequenceWeight,
        TruncatedIS,
        aggregate,
        micro_batch_rows,
        policy_loss,
        support_distribution,
    )

    mb = tree_micro_batch()
    runs = []
    for placed in (mb, flat_twin(mb)):
        if placed is not mb:
            placed = dataclasses.replace(placed, step_counts=mb.step_counts)
        tmb = to_tensor_micro_batch(placed, cp_rank=0)
        scorer = PolicyScorer(float64_rms_norms(tiny_qwen3(seed=4)))
        out = scorer.score(tmb, return_support_logprobs=True)
        support, mask_lp = micro_batch_rows(tmb)
        distribution = support_distribution(
            support,
            out.support_logprobs,
            mask_lp,
            labels=tmb.labels,
            loss_mask=tmb.loss_mask,
            inference_logprobs=tmb.inference_logprobs,
        )
        terms = policy_loss(
            distribution,
            out.logprobs[tmb.positions],
            tmb.advantages,
            weight=TruncatedIS(cap=2.0),
            sequence=SequenceWeight(cap=3.0),
            positions=tmb.positions,
            cu_seqlens=tmb.cu_seqlens,
        )
        loss = aggregate(terms.loss, tmb, mode="seq_mean_token_mean")
        loss.backward()
        runs.append((loss.detach(), _grads(scorer.model)))
    (tree_loss, tree_grads), (flat_loss, flat_grads) = runs
    assert float(tree_loss) != 0.0
    torch.testing.assert_close(tree_loss, flat_loss, **TOL)
    for name, want in flat_grads.items():
        torch.testing.assert_close(tree_grads[name], want, **TOL, msg=name)
