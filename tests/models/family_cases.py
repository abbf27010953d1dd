"""Scoring cases for the MoE families the scorer runs end to end (shared with the cp rank script).

Each family's tiny float64 model has 8 experts, top-2, 2 MoE layers (the shape of
:mod:`tests.dist.policy_cases`), and the attention features the family brings: DeepSeek-V3's MLA
with a value head (20) narrower than its query/key head (24), gpt-oss's sliding window (4 tokens,
shorter than most samples) on layer 0 and its attention sinks, GLM-4.5's and MiniMax-M2's plain
GQA attention with sigmoid routers. The reference runs each sample alone through the stock model
(eager attention for gpt-oss, whose sdpa path drops the sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.policy_cases import make_samples, own_routing
from tests.models.tiny_moe import tiny_moe

SCORED = ("deepseek_v3", "gpt_oss", "glm4_moe", "minimax_m2")
TOL = 1e-10
# DeepSeek-V3 and GLM-4.5 routers compute in float32, also in a float64 model: a float32 GEMM
# rounds differently for another number of rows (packed vs alone, a cp shard vs the whole row), and
# that reaches the mixing weights (measured: 6e-9 on logprobs) and the router weight's gradient
# (1e-7 relative). Their formula path agrees to float32; with recorded weights to TOL.
FP32_ROUTERS = ("deepseek_v3", "glm4_moe")


def tolerance(family: str, name: str = "", *, recorded_weights: bool = False) -> dict:
    """``assert_close`` tolerances of a value (``name`` empty) or a parameter's gradient."""
    if family not in FP32_ROUTERS or recorded_weights:
        return dict(atol=TOL, rtol=0)
    if name.endswith("mlp.gate.weight"):
        return dict(atol=1e-6, rtol=1e-5)
    return dict(atol=1e-7, rtol=1e-6)


OVERRIDES: dict[str, dict[str, object]] = {
    "deepseek_v3": dict(v_head_dim=20),
    "gpt_oss": dict(num_local_experts=8),
}


def scoring_model(family: str, seed: int) -> torch.nn.Module:
    model = tiny_moe(family, seed=seed, **OVERRIDES.get(family, {}))
    if family == "gpt_oss":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.normal_(0.0, 1.0)
    return model


def reference_model(family: str, seed: int) -> torch.nn.Module:
    model = scoring_model(family, seed)
    model.set_attn_implementation("eager" if family == "gpt_oss" else "sdpa")
    return model


def routed_samples(family: str, seed: int, lengths: list[int], *, weights: bool = False):
    """Samples with masks and routing other than the model's own (ids shifted by 3 experts), with
    random recorded weights when ``weights``."""
    tokens = [s.token_ids for s in make_samples(seed, lengths)]
    routing = own_routing(reference_model(family, seed), tokens)
    return make_samples(seed, lengths, own_routing=routing, routing_weights=weights)


def hand_routed_forward(router: nn.Module, family: str, ids: torch.Tensor):
    """The family's router forward, written from its formula (independently of
    :mod:`rollfeed.models.router_families`), returning ``ids [N, K]`` instead of its own choice
    (and the weights the family gives them)."""

    def forward(hidden: torch.Tensor, *bias: torch.Tensor):
        hidden = hidden.reshape(-1, router.weight.shape[1])
        if family in ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "olmoe"):
            logits = F.linear(hidden, router.weight)
            top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
            if family == "qwen3_5_moe" or router.norm_topk_prob:  # Qwen3.5 always normalises
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), ids
        if family == "mixtral":
            logits = F.linear(hidden, router.weight)
            top = torch.softmax(logits.float(), dim=-1).gather(1, ids)
            return logits, top / top.sum(dim=-1, keepdim=True), ids
        if family == "gpt_oss":
            logits = F.linear(hidden, router.weight, router.bias)
            return logits, torch.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype), ids
        if family in ("deepseek_v3", "glm4_moe"):
            logits = F.linear(hidden.float(), router.weight.float())
            top = logits.sigmoid().gather(1, ids)
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, top * router.routed_scaling_factor, ids
        if family == "minimax_m2":
            logits = F.linear(hidden, router.weight)
            top = torch.sigmoid(logits.float()).gather(1, ids)
            return logits, top / top.sum(dim=-1, keepdim=True), ids
        assert family == "llama4"
        logits = F.linear(hidden, router.weight)
        dense = torch.full_like(logits, float("-inf")).scatter(1, ids, logits.gather(1, ids))
        return torch.sigmoid(dense.float()).to(logits.dtype), logits

    return forward
