"""PolicyScorer end to end on the MoE families with their attention features (MLA, sliding
windows, sinks) and replayed routing: packed scores and gradients equal each sample alone through
the stock model. The hybrid families (Gated DeltaNet, chunked attention) are in
tests/models/test_packing_hybrid.py."""

from __future__ import annotations

import pytest
import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer
from tests.dist.policy_cases import loss_weights, reference
from tests.models.family_cases import (
    FP32_ROUTERS,
    SCORED,
    reference_model,
    routed_samples,
    scoring_model,
    tolerance,
)

LENGTHS = [9, 4, 12, 6]  # gpt-oss's window of 4 is shorter than three of them


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


CASES = [*((f, False) for f in SCORED), *((f, True) for f in FP32_ROUTERS)]


@pytest.mark.parametrize(("family", "recorded"), CASES)
def test_packed_scores_and_grads_equal_each_sample_alone_through_the_stock_model(
    family, recorded
) -> None:
    samples = routed_samples(family, 1, LENGTHS, weights=recorded)
    config = PlanConfig(seq_len=40, pad_to_multiple_of=8)
    (mb,) = prepare_batch(samples, config, dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    model = scoring_model(family, 1)
    scorer = PolicyScorer(
        model, compute_entropy=True, entropy_requires_grad=True, replay_weights=recorded
    )
    out = scorer.score(tmb)
    # Each sample's last token and the row's padding have no routing row and keep the model's own.
    assert int(out.metrics["rows_replayed"]) == sum(LENGTHS) - len(LENGTHS)
    assert int(out.metrics["rows_fallen_back"]) == mb.length - sum(LENGTHS) + len(LENGTHS)
    ref_model = reference_model(family, 1)
    ref_lp, ref_ent, ref_valid = reference(ref_model, mb, replay_weights=recorded)
    assert torch.equal(out.valid_mask, ref_valid) and ref_valid.sum() >= 10
    tol = tolerance(family, recorded_weights=recorded)
    torch.testing.assert_close(out.logprobs, ref_lp, **tol)
    torch.testing.assert_close(out.entropy, ref_ent, **tol)
    w = loss_weights(mb.length)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    ((ref_lp * w[0]).sum() + (ref_ent * w[1]).sum()).backward()
    got, want = _grads(scorer.model), _grads(ref_model)
    assert got.keys() == want.keys()
    for name in want:
        tol = tolerance(family, name, recorded_weights=recorded)
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)
    if family == "gpt_oss":  # the features are exercised: sinks get gradients, windows cut
        assert all(got[n].abs().min() > 0 for n in got if n.endswith("sinks"))
        assert scorer.model.config.sliding_window < max(LENGTHS)


def test_gpt_oss_sinks_and_window_change_the_scores() -> None:
    # Guard for the gpt-oss case above: dropping the sinks or the window is not a no-op.
    samples = routed_samples("gpt_oss", 2, LENGTHS)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=40, pad_to_multiple_of=8), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    scores = []
    for change in (None, "sinks", "window"):
        model = scoring_model("gpt_oss", 2)
        if change == "sinks":
            for layer in model.model.layers:
                layer.self_attn.sinks.data.fill_(-torch.inf)
        if change == "window":
            for layer in model.model.layers:
                layer.self_attn.sliding_window = None
        with torch.no_grad():
            scores.append(PolicyScorer(model).score(tmb).logprobs)
    assert (scores[0] - scores[1]).abs().max() > 1e-4
    assert (scores[0] - scores[2]).abs().max() > 1e-4
