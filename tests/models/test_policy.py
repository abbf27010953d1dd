"""PolicyScorer on one rank: TensorMicroBatches from the planner vs an independent reference."""

from __future__ import annotations

import pytest
import torch

from rollfeed.collate import IGNORE_INDEX, PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import (
    CPGroup,
    CPMismatchError,
    PolicyScorer,
    Routing,
    RoutingReplayError,
    SupportScores,
    support_logprobs,
)
from tests.devices import DEVICES
from tests.dist.policy_cases import loss_weights, make_samples, own_routing, reference
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe

TOL = 1e-10  # float64 end to end; packed vs per-sample runs differ only in summation order
LENGTHS = [9, 4, 12, 6]


def _one_micro_batch(samples, seq_len: int = 40):
    plan = prepare_batch(samples, PlanConfig(seq_len=seq_len, pad_to_multiple_of=8), dp_size=1)
    (mb,) = plan[0]
    return mb


def _sdpa(model):
    model.set_attn_implementation("sdpa")
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_against_reference(build, mb, seed: int, device: str = "cpu") -> dict:
    """Score ``mb`` with the model and the micro batch on ``device``; the reference runs on CPU."""
    assert mb.length > sum(LENGTHS)  # the row ends in padding
    model = build(seed=seed).to(device)
    scorer = PolicyScorer(model, compute_entropy=True, entropy_requires_grad=True)
    out = scorer.score(to_tensor_micro_batch(mb, cp_rank=0).to(device))
    assert type(out) is SupportScores  # one scores type for every scorer
    for name, value in out.metrics.items():  # the models' convention: 0-d int64 tensors
        assert isinstance(value, torch.Tensor) and value.shape == (), name
        assert value.dtype == torch.int64 and value.device.type == device, name
    assert out.entropy is not None
    assert {t.device.type for t in (out.logprobs, out.entropy, out.valid_mask)} == {device}
    ref_model = _sdpa(build(seed=seed))
    ref_lp, ref_ent, ref_valid = reference(ref_model, mb)
    assert torch.equal(out.valid_mask.cpu(), ref_valid)
    assert ref_valid.sum() >= 10
    torch.testing.assert_close(out.logprobs.cpu(), ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(out.entropy.cpu(), ref_ent, atol=TOL, rtol=0)
    w = loss_weights(mb.length)
    ((out.logprobs.cpu() * w[0]).sum() + (out.entropy.cpu() * w[1]).sum()).backward()
    ((ref_lp * w[0]).sum() + (ref_ent * w[1]).sum()).backward()
    got, want = _grads(scorer.model), _grads(ref_model)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].device.type == device, name
        torch.testing.assert_close(got[name].cpu(), want[name], atol=TOL, rtol=0, msg=name)
    return out.metrics


@pytest.mark.parametrize("device", DEVICES)
def test_packed_micro_batch_scores_equal_each_sample_alone_dense(device: str) -> None:
    mb = _one_micro_batch(make_samples(0, LENGTHS))
    metrics = _check_against_reference(tiny_qwen3, mb, seed=11, device=device)
    assert metrics["rows_replayed"] == 0


def test_packed_micro_batch_with_replayed_routing_moe() -> None:
    token_lists = [s.token_ids for s in make_samples(1, LENGTHS)]
    routing = own_routing(_sdpa(tiny_qwen3_moe(seed=12)), token_lists)
    mb = _one_micro_batch(make_samples(1, LENGTHS, own_routing=routing))
    metrics = _check_against_reference(tiny_qwen3_moe, mb, seed=12)
    # Each sample's last token and the row's padding keep the model's own routing.
    padding = mb.length - sum(LENGTHS)
    assert metrics["rows_replayed"] == sum(LENGTHS) - len(LENGTHS)
    assert metrics["rows_fallen_back"] == len(LENGTHS) + padding


def test_replay_changes_the_scores() -> None:
    # Guard for the MoE case above: replaying the shifted routing is not a no-op.
    token_lists = [s.token_ids for s in make_samples(1, LENGTHS)]
    routing = own_routing(_sdpa(tiny_qwen3_moe(seed=12)), token_lists)
    mb = _one_micro_batch(make_samples(1, LENGTHS, own_routing=routing))
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    scorer = PolicyScorer(tiny_qwen3_moe(seed=12))
    with torch.no_grad():
        replayed = scorer.score(tmb).logprobs
        plain = scorer.score_tokens(
            tmb.input_ids,
            tmb.position_ids,
            tmb.labels,
            tmb.fields["sampling_mask"],
            temperature=tmb.temperatures,
            cu_seqlens=tmb.cu_seqlens,
        ).logprobs
    assert (replayed - plain).abs().max() > 1e-3


def test_fallback_unsupported_scores_unmasked_loss_rows_over_the_vocab() -> None:
    mb = _one_micro_batch(make_samples(2, LENGTHS))
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    scorer = PolicyScorer(tiny_qwen3(seed=13))
    ref_model = _sdpa(tiny_qwen3(seed=13))
    with torch.no_grad():
        out = scorer.score(tmb, fallback_unsupported=True)
        alone = [
            ref_model(input_ids=torch.as_tensor(s.token_ids)[None]).logits[0] for s in mb.samples
        ]
    has_support = tmb.fields["sampling_mask"].lengths() > 0  # every recorded row holds its label
    no_mask = tmb.loss_mask & ~has_support
    assert no_mask.sum() >= 1
    assert int(out.metrics["rows_fallback"]) == int(no_mask.sum())
    assert torch.equal(out.valid_mask, has_support | no_mask)
    for row in no_mask.nonzero()[:, 0].tolist():
        k = max(i for i, a in enumerate(mb.starts) if a <= row)
        logits = alone[k][row - mb.starts[k]] / float(tmb.temperatures[row])
        expected = torch.log_softmax(logits, -1)[tmb.labels[row]]
        assert out.valid_mask[row]
        torch.testing.assert_close(out.logprobs[row], expected, atol=TOL, rtol=0)


def test_score_logits_is_support_logprobs_with_the_scorers_options() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 13, generator=gen, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3, 4, 5, 6, 0])
    support = torch.tensor([[1, 9], [2, -1], [3, 4], [4, 0], [5, 6], [6, 7], [-1, -1]])
    scorer = PolicyScorer(tiny_qwen3(), compute_entropy=True)
    got = scorer.score_logits(logits, labels, support)
    want = support_logprobs(logits, labels, support, compute_entropy=True)
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.entropy, want.entropy)


def test_misuse_is_refused() -> None:
    samples = make_samples(3, LENGTHS)
    tmb = to_tensor_micro_batch(_one_micro_batch(samples), cp_rank=0)
    dense = PolicyScorer(tiny_qwen3())
    with pytest.raises(RoutingReplayError, match="no MoE router"):
        dense.score_tokens(
            tmb.input_ids,
            tmb.position_ids,
            tmb.labels,
            tmb.fields["sampling_mask"],
            routing=Routing(
                experts=torch.zeros(tmb.input_ids.numel(), 2, 2, dtype=torch.uint8),
                covered=torch.zeros(tmb.input_ids.numel(), dtype=torch.bool),
            ),
        )
    config = PlanConfig(seq_len=40, cp_size=2, pad_to_multiple_of=8)
    (mb,) = prepare_batch(samples, config, dp_size=1)[0]
    with pytest.raises(
        CPMismatchError, match=r"cp rank 1 of 2 .*, this scorer runs cp rank 0 of 1"
    ):
        dense.score(to_tensor_micro_batch(mb, cp_rank=1))
    whole = to_tensor_micro_batch(_one_micro_batch(samples), cp_rank=0, whole_fields=True)
    with pytest.raises(CPMismatchError, match="whole_fields=False"):
        dense.score(whole)


def test_micro_batch_split_for_another_cp_size_than_the_group_is_refused() -> None:
    # A micro batch split for cp_size 2 handed to a scorer over a cp group of 4 (and the reverse,
    # rank for rank): refused before any collective, so a stand-in group is enough here.
    samples = make_samples(3, LENGTHS)
    two = prepare_batch(samples, PlanConfig(seq_len=40, cp_size=2), dp_size=1)[0][0]
    four = prepare_batch(samples, PlanConfig(seq_len=40, cp_size=4), dp_size=1)[0][0]
    for rank in range(2):
        scorer = PolicyScorer(tiny_qwen3(), cp=CPGroup(group=object(), rank=rank, size=4))
        with pytest.raises(CPMismatchError, match=rf"cp rank {rank} of 2 .* cp rank {rank} of 4"):
            scorer.score(to_tensor_micro_batch(two, cp_rank=rank))
        scorer = PolicyScorer(tiny_qwen3(), cp=CPGroup(group=object(), rank=rank, size=2))
        with pytest.raises(CPMismatchError, match=rf"cp rank {rank} of 4 .* cp rank {rank} of 2"):
            scorer.score(to_tensor_micro_batch(four, cp_rank=rank))


def test_dummy_micro_batch_scores_nothing_and_backprops() -> None:
    plan = prepare_batch(make_samples(4, [6]), PlanConfig(seq_len=16), dp_size=2)
    dummy = to_tensor_micro_batch(plan[1][0], cp_rank=0)
    assert dummy.is_dummy and dummy.fields == {}
    scorer = PolicyScorer(tiny_qwen3(), compute_entropy=True)
    out = scorer.score(dummy)
    assert not out.valid_mask.any() and not out.logprobs.any()
    out.logprobs.sum().backward()  # a rank with a dummy still joins the backward


def test_activation_checkpointing_replays_in_the_recomputed_forward() -> None:
    token_lists = [s.token_ids for s in make_samples(1, LENGTHS)]
    routing = own_routing(_sdpa(tiny_qwen3_moe(seed=12)), token_lists)
    samples = make_samples(1, LENGTHS, own_routing=routing)
    tmb = to_tensor_micro_batch(_one_micro_batch(samples), cp_rank=0)
    w = loss_weights(tmb.input_ids.numel())

    def unrouted(scorer):
        with torch.no_grad():
            return scorer.score_tokens(
                tmb.input_ids,
                tmb.position_ids,
                tmb.labels,
                tmb.fields["sampling_mask"],
                temperature=tmb.temperatures,
                cu_seqlens=tmb.cu_seqlens,
            ).logprobs

    grads, after = [], []
    for checkpoint in (False, True):
        model = tiny_qwen3_moe(seed=12)
        if checkpoint:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()  # HF checkpoints only in training mode; the tiny configs have no dropout
        scorer = PolicyScorer(model)
        (scorer.score(tmb).logprobs * w[0]).sum().backward()
        grads.append(_grads(model))
        # The next call without routing must not replay the routing kept for that backward.
        after.append(unrouted(scorer))
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=TOL, rtol=0, msg=name)
    torch.testing.assert_close(after[1], after[0], atol=TOL, rtol=0)


def test_recorded_routing_weights_reach_the_experts() -> None:
    token_lists = [s.token_ids for s in make_samples(1, LENGTHS)]
    routing = own_routing(_sdpa(tiny_qwen3_moe(seed=12)), token_lists)
    samples = make_samples(1, LENGTHS, own_routing=routing, routing_weights=True)
    tmb = to_tensor_micro_batch(_one_micro_batch(samples), cp_rank=0)
    model = tiny_qwen3_moe(seed=12)
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda m, args: seen.append(args[1:]))
    scorer = PolicyScorer(model, replay_weights=True)
    with torch.no_grad():
        metrics = scorer.score(tmb).metrics
    covered = tmb.labels != IGNORE_INDEX  # fill: each sample's last token and the padding
    assert metrics["rows_replayed"] == int(covered.sum()) > 0
    recorded_ids = tmb.fields["routed_experts"].long()
    recorded_w = tmb.fields["routed_expert_weights"].double()
    for layer, (ids, weights) in enumerate(seen):
        assert torch.equal(ids[covered], recorded_ids[covered, layer])
        assert torch.equal(weights[covered], recorded_w[covered, layer])
        assert not torch.equal(weights[~covered], recorded_w[~covered, layer])


def test_the_drift_guard_is_a_scorer_option_and_its_counter_is_always_reported() -> None:
    samples = make_samples(1, LENGTHS)
    tmb = to_tensor_micro_batch(_one_micro_batch(samples), cp_rank=0)
    assert PolicyScorer(tiny_qwen3_moe(seed=12), drift_ratio=0.5).replay.drift_ratio == 0.5
    with torch.no_grad():
        dense = PolicyScorer(tiny_qwen3(seed=11)).score(tmb)
    assert int(dense.metrics["slots_replaced"]) == 0  # the same keys with or without routing
