"""Every tensor the library creates follows the device of its inputs.

Under ``with torch.device("meta")`` a factory call without ``device=`` makes a meta tensor, and the
first op that mixes it with the CPU inputs fails: running the batch path, scoring and router
replay there on CPU inputs is a CPU check that nothing would land on the wrong device on a GPU
(the hybrid families' layers and their kernels included).
On every available device (``tests/devices.py``) replay with recorded weights then runs for real,
the model and the micro batch moved there, against the same scoring on the CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer, fused_support_logprobs, support_logprobs
from tests.devices import DEVICES
from tests.dist.policy_cases import loss_weights, make_samples, own_routing
from tests.models.hybrid_cases import HYBRIDS, hybrid_model
from tests.models.reference import random_batch
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe

LENGTHS = [9, 5, 11]


def _check_on(device: str, scores, model) -> None:
    assert scores.logprobs.device.type == device and scores.valid_mask.device.type == device
    assert all(v.device.type == device for v in scores.metrics.values())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.device.type == device for g in grads)


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
    _check_on("cpu", scores, model)
    assert all(t.device.type == "cpu" for t in built)  # the batch path builds host tensors


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_layers_create_nothing_off_the_inputs_device(family: str) -> None:
    scorer = PolicyScorer(hybrid_model(family, 2), compute_entropy=True)
    samples = make_samples(5, [3, 70, 11])
    with torch.device("meta"):
        plan = prepare_batch(samples, PlanConfig(seq_len=96, pad_to_multiple_of=8), dp_size=1)
        scores = scorer.score(to_tensor_micro_batch(plan[0][0], cp_rank=0))
        scores.logprobs.sum().backward()
    _check_on("cpu", scores, scorer.model)


def test_plain_and_fused_support_scoring_create_nothing_off_the_inputs_device():
    rows = 47
    logits = random_batch(rows, 123, seed=1)
    heads = random_batch(rows, 123, seed=1, hidden=16)
    fallback = torch.zeros(rows, dtype=torch.bool)
    fallback[[0, 10]] = True
    per_token = torch.linspace(0.5, 1.5, rows, dtype=torch.float64)
    kw = {"compute_entropy": True, "entropy_requires_grad": True, "fallback_mask": fallback}
    kw["missing_label"] = "full_vocab"
    x = logits["logits"].requires_grad_()
    h, w = heads["hidden"].requires_grad_(), heads["weight"].requires_grad_()
    with torch.device("meta"):
        runs = [support_logprobs(x, logits["labels"], logits["support"], temperature=0.7, **kw)]
        for t in (0.7, per_token):
            runs.append(
                fused_support_logprobs(
                    h, w, heads["labels"], heads["support"], temperature=t, chunk_size=5, **kw
                )
            )
        for scores in runs:
            (scores.logprobs.sum() + scores.entropy.sum()).backward()
    for scores in runs:
        assert scores.logprobs.device.type == scores.entropy.device.type == "cpu"
        assert all(v.device.type == "cpu" for v in scores.metrics.values())
    assert {g.device.type for g in (x.grad, h.grad, w.grad)} == {"cpu"}


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
    _check_on("cpu", scores, model)
    assert int(scores.metrics["rows_replayed"]) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_replay_with_recorded_weights_runs_on_the_models_device(device: str) -> None:
    recorder = tiny_qwen3_moe(seed=3)
    recorder.set_attn_implementation("sdpa")
    routing = own_routing(recorder, [s.token_ids for s in make_samples(6, LENGTHS)])
    samples = make_samples(6, LENGTHS, own_routing=routing, routing_weights=True)
    plan = prepare_batch(samples, PlanConfig(seq_len=32), dp_size=1)
    tmb = to_tensor_micro_batch(plan[0][0], cp_rank=0)
    w = loss_weights(tmb.input_ids.numel())
    runs = []
    for where in ("cpu", device):
        model = tiny_qwen3_moe(seed=3).to(where)
        scorer = PolicyScorer(
            model, replay_weights=True, compute_entropy=True, entropy_requires_grad=True
        )
        scores = scorer.score(tmb.to(where), fallback_unsupported=True)
        assert scores.entropy is not None
        ((scores.logprobs.cpu() * w[0]).sum() + (scores.entropy.cpu() * w[1]).sum()).backward()
        _check_on(where, scores, model)
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((scores, grads))
    (cpu, cpu_grads), (dev, dev_grads) = runs
    assert int(dev.metrics["rows_replayed"]) > 0
    assert {k: int(v) for k, v in dev.metrics.items()} == {
        k: int(v) for k, v in cpu.metrics.items()
    }
    assert torch.equal(dev.valid_mask.cpu(), cpu.valid_mask)
    torch.testing.assert_close(dev.logprobs.cpu(), cpu.logprobs, atol=1e-10, rtol=0)
    torch.testing.assert_close(dev.entropy.cpu(), cpu.entropy, atol=1e-10, rtol=0)
    assert dev_grads.keys() == cpu_grads.keys()
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(dev_grads[name], grad, atol=1e-10, rtol=0, msg=name)


def test_tree_scoring_creates_nothing_off_the_inputs_device() -> None:
    """A micro batch of prefix trees scored by a Qwen3-Next (tree attention, MoE routes
    replayed once per prefix, Gated DeltaNet forked at each branch point) and backpropagated
    under a meta default: the batch path builds host tensors, scoring stays on the inputs'."""
    import numpy as np

    from tests.collate.tree_cases import make_tree_samples
    from tests.models.tree_policy_cases import CASES

    model = hybrid_model("qwen3_next", 2)
    # distinct experts drawn per row (replay needs recorded routes, not the model's own)
    rng = np.random.default_rng(2)
    samples, prefixes = make_tree_samples(
        rng,
        CASES,
        vocab=model.config.vocab_size,
        routes=lambda ids: rng.random((len(ids), 2, 8)).argsort(-1)[..., :2],
    )
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=160), dp_size=1, prefixes=prefixes)[0]
    assert mb.tree is not None and mb.tree.length < mb.length
    scorer = PolicyScorer(model, compute_entropy=True, entropy_requires_grad=True)
    with torch.device("meta"):
        tmb = to_tensor_micro_batch(mb, cp_rank=0)
        scores = scorer.score(tmb)
        (scores.logprobs.sum() + scores.entropy.sum()).backward()
    _check_on("cpu", scores, model)
    assert int(scores.metrics["rows_replayed"]) > 0
    assert tmb.tree is not None and all(t.device.type == "cpu" for t in tmb.tree.tensors())


@pytest.mark.parametrize("device", DEVICES)
def test_tree_scoring_in_bf16_on_each_device_matches_float64_on_the_cpu(
    device: str, monkeypatch
) -> None:
    """The tree micro batch scored in bf16 on ``device`` (CUDA: the tree's attention in one
    varlen call over each span's gathered keys, counted) against float64 on the CPU: logprobs,
    entropies and gradients."""
    from rollfeed.models import tree_attention
    from tests.models.tree_policy_cases import tree_micro_batch

    calls = []
    kernel = tree_attention.varlen_kernel

    def counted():
        f = kernel()
        return None if f is None else lambda *a, **k: calls.append(1) or f(*a, **k)

    monkeypatch.setattr(tree_attention, "varlen_kernel", counted)
    tmb = to_tensor_micro_batch(tree_micro_batch(), cp_rank=0)
    w = loss_weights(tmb.input_ids.numel())
    runs = []
    for where, dtype in (("cpu", torch.float64), (device, torch.bfloat16)):
        model = tiny_qwen3(seed=3, dtype=dtype).to(where)
        scorer = PolicyScorer(model, compute_entropy=True, entropy_requires_grad=True)
        scores = scorer.score(tmb.to(where))
        logprobs, entropy = scores.logprobs.double().cpu(), scores.entropy.double().cpu()
        ((logprobs * w[0]).sum() + (entropy * w[1]).sum()).backward()
        _check_on(where, scores, model)
        grads = {
            n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None
        }
        runs.append((scores.valid_mask.cpu(), logprobs, entropy, grads))
    (valid, lp, ent, grads), (dev_valid, dev_lp, dev_ent, dev_grads) = runs
    assert torch.equal(dev_valid, valid) and int(valid.sum()) > 40
    torch.testing.assert_close(dev_lp[valid], lp[valid], atol=0.1, rtol=0.05)
    torch.testing.assert_close(dev_ent[valid], ent[valid], atol=0.1, rtol=0.05)
    assert dev_grads.keys() == grads.keys()
    for name, grad in grads.items():  # bf16: each gradient within a few percent of its norm
        assert (dev_grads[name] - grad).norm() <= 0.05 * grad.norm() + 1e-6, name
    if device == "cuda" and kernel() is not None:
        assert calls, "the tree's attention did not run the varlen kernel"
