"""Scoring refuses what it cannot score exactly: ids outside the vocabulary (negative ones but the
-1 padding included), invalid or too small temperatures, non-finite scores (NaN logits),
and models whose attention packing cannot reproduce (typed errors naming the place)."""

from __future__ import annotations

import dataclasses
import io
import pickle
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rollfeed import models
from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch
from rollfeed.loaders.collator import share_as_one_storage
from rollfeed.models import PolicyScorer, fused_support_logprobs, support_logprobs
from rollfeed.models import tp as tp_module
from tests.dist.policy_cases import make_samples, reference
from tests.models.tiny import VOCAB, tiny_config, tiny_mixtral, tiny_qwen3, tiny_qwen3_moe

TOL = 1e-10


@contextmanager
def refused(error: str, match: str | None = None):
    """``pytest.raises`` for the typed error ``rollfeed.models.<error>`` (a ValueError), looked up
    after the call, so code that accepts the input fails with "DID NOT RAISE"."""
    with pytest.raises(ValueError, match=match) as caught:
        yield caught
    assert isinstance(caught.value, getattr(models, error)), repr(caught.value)


@pytest.fixture(scope="module")
def tp_group():
    """A one-rank TP group: its shard is the whole vocabulary, so an id >= VOCAB is owned by no
    rank, exactly as on a real TP group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group([0])
    dist.destroy_process_group()


def _samples(*, support_id: int = 120, temperature: float = 0.0) -> list[Sample]:
    """Sample a: tokens [3, 4, 5, 6], kept sets {4, support_id} for token 1 and {5} for token 2.
    Sample b: tokens [7, 8, 9], token 1 not loss-bearing but with a kept set {8} (so scored) and
    the given temperature; token 2 kept set {9}."""
    a = Sample(
        np.array([3, 4, 5, 6]),
        loss_mask=np.array([0, 1, 1, 1]),
        advantages=np.zeros(4, np.float32),
        inference_logprobs=np.zeros(4, np.float32),
        temperatures=np.ones(4, np.float32),
        fields={"sampling_mask": (np.array([0, 2, 1, 0]), np.array([4, support_id, 5], np.int32))},
        uid="a",
    )
    b = Sample(
        np.array([7, 8, 9]),
        loss_mask=np.array([0, 0, 1]),
        advantages=np.zeros(3, np.float32),
        inference_logprobs=np.zeros(3, np.float32),
        temperatures=np.array([1.0, temperature, 1.0], np.float32),
        fields={"sampling_mask": (np.array([0, 1, 1]), np.array([8, 9], np.int32))},
        uid="b",
    )
    return [a, b]


def _micro_batch(samples, **options):
    (mb,) = prepare_batch(
        samples, PlanConfig(seq_len=8, pad_to_multiple_of=8, **options), dp_size=1
    )[0]
    return mb


def _start(mb, uid: str) -> int:
    return next(a for s, a in zip(mb.samples, mb.starts, strict=True) if s.uid == uid)


def _roundtrip_shared(tmb):
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(share_as_one_storage(tmb))
    return pickle.loads(buf.getvalue())


def test_collator_records_largest_id_and_invalid_temperature_as_plain_values_that_survive_copies():
    from rollfeed.collate.token_checks import Located

    mb = _micro_batch(_samples())
    a, b = _start(mb, "a"), _start(mb, "b")
    checks = to_tensor_micro_batch(mb, cp_rank=0).checks
    # The largest id is the kept-set id 120 for token 1 of a (label coordinate a + 0).
    assert checks.max_id == Located(value=120, tensor="sampling_mask", pos=a, sample="a", token=1)
    assert checks.min_id.value == 0 and checks.min_id.sample is None  # the row's padding token
    assert checks.bad_temperature == Located(
        value=0.0, tensor="temperatures", pos=b, sample="b", token=1
    )
    assert not checks.temperatures_valid
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    for copy in (
        tmb.to("cpu"),
        tmb.apply(torch.clone),
        pickle.loads(pickle.dumps(tmb)),
        _roundtrip_shared(tmb),
    ):
        assert copy.checks == checks
    # Each CP rank records what it holds: the rank without sample a's kept sets has a smaller max.
    per_rank = [
        to_tensor_micro_batch(_micro_batch(_samples(), cp_size=2), cp_rank=r).checks
        for r in range(2)
    ]
    assert sorted(c.max_id.value for c in per_rank) == [9, 120]
    valid = to_tensor_micro_batch(_micro_batch(_samples(temperature=0.7)), cp_rank=0).checks
    assert valid.temperatures_valid


def test_scorer_refuses_non_positive_temperature_recorded_by_the_collator() -> None:
    mb = _micro_batch(_samples(temperature=0.0))
    scorer = PolicyScorer(tiny_qwen3())
    with refused("TemperatureError", match=rf"row position {_start(mb, 'b')} \(sample b") as err:
        scorer.score(to_tensor_micro_batch(mb, cp_rank=0))
    assert err.value.place == {
        "tensor": "temperatures",
        "pos": _start(mb, "b"),
        "sample": "b",
        "layer": None,
    }


def test_scorer_refuses_id_outside_the_vocabulary_under_tp_recorded_by_the_collator(
    tp_group,
) -> None:
    mb = _micro_batch(_samples(support_id=VOCAB + 2, temperature=1.0))
    scorer = PolicyScorer(tiny_qwen3(), tp_group=tp_group, vocab_start=0)
    with refused(
        "VocabularyRangeError",
        match=rf"token id {VOCAB + 2} in sampling_mask at row position {_start(mb, 'a')} "
        rf"\(sample a, token 1\) is outside the vocabulary \[0, {VOCAB}\)",
    ):
        scorer.score(to_tensor_micro_batch(mb, cp_rank=0))
    assert scorer.vocab_size == VOCAB  # the shards' widths summed over the TP group


def test_scorer_checks_the_recorded_values_not_the_tensors(tp_group, monkeypatch) -> None:
    from rollfeed.collate.token_checks import Located

    tmb = to_tensor_micro_batch(_micro_batch(_samples(temperature=1.0)), cp_rank=0)
    scorer = PolicyScorer(tiny_qwen3(), tp_group=tp_group)
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a) or None)
    forwards = []
    scorer.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    # The tensors are in range; only the recorded value says otherwise, and it is refused before
    # any forward or collective.
    claimed = Located(value=VOCAB, tensor="labels", pos=5, sample="b", token=2)
    lying = dataclasses.replace(tmb, checks=dataclasses.replace(tmb.checks, max_id=claimed))
    with refused("VocabularyRangeError", match=rf"token id {VOCAB} in labels at row position 5"):
        scorer.score(lying)
    assert forwards == [] and calls == []


@pytest.mark.parametrize("fused", [False, True])
def test_support_logprobs_refuses_nan_temperature_naming_rows(fused: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 2, 3, 4, -100])
    support = torch.tensor([[1, 5], [2, -1], [3, 7], [4, 0], [-1, -1]])

    def score(temperature):
        if fused:
            return fused_support_logprobs(hidden, weight, labels, support, temperature=temperature)
        return support_logprobs(hidden @ weight.T, labels, support, temperature=temperature)

    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        t = torch.tensor([1.0, 0.5, bad, 1.0, 1.0], dtype=torch.float64)
        with refused("TemperatureError", match=r"first rows \[2\]"):
            score(t)
    # Row 4 is not scored: its temperature may be anything, and scores and gradients stay finite.
    out = score(torch.tensor([1.0, 0.5, 0.7, 1.0, float("nan")], dtype=torch.float64))
    out.logprobs.sum().backward()
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(weight.grad).all()


def _score_rows(fused: bool, hidden, weight, labels, support, **options):
    if fused:
        return fused_support_logprobs(hidden, weight, labels, support, **options)
    return support_logprobs(hidden @ weight.T, labels, support, **options)


@pytest.mark.parametrize("fused", [False, True])
def test_temperature_below_the_compute_dtypes_smallest_normal_is_refused_naming_the_row(
    fused: bool,
) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 8, generator=gen)
    weight = torch.randn(11, 8, generator=gen)
    labels = torch.tensor([1, 2, 3])
    support = torch.tensor([[1, 5], [2, -1], [3, 7]])
    # 1e-45 is finite and > 0, but in float32 it is a subnormal whose reciprocal overflows.
    with refused("TemperatureError", match=r"finite and >= 1\.175e-38"):
        _score_rows(fused, hidden, weight, labels, support, temperature=1e-45)
    t = torch.tensor([1.0, 1e-45, 1.0])
    with refused("TemperatureError", match=r"first rows \[1\]") as err:
        _score_rows(fused, hidden, weight, labels, support, temperature=t)
    assert err.value.place["pos"] == 1
    # The bound is the compute dtype's: float64 scores the same temperature, finitely.
    out = _score_rows(
        fused, hidden.double(), weight.double(), labels, support, temperature=t.double()
    )
    assert torch.isfinite(out.logprobs).all() and out.valid_mask.all()


@pytest.mark.parametrize(
    ("fused", "nan_in"), [(False, "logits"), (True, "hidden"), (True, "weight")]
)
def test_nan_logit_on_a_scored_singleton_row_raises_naming_the_row(fused: bool, nan_in: str):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3, -100])
    support = torch.tensor([[1, 5], [2, -1], [3, 7], [-1, -1]])  # row 1: the singleton {2}
    if nan_in == "weight":
        weight[2] = float("nan")  # only token 2's logit, only row 1 asks for it
    else:
        hidden[1, 0] = float("nan")
    hidden[3] = float("nan")  # an unscored row (a prompt token) may hold anything
    with refused("NonFiniteLogitError", match=r"1 scored row\(s\) .* first rows \[1\]") as err:
        _score_rows(fused, hidden, weight, labels, support, compute_entropy=True)
    assert err.value.place == {"tensor": "logits", "pos": 1, "sample": None, "layer": None}


def test_nan_logit_raises_on_every_tp_rank_after_the_reductions(tp_group) -> None:
    logits = torch.randn(3, VOCAB, dtype=torch.float64)
    logits[2, 7] = float("nan")
    support = torch.tensor([[1, 2], [4, -1], [7, -1]])
    with refused("NonFiniteLogitError", match=r"first rows \[2\]"):
        support_logprobs(logits, support[:, 0].clone(), support, tp_group=tp_group)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("negative", [-2, -100])
def test_negative_support_id_other_than_padding_is_refused(fused: bool, negative: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3])
    support = torch.tensor([[1, 5, -1], [2, negative, -1], [3, -1, -1]])
    with refused("VocabularyRangeError", match=rf"support\[1, 1\] = {negative} .* pad with -1"):
        _score_rows(fused, hidden, weight, labels, support)
    ok = _score_rows(fused, hidden, weight, labels, support.clamp(min=-1))  # -1 pads
    assert ok.valid_mask.all()


def test_support_logprobs_refuses_id_outside_the_vocabulary_under_tp(tp_group, monkeypatch):
    logits = torch.randn(3, VOCAB, dtype=torch.float64)
    labels = torch.tensor([1, VOCAB + 5, 2])
    support = torch.tensor([[1, 2], [VOCAB + 5, 3], [2, -1]])
    calls = []
    counted = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return counted(tensor, *args, **kwargs)

    monkeypatch.setattr(tp_module.dist, "all_reduce", counting)
    with refused("VocabularyRangeError", match=rf"support\[1, 0\] = {VOCAB + 5}"):
        support_logprobs(logits, labels, support, tp_group=tp_group)
    assert calls == [(1,)]  # the shards' widths, summed to V
    calls.clear()
    with refused("VocabularyRangeError", match=rf"labels\[1\] = {VOCAB + 5}"):
        support_logprobs(logits, labels, support.clamp(max=3), tp_group=tp_group, vocab_size=VOCAB)
    assert calls == []  # V given: no extra collective before the checks


def _tiny(config_name: str, model_name: str, **overrides):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**tiny_config(**overrides))
    return getattr(transformers, model_name)(config)


_GATED_DELTANET = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"],
)


@pytest.mark.parametrize(
    "names",
    [
        ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    ],
)
def test_scorer_refuses_linear_attention_it_cannot_pack(names) -> None:
    from rollfeed.models.packing_support import check_packable

    # Key heads the cp group cannot split: refused by name before any forward.
    model = _tiny(*names, **_GATED_DELTANET)
    with refused("UnpackableAttentionError", match=r"2 key heads, which cp=4 ranks cannot split"):
        check_packable(model, cp_size=4)
    check_packable(model, cp_size=2)
    # A conv activation the packed kernels do not implement: not a Gated DeltaNet they run.
    model = _tiny(*names, **_GATED_DELTANET, hidden_act="gelu")
    with refused("UnpackableAttentionError") as caught:
        PolicyScorer(model)
    err = caught.value
    assert [layer for layer, _ in err.findings] == ["layer 0 (model.layers.0)"] * 2
    assert "other than a Gated DeltaNet" in str(err) and "GatedDeltaNet" in str(err)
    assert pickle.loads(pickle.dumps(err)).findings == err.findings
    assert model.config._attn_implementation != "rollfeed_packed"  # a refused model is untouched
    assert "forward" not in vars(model.model.layers[0].linear_attn)


def test_scorer_refuses_chunked_attention_and_query_scaling_it_cannot_pack() -> None:
    # Chunks from attention_chunk_size without layer types, and index scaling on a layer that is
    # not Llama-4's NoPE attention.
    model = tiny_qwen3()
    model.config.attention_chunk_size = 4
    model.config.layer_types = None
    attention = model.model.layers[1].self_attn
    attention.attn_temperature_tuning, attention.use_rope, attention.floor_scale = True, False, 4
    with refused("UnpackableAttentionError") as caught:
        PolicyScorer(model)
    findings = caught.value.findings
    assert findings[0] == (
        "layer 0 (model.layers.0)",
        "chunked attention (attention_chunk_size=4, over the row)",
    )
    assert (
        findings[-1][0] == "layer 1 (model.layers.1)"
        and "attn_temperature_tuning" in findings[-1][1]
    )


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_qwen3_moe, tiny_mixtral])
def test_scorer_accepts_full_causal_attention_models(build) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert PolicyScorer(build()).vocab_size == VOCAB
    wrapped = build()  # a trainer's activation-checkpointing wrapper around each layer
    for i, layer in enumerate(wrapped.model.layers):
        wrapped.model.layers[i] = checkpoint_wrapper(layer)
    assert PolicyScorer(wrapped).vocab_size == VOCAB


LENGTHS = [9, 4, 12, 6]


@pytest.mark.parametrize("window", [max(LENGTHS), 5])
def test_sliding_window_scores_equal_each_sample_alone(window: int) -> None:
    config = PlanConfig(seq_len=40, pad_to_multiple_of=8)
    (mb,) = prepare_batch(make_samples(0, LENGTHS), config, dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    options = dict(use_sliding_window=True, max_window_layers=0)
    scorer = PolicyScorer(tiny_qwen3(seed=3, sliding_window=window, **options))
    ref_model = tiny_qwen3(seed=3, sliding_window=window, **options)
    ref_model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = scorer.score(tmb)
        ref_lp, _, ref_valid = reference(ref_model, mb)
    assert torch.equal(out.valid_mask, ref_valid)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=TOL, rtol=0)
