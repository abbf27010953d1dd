"""Router replay over every router family of the table, on tiny float64 models of each family.

The references here (:func:`tests.models.family_cases.hand_routed_forward`) are written from each
family's formula independently of :mod:`rollfeed.models.router_families`: every router's forward
is patched by hand to return the replayed ids and the weights its family computes for them, in
the router's own dtypes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollfeed.models.router_replay import RouterReplay, Routing, RoutingReplayError, find_routers
from tests.models.family_cases import hand_routed_forward
from tests.models.tiny import VOCAB
from tests.models.tiny_moe import FAMILIES, tiny_moe

N = 13
TOL = 1e-10


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, N), generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _routers(model: nn.Module) -> list[nn.Module]:
    return [site.router for site in find_routers(model)]


def _own(model: nn.Module, ids: torch.Tensor) -> Routing:
    replay = RouterReplay(model)
    with torch.no_grad(), replay.recording() as rec:
        model(input_ids=ids)
    replay.remove()
    return rec[0]


def _other(own: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Ids other than the model's own that keep each row distinct: a shift by one expert."""
    return (own + 1) % num_experts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_own_routing_reproduces_logits_and_every_gradient_bitwise(family) -> None:
    ids = _ids()
    model = tiny_moe(family, seed=1)
    own = _own(model, ids)
    plain = model(input_ids=ids).logits
    plain.square().sum().backward()
    want = _grads(model)
    model.zero_grad()
    replay = RouterReplay(model)
    stored = Routing(experts=own.experts.to(torch.uint8), covered=own.covered)
    with replay.replaying(stored) as metrics:
        replayed = model(input_ids=ids).logits
    replayed.square().sum().backward()
    assert {k: int(v) for k, v in metrics.items()} == {
        "rows_replayed": N,
        "rows_fallen_back": 0,
        "slots_replaced": 0,
    }
    assert torch.equal(replayed, plain)
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_other_ids_equals_the_family_formula_and_reaches_the_router(family) -> None:
    ids = _ids(2)
    model, ref = tiny_moe(family, seed=3), tiny_moe(family, seed=3)
    routers = _routers(model)
    own = _own(model, ids)
    other = _other(own.experts, routers[0].num_experts)
    assert not torch.equal(other, own.experts)
    replay = RouterReplay(model)
    with replay.replaying(Routing(experts=other, covered=own.covered)):
        out = model(input_ids=ids).logits
    for layer, router in enumerate(_routers(ref)):
        router.forward = hand_routed_forward(router, family, other[:, layer])
    want = ref(input_ids=ids).logits
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    plain = model(input_ids=ids).logits
    assert (out - plain).abs().max() > 1e-4  # the replayed ids matter
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    (out * w).sum().backward()
    (want * w).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=TOL, rtol=0, msg=name)
    for layer, router in enumerate(routers):
        grad_rows = router.weight.grad.abs().sum(dim=1)
        replayed = other[:, layer].unique()
        assert (grad_rows[replayed] > 0).all(), (layer, grad_rows)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "minimax_m2"])
def test_the_correction_bias_changes_the_choice_but_never_the_replayed_weights(family) -> None:
    ids = _ids(4)
    model = tiny_moe(family, seed=5)
    own = _own(model, ids)
    replay = RouterReplay(model)
    with torch.no_grad(), replay.replaying(own):
        before = model(input_ids=ids).logits
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2
    with torch.no_grad():
        for bias in biases:
            bias.copy_(torch.linspace(1.0, -1.0, bias.numel(), dtype=bias.dtype))
    moved = _own(model, ids)
    assert not torch.equal(moved.experts, own.experts)  # the bias steers the choice
    with torch.no_grad(), replay.replaying(own):
        after = model(input_ids=ids).logits
    assert torch.equal(after, before)  # and never the replayed weights


class _RouterSpy:
    """The outputs each router hands its block (after replay)."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: list[tuple] = []
        for router in _routers(model):
            router.register_forward_hook(lambda m, a, out: self.outputs.append(out))


def test_top1_llama4_replays_covered_rows_and_a_fill_row_keeps_the_models_routing() -> None:
    ids = _ids(6)
    model = tiny_moe("llama4", seed=7)
    own = _own(model, ids)
    other = _other(own.experts, 4).to(torch.uint8)
    fill = torch.tensor([0, 5, 12])
    other[fill] = 0  # the payload fill, which would read as expert 0
    covered = torch.ones(N, dtype=torch.bool)
    covered[fill] = False
    replay = RouterReplay(model)
    plain = _RouterSpy(model)
    with torch.no_grad():
        model(input_ids=ids)
    spy = _RouterSpy(model)
    with torch.no_grad(), replay.replaying(Routing(experts=other, covered=covered)) as metrics:
        model(input_ids=ids)
    assert (int(metrics["rows_replayed"]), int(metrics["rows_fallen_back"])) == (N - 3, 3)
    scores = spy.outputs[0][0]
    chosen = scores.argmax(dim=1)
    assert torch.equal(chosen[covered], other[covered, 0, 0].long())
    assert ((scores > 0).sum(dim=1) == 1).all()
    # Layer 0 sees the same inputs with and without replay: fill rows keep the model's choice.
    assert torch.equal(scores[fill], plain.outputs[0][0][fill])
    assert torch.equal(chosen[fill], own.experts[fill, 0, 0])
    assert not (chosen[fill] == 0).all()
    # Layer 1: a fill row's choice is the router's own top-1 of what it sees now.
    scores1, logits1 = spy.outputs[1]
    assert torch.equal(scores1[fill].argmax(dim=1), logits1[fill].argmax(dim=1))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_drift_guard_is_plain_replay_at_ratio_0_and_counts_the_rejected_slots(family) -> None:
    ids = _ids(8)
    model = tiny_moe(family, seed=9)
    routers = _routers(model)
    own = _own(model, ids)
    E = routers[0].num_experts
    other = _other(own.experts, E)
    routing = Routing(experts=other, covered=torch.arange(N) % 4 != 1)
    with torch.no_grad(), RouterReplay(model).replaying(routing):
        plain = model(input_ids=ids).logits
    seen: list[tuple] = []  # the stock output of each router, before the guard's hook
    for router in routers:
        router.register_forward_hook(lambda m, a, out: seen.append(out))
    ratio = 0.9
    at_zero, guard = RouterReplay(model, drift_ratio=0.0), RouterReplay(model, drift_ratio=ratio)
    ran = _RouterSpy(model)  # hooked after the guard: sees the guarded choice
    with torch.no_grad(), at_zero.replaying(routing) as metrics:
        zero = model(input_ids=ids).logits
    assert torch.equal(zero, plain) and int(metrics["slots_replaced"]) == 0
    seen.clear()
    ran.outputs.clear()
    with torch.no_grad(), guard.replaying(routing) as metrics:
        model(input_ids=ids)
    expected = 0
    for layer, (logits, _, own_ids) in enumerate(seen):
        if family == "qwen3_moe":
            score = torch.softmax(logits.double(), dim=-1)
        else:
            score = torch.sigmoid(logits.double())  # without the correction bias
        weakest = score.gather(1, own_ids).min(dim=1, keepdim=True).values
        rejected = (score.gather(1, other[:, layer]) < ratio * weakest) & routing.covered[:, None]
        expected += int(rejected.sum())
        guarded = ran.outputs[layer][2]
        kept = ~rejected & routing.covered[:, None]
        assert torch.equal(guarded[kept], other[:, layer][kept])
        for row, slot in rejected.nonzero().tolist():
            assert guarded[row, slot] in own_ids[row]  # refilled from the trainer's own top-k
        assert (guarded.sort(dim=1).values.diff(dim=1) != 0).all()  # no id twice in a row
    assert expected > 0
    assert int(metrics["slots_replaced"]) == expected


def test_routing_checks_name_layer_row_and_value() -> None:
    model = tiny_moe("qwen3_moe", seed=10)
    replay = RouterReplay(model)
    ids = torch.tensor([[[0, 1], [2, 3]]]).repeat(4, 1, 1)
    covered = torch.ones(4, dtype=torch.bool)
    with pytest.raises(RoutingReplayError, match=r"\[N, 2 MoE layers, top_k 2\]"):
        replay.set(Routing(experts=ids[:, :1], covered=covered))
    with pytest.raises(RoutingReplayError, match=r"top_k 2"):
        replay.set(Routing(experts=ids[..., :1], covered=covered))
    bad = ids.clone()
    bad[2, 1, 0] = 9
    with pytest.raises(
        RoutingReplayError, match=r"routed_experts\[2, 1\] = \[9, 3\].*\[0, 8\)"
    ) as e:
        replay.set(Routing(experts=bad, covered=covered))
    assert (e.value.tensor, e.value.pos, e.value.layer) == ("routed_experts", 2, 1)
    twice = ids.clone()
    twice[3, 0] = torch.tensor([4, 4])
    with pytest.raises(RoutingReplayError, match=r"routed_experts\[3, 0\] = \[4, 4\] repeats") as e:
        replay.set(Routing(experts=twice, covered=covered))
    assert (e.value.pos, e.value.layer) == (3, 0)
    fill = twice.clone()
    fill[3] = 0
    fill_covered = covered.clone()
    fill_covered[3] = False  # a fill row is never checked: it is never replayed
    assert int(replay.set(Routing(experts=fill, covered=fill_covered))["rows_fallen_back"]) == 1
    with pytest.raises(RoutingReplayError, match=r"covered must be a \[N=4\] bool"):
        replay.set(Routing(experts=ids, covered=covered.long()))
    with pytest.raises(RoutingReplayError, match="drift_ratio must be >= 0"):
        RouterReplay(model, drift_ratio=-0.5)


class ToyRouter(nn.Linear):
    top_k, num_experts = 2, 4


class _Block(nn.Module):
    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        self.gate, self.experts = gate, nn.Linear(4, 4)


def test_an_unknown_router_is_refused_listing_the_family_table() -> None:
    for module, name in [
        (nn.Sequential(_Block(nn.Linear(4, 4))), "Linear (0.gate)"),
        (nn.Sequential(ToyRouter(4, 4)), "ToyRouter (0)"),
    ]:
        with pytest.raises(RoutingReplayError, match="known families") as e:
            RouterReplay(module)
        message = str(e.value)
        assert name in message
        for known in ("DeepseekV3TopkRouter", "GptOssTopKRouter", "Llama4Router"):
            assert known in message
    with pytest.raises(RoutingReplayError, match="no MoE router"):
        RouterReplay(nn.Sequential(nn.Linear(4, 4)))


def test_recorded_weights_replace_the_formula_top1_dense_included() -> None:
    ids = _ids(12)
    model = tiny_moe("llama4", seed=13)
    own = _own(model, ids)
    other = _other(own.experts, 4)
    weights = torch.rand(N, 2, 1, generator=torch.Generator().manual_seed(1))
    replay = RouterReplay(model, replay_weights=True)
    spy = _RouterSpy(model)
    routing = Routing(experts=other, covered=torch.ones(N, dtype=torch.bool), weights=weights)
    with torch.no_grad(), replay.replaying(routing):
        model(input_ids=ids)
    for layer, (scores, _) in enumerate(spy.outputs):
        want = torch.zeros_like(scores).scatter(1, other[:, layer], weights[:, layer].double())
        assert torch.equal(scores, want), layer


def test_drift_guard_with_recorded_weights_gives_rows_with_a_replaced_slot_the_formula() -> None:
    ids = _ids(14)
    model = tiny_moe("qwen3_moe", seed=15)
    own = _own(model, ids)
    other = _other(own.experts, 8)
    weights = torch.rand(N, 2, 2, generator=torch.Generator().manual_seed(2))
    routing = Routing(experts=other, covered=torch.ones(N, dtype=torch.bool), weights=weights)
    seen: list[tuple] = []
    for router in _routers(model):
        router.register_forward_hook(lambda m, a, out: seen.append(out))
    guard = RouterReplay(model, replay_weights=True, drift_ratio=0.9)
    spy = _RouterSpy(model)
    with torch.no_grad(), guard.replaying(routing) as metrics:
        model(input_ids=ids)
    assert int(metrics["slots_replaced"]) > 0
    for layer, ((logits, _, _), (_, mixed, guarded)) in enumerate(
        zip(seen, spy.outputs, strict=True)
    ):
        touched = (guarded != other[:, layer]).any(dim=1)
        assert torch.equal(mixed[~touched], weights[~touched, layer].double())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, guarded[touched])
        formula = (probs / probs.sum(dim=-1, keepdim=True)).double()
        assert torch.equal(mixed[touched], formula), layer
