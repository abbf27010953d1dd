"""Router replay on a tiny Qwen3-MoE (float64, built locally): what the experts run for fill rows
and recorded weights, misuse, and a dummy micro batch."""

from __future__ import annotations

import pytest
import torch

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer
from rollfeed.models.packing_attention import packed_layout
from rollfeed.models.router_replay import RouterReplay, Routing, RoutingReplayError
from tests.dist.policy_cases import make_samples
from tests.models.tiny import VOCAB, tiny_qwen3, tiny_qwen3_moe

N = 11


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (N,), generator=gen)
    pos = torch.cat([torch.arange(6), torch.arange(5)])
    return ids, pos


def _logits(model, ids, pos) -> torch.Tensor:
    return model(input_ids=ids[None], position_ids=pos[None], packing=packed_layout(pos)).logits[0]


class ExpertSpy:
    """Captures what each MoE block's experts are asked to run: ids and mixing weights."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.logits: list[torch.Tensor] = []
        for name, module in model.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_pre_hook(self._experts)
            if name.endswith("mlp.gate"):
                module.register_forward_hook(self._gate)

    def _experts(self, module, args):
        self.calls.append((args[1].detach().clone(), args[2].detach().clone()))

    def _gate(self, module, args, output):
        self.logits.append(output[0].detach().clone())


def test_uncovered_rows_keep_the_models_own_choice() -> None:
    ids, pos = _inputs(2)
    model = tiny_qwen3_moe(seed=7)
    replay = RouterReplay(model)
    with replay.recording() as rec:
        _logits(model, ids, pos)
    own = rec[0].experts
    other = (own + 3) % 8
    fill = torch.tensor([5, 10])  # e.g. a sample's final sampled token and a padding position
    stored = other.to(torch.uint8)
    stored[fill] = 0  # the payload fill value, which reads as expert 0 if taken literally
    covered = torch.ones(N, dtype=torch.bool)
    covered[fill] = False
    spy = ExpertSpy(model)
    with replay.replaying(Routing(experts=stored, covered=covered)) as metrics:
        _logits(model, ids, pos)
    assert {k: int(v) for k, v in metrics.items()} == {
        "rows_replayed": N - 2,
        "rows_fallen_back": 2,
        "slots_replaced": 0,
    }
    ran0 = spy.calls[0][0]
    assert torch.equal(ran0[covered], other[covered, 0])
    # Layer 0 sees identical inputs, so its own choice is the recorded one; no row runs expert 0
    # because of the fill.
    assert torch.equal(ran0[fill], own[fill, 0])
    assert not (ran0[fill] == 0).all()
    # Later layers: the fill rows' choice is the router's top-k of what it sees now.
    for layer in range(1, 2):
        ran, _ = spy.calls[layer]
        top = torch.softmax(spy.logits[layer], -1).topk(2, dim=-1).indices
        assert torch.equal(ran[fill], top[fill])


def test_recorded_weights_replace_the_mixing_weights() -> None:
    ids, pos = _inputs(3)
    model = tiny_qwen3_moe(seed=8)
    replay = RouterReplay(model, replay_weights=True)
    with replay.recording() as rec:
        _logits(model, ids, pos)
    experts = rec[0].experts.to(torch.uint8)
    weights = torch.rand(N, 2, 2, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    spy = ExpertSpy(model)
    covered = torch.ones(N, dtype=torch.bool)
    with replay.replaying(Routing(experts=experts, covered=covered, weights=weights)):
        out = _logits(model, ids, pos)
    for layer, (ran, mixing) in enumerate(spy.calls):
        assert torch.equal(ran, experts[:, layer].long())
        assert mixing.dtype == torch.float64
        assert torch.equal(mixing, weights[:, layer].double())
    out.sum().backward()
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            assert p.grad is None or not p.grad.any(), name  # recorded weights carry no gradient


def test_misuse_is_refused() -> None:
    model = tiny_qwen3_moe(seed=9)
    good = torch.tensor([[[0, 1], [2, 3]]]).repeat(4, 1, 1)
    covered = torch.ones(4, dtype=torch.bool)
    with pytest.raises(RoutingReplayError, match="routed_expert_weights"):
        RouterReplay(model, replay_weights=True).set(Routing(experts=good, covered=covered))
    replay = RouterReplay(model)
    ids, pos = _inputs()
    with pytest.raises(RoutingReplayError, match="4 rows, the router sees 11") as err:
        replay.set(Routing(experts=good, covered=covered))
        _logits(model, ids, pos)
    assert err.value.layer == 0
    replay.clear()
    with pytest.raises(RoutingReplayError, match="no MoE router"):
        RouterReplay(tiny_qwen3())


def test_a_dummy_micro_batch_has_no_recorded_rows_and_counts_them() -> None:
    plan = prepare_batch(make_samples(4, [6]), PlanConfig(seq_len=16), dp_size=2)
    dummy = to_tensor_micro_batch(plan[1][0], cp_rank=0)
    assert dummy.is_dummy and dummy.coverage == {}
    metrics = PolicyScorer(tiny_qwen3_moe(seed=4)).score(dummy).metrics
    assert int(metrics["rows_replayed"]) == 0
    assert int(metrics["rows_fallen_back"]) == dummy.input_ids.numel() > 0
