"""Every tensor the library creates follows the device of its inputs.

Under ``with torch.device("meta")`` a factory call without ``device=`` makes a meta tensor, and the
first op that mixes it with the CPU inputs fails: running the batch path, scoring and router
replay there on CPU inputs is a CPU check that nothing would land on the wrong device on a GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer
from tests.dist.policy_cases import make_samples, own_routing
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe

LENGTHS = [9, 5, 11]


def _check_on_cpu(scores, model) -> None:
    assert scores.logprobs.device.type == "cpu" and scores.valid_mask.device.type == "cpu"
    assert all(v.device.type == "cpu" for v in scores.metrics.values())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.device.type == "cpu" for g in grads)


def test_batch_path_scoring_and_backward_create_nothing_off_the_inputs_device():
    model = tiny_qwen3(seed=2)
    scorer = PolicyScorer(model, compute_entropy=True, entropy_requires_grad=True)
    samples = make_samples(5, LENGTHS)
    with torch.device("meta"):
        plan = prepare_batch(samples, PlanConfig(seq_len=32, pad_to_multiple_of=8), dp_size=1)
        tmb = to_tensor_micro_batch(plan[0][0], cp_rank=0)
        built = [v for v in vars_of(tmb) if isinstance(v, torch.Tensor)]
        scores = scorer.score(tmb, fallback_unsupported=True)
        (scores.logprobs.sum() + scores.entropy.sum()).backward()
    _check_on_cpu(scores, model)
    assert all(t.device.type == "cpu" for t in built)  # the batch path builds host tensors


def vars_of(tmb):
    return [getattr(tmb, f.name) for f in dataclasses.fields(tmb)] + list(tmb.fields.values())


def test_router_replay_creates_nothing_off_the_inputs_device():
    model = tiny_qwen3_moe(seed=3)
    recorder = tiny_qwen3_moe(seed=3)
    recorder.set_attn_implementation("sdpa")
    routing = own_routing(recorder, [s.token_ids for s in make_samples(6, LENGTHS)])
    samples = make_samples(6, LENGTHS, own_routing=routing, routing_weights=True)
    scorer = PolicyScorer(model, replay_weights=True)
    with torch.device("meta"):
        plan = prepare_batch(samples, PlanConfig(seq_len=32), dp_size=1)
        tmb = to_tensor_micro_batch(plan[0][0], cp_rank=0)
        scores = scorer.score(tmb)
        scores.logprobs.sum().backward()
    _check_on_cpu(scores, model)
    assert int(scores.metrics["rows_replayed"]) > 0
