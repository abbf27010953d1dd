"""Tiny HF causal LMs built locally from a config (random weights, no downloads).

The model classes are imported with this module, not when a model is built: rank scripts import it
before ``init_process_group``, so no module that takes ``group.WORLD`` as a default argument
(transformers' model code imports ``torch.distributed.nn.functional``) captures the default process
group and keeps it alive past ``destroy_process_group`` (see ``tests/dist/launch.py``).
"""

from __future__ import annotations

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from rollfeed.models.packing_attention import register_packed_attention

VOCAB = 128


def tiny_config(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return base


def _finish(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    model.set_attn_implementation(register_packed_attention())
    if hasattr(model.config, "_experts_implementation"):
        # The grouped-mm expert kernels refuse float64; the per-expert loop takes any dtype.
        model.set_experts_implementation("eager")
    return model.to(dtype).eval()


def tiny_qwen3(*, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: object):
    torch.manual_seed(seed)
    return _finish(Qwen3ForCausalLM(Qwen3Config(**tiny_config(**overrides))), dtype)


def tiny_qwen3_moe(*, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: object):
    torch.manual_seed(seed)
    cfg = tiny_config(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    )
    cfg.update(overrides)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    # Random init puts router weights near zero (near-uniform routing); widen them so top-k choices
    # are clear and replaying other ids changes the output visibly.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 1.0)
    return _finish(model, dtype)


def tiny_mixtral(*, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: object):
    torch.manual_seed(seed)
    cfg = tiny_config(num_local_experts=4, num_experts_per_tok=2)
    cfg.update(overrides)
    model = MixtralForCausalLM(MixtralConfig(**cfg))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 1.0)
    return _finish(model, dtype)
