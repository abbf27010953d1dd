"""The LM head's forward is swapped for support scoring during one call of the model's own forward:
hooks on the model and the head fire, the head is restored, and heads it cannot replace exactly are
refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import LMHeadError, PolicyScorer
from tests.dist.policy_cases import make_samples
from tests.models.tiny import tiny_qwen3


def _micro_batch():
    plan = prepare_batch(make_samples(3, [9, 7]), PlanConfig(seq_len=24), dp_size=1)
    return to_tensor_micro_batch(plan[0][0], cp_rank=0)


def test_the_models_own_forward_runs_and_the_head_is_restored():
    model = tiny_qwen3(seed=1)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append("model"))
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append("head"))
    scorer = PolicyScorer(model)
    scorer.score(_micro_batch())
    assert calls == ["model", "head"]  # the hooks a sharded trainer relies on fired, in order
    assert "forward" not in model.lm_head.__dict__
    hidden = torch.randn(1, 5, 64, dtype=torch.float64)
    assert model.lm_head(hidden).shape == (1, 5, 128)  # the plain head is back: logits again


def test_the_head_is_restored_when_the_forward_raises():
    model = tiny_qwen3(seed=1)
    scorer = PolicyScorer(model)

    def boom(module, args):
        raise RuntimeError("layer failed")

    handle = model.model.layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="layer failed"):
        scorer.score(_micro_batch())
    handle.remove()
    assert "forward" not in model.lm_head.__dict__


def test_a_head_with_a_bias_is_refused():
    model = tiny_qwen3(seed=1)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(128, dtype=torch.float64))
    with pytest.raises(LMHeadError, match="bias") as err:
        PolicyScorer(model)
    assert err.value.tensor == "lm_head.bias"


@pytest.mark.parametrize(
    ("name", "value"), [("final_logit_softcapping", 30.0), ("logits_scaling", 4.0)]
)
def test_logits_transformed_after_the_head_are_refused_by_config(name, value):
    model = tiny_qwen3(seed=1)
    setattr(model.config, name, value)
    with pytest.raises(LMHeadError, match=f"config.{name}={value}"):
        PolicyScorer(model)


def test_a_forward_that_changes_the_heads_output_is_refused():
    model = tiny_qwen3(seed=1)
    scorer = PolicyScorer(model)
    model.register_forward_hook(
        lambda module, args, out: out.__class__(logits=torch.tanh(out.logits / 30) * 30)
    )
    with pytest.raises(LMHeadError, match="changed its LM head's output"):
        scorer.score(_micro_batch())


class _LogitsFromTheWeight(Qwen3ForCausalLM):
    """Computes its logits from the head's weight without calling the head module."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        out = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        return CausalLMOutputWithPast(logits=out.last_hidden_state @ self.lm_head.weight.T)


def test_a_forward_that_never_calls_the_head_is_refused():
    model = tiny_qwen3(seed=1)
    model.__class__ = _LogitsFromTheWeight
    with pytest.raises(LMHeadError, match="did not call its LM head"):
        PolicyScorer(model).score(_micro_batch())


def test_an_instance_level_head_forward_is_put_back():
    model = tiny_qwen3(seed=1)
    plain = model.lm_head.forward
    model.lm_head.forward = lambda hidden: plain(hidden)  # e.g. installed by another wrapper
    own = model.lm_head.forward
    PolicyScorer(model).score(_micro_batch())
    assert model.lm_head.forward is own
