"""The hybrid families under packing: Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE) and Llama-4's
chunked attention and NoPE query scaling, scored end to end through the PolicyScorer with
replayed routing (cases: :mod:`tests.models.hybrid_cases`).

Packed scores and every parameter's gradient equal each sample alone through the same model with
rollfeed's float64 kernels, routers patched by hand to the recorded ids: to 1e-10 with recorded
router weights and the zero-centred norms in float64; with the models' own router weights and
norms, whose ``(1 + w)`` is applied in float32 (so each norm weight's gradient is a float32 sum
over the row, measured 6e-8 apart), within the suite's float32 tolerances for those gradients.
rollfeed's layers equal transformers' own torch fallback (a float32 delta rule) on one unpacked
sample.
"""

from __future__ import annotations

import pytest
import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer
from rollfeed.models.delta_rule import kernel_names
from tests.devices import DEVICES
from tests.dist.policy_cases import loss_weights, reference
from tests.models.hybrid_cases import (
    HYBRIDS,
    LENGTHS,
    alone_forward,
    float64_norms,
    hand_routing,
    hybrid_model,
    hybrid_samples,
    rollfeed_model,
)

TOL = 1e-10
FLOAT32_SUMS = dict(atol=1e-7, rtol=1e-6)  # tests.models.family_cases.tolerance's float32 values


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recorded", [True, False], ids=["float64", "own_router_and_norms"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_packed_scores_and_grads_equal_each_sample_alone(family: str, recorded: bool) -> None:
    exact = float64_norms if recorded else (lambda model: model)
    samples = hybrid_samples(family, 1, LENGTHS, weights=recorded)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=112, pad_to_multiple_of=8), dp_size=1)[0]
    assert len(mb.samples) == len(LENGTHS)
    scorer = PolicyScorer(
        exact(hybrid_model(family, 1)),
        compute_entropy=True,
        entropy_requires_grad=True,
        replay_weights=recorded,
    )
    out = scorer.score(to_tensor_micro_batch(mb, cp_rank=0))
    assert int(out.metrics["rows_replayed"]) == sum(LENGTHS) - len(LENGTHS)
    ref_model = exact(rollfeed_model(family, 1))
    ref_lp, ref_ent, ref_valid = reference(
        ref_model,
        mb,
        replay_weights=recorded,
        forward=alone_forward,
        route=lambda model, routing: hand_routing(model, family, routing),
    )
    assert torch.equal(out.valid_mask, ref_valid) and ref_valid.sum() >= 40
    torch.testing.assert_close(out.logprobs, ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=TOL, rtol=0)
    w = loss_weights(mb.length)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    ((ref_lp * w[0]).sum() + (ref_ent * w[1]).sum()).backward()
    got, want = _grads(scorer.model), _grads(ref_model)
    assert got.keys() == want.keys()
    if family != "llama4":
        assert {"model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias"} <= set(
            got
        )
    for name in want:
        # Recorded weights give the router no gradient; every other one means something.
        router = name.endswith(("mlp.gate.weight", "router.weight"))
        assert (want[name].abs().max() > 1e-6) != (router and recorded), name
        sums = not recorded and family != "llama4" and name.endswith("norm.weight")
        tol = FLOAT32_SUMS if sums else dict(atol=TOL, rtol=0)
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)


@pytest.mark.parametrize("family", HYBRIDS)
def test_rollfeeds_layers_equal_transformers_torch_fallback_on_one_sample(family: str) -> None:
    stock, ours = hybrid_model(family, 2), rollfeed_model(family, 2)
    stock.set_attn_implementation("sdpa")
    for length in (3, 70):  # shorter than the conv kernel; across the delta rule's chunk
        ids = torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            want = stock(input_ids=ids[None]).logits[0]
            got = alone_forward(ours, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if family == "llama4":
        # Both features act on these samples: without chunks or without the scaling the stock
        # model scores otherwise.
        for name, value in (("attention_chunk_size", 10**6), ("floor_scale", 10**6)):
            plain = hybrid_model(family, 2)
            plain.set_attn_implementation("sdpa")
            setattr(plain.config, name, value)
            for layer in plain.model.layers:
                layer.self_attn.floor_scale = plain.config.floor_scale
            with torch.no_grad():
                other = plain(input_ids=ids[None]).logits[0]
            assert (other - want).abs().max() > 1e-4, name


@pytest.mark.parametrize("family", ["qwen3_5_moe", "llama4"])
@pytest.mark.parametrize("device", DEVICES)
def test_float32_scoring_on_each_device_matches_float64_on_the_cpu(device: str, family: str):
    """The device's kernels (on CUDA: varlen attention, causal-conv1d and flash-linear-attention
    where installed) in float32, against the float64 CPU scorer."""
    samples = hybrid_samples(family, 3, LENGTHS, weights=True)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=112, pad_to_multiple_of=8), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    runs = []
    for where, dtype in (("cpu", torch.float64), (device, torch.float32)):
        scorer = PolicyScorer(hybrid_model(family, 3).to(where, dtype), replay_weights=True)
        with torch.no_grad():
            runs.append(scorer.score(tmb.to(where)))
    want, got = runs
    fla = kernel_names(torch.device(device), torch.float32)["delta_rule"] == "fla"
    assert torch.equal(got.valid_mask.cpu(), want.valid_mask)
    tol = 5e-3 if fla else 1e-4  # flash-linear-attention may round through tf32
    torch.testing.assert_close(got.logprobs.double().cpu(), want.logprobs, atol=tol, rtol=0)
