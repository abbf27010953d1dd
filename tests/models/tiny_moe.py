"""Tiny float64 MoE models of each router family, built locally from a config (no downloads).

Router weights are widened (the random init puts them near zero, or at zero for the sigmoid
routers) so top-k choices are clear and replaying other ids changes the output visibly; the
correction biases and gpt-oss's router bias get random values so that they matter. Experts run
the per-expert loop (``set_experts_implementation("eager")``), which takes float64.
"""

from __future__ import annotations

import torch
import transformers
from transformers import (
    DeepseekV3ForCausalLM,
    Glm4MoeForCausalLM,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    MiniMaxM2ForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen3NextForCausalLM,
)

from tests.models.tiny import tiny_config

_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8)
_GROUPED = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=0,
    norm_topk_prob=True,
)

# family -> (config class name, model class, config overrides)
FAMILIES: dict[str, tuple[str, type, dict[str, object]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        Qwen3MoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        Qwen3NextForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        Qwen3_5MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "olmoe": (
        "OlmoeConfig",
        OlmoeForCausalLM,
        dict(num_experts=8, num_experts_per_tok=2, head_dim=16, norm_topk_prob=False),
    ),
    "gpt_oss": (
        "GptOssConfig",
        GptOssForCausalLM,
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        DeepseekV3ForCausalLM,
        dict(
            **_GROUPED,
            **_MLA,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            v_head_dim=24,
            head_dim=8,
            num_key_value_heads=4,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        Glm4MoeForCausalLM,
        dict(**_GROUPED, n_group=2, topk_group=1, routed_scaling_factor=1.5),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        MiniMaxM2ForCausalLM,
        dict(num_local_experts=8, num_experts_per_tok=2),
    ),
    "llama4": (
        "Llama4TextConfig",
        Llama4ForCausalLM,
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=96,
            attention_chunk_size=64,
            no_rope_layers=[1, 1],
        ),
    ),
}


def tiny_moe(family: str, *, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A float64 tiny model of ``family`` (a key of :data:`FAMILIES`), eval mode."""
    config_name, model_class, options = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**tiny_config(**{**options, **overrides}))
    model = model_class(config)
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                param.normal_(0.0, 1.0)
            elif name.endswith("router.bias"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model.to(torch.float64).eval()
