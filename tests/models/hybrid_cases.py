"""Cases for the hybrid families packed scoring runs with layers of its own: Qwen3-Next and
Qwen3.5-MoE (Gated DeltaNet layer 0, gated full attention layer 1) and Llama-4 (layer 0 rope and
chunked attention in chunks of 8, layer 1 NoPE with query scaling, ``floor_scale`` 4 so the scale
moves every 4 positions; top-1 of 8 experts). Shared with the cp and sharded rank scripts.

Sample lengths (:data:`LENGTHS`) mix a sample shorter than the conv kernel (3 < 4), one crossing
the delta rule's 64-token chunk (70) and ones crossing Llama-4's 8-token chunks. The reference
runs each sample alone through a model with rollfeed's layers (float64 kernels) and a one-sample
packing layout, its routers patched by hand to the recorded ids
(:func:`tests.models.family_cases.hand_routed_forward`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rollfeed.models.packing_attention import packed_layout, register_packed_attention
from rollfeed.models.packing_modules import install_packed_forwards
from rollfeed.models.router_replay import Routing, find_routers
from tests.dist.policy_cases import make_samples, own_routing
from tests.models.family_cases import hand_routed_forward
from tests.models.tiny_moe import tiny_moe

HYBRIDS = ("qwen3_next", "qwen3_5_moe", "llama4")
LENGTHS = [3, 70, 11, 20]
CHUNK = 8
OVERRIDES: dict[str, dict[str, object]] = {
    "llama4": dict(
        attention_chunk_size=CHUNK, floor_scale=4, no_rope_layers=[1, 0], num_local_experts=8
    ),
}


def hybrid_model(family: str, seed: int, **overrides: object) -> nn.Module:
    """The tiny float64 model of ``family`` (stock layers). The Gated DeltaNet's decay rates are
    drawn near 0.4 per token instead of up to 16 (the stock init), so the state carries from
    token to token and the decay parameters get gradients well above the tolerances."""
    model = tiny_moe(family, seed=seed, **{**OVERRIDES.get(family, {}), **overrides})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.normal_(-1.0, 0.3)
    return model


def rollfeed_model(family: str, seed: int, **overrides: object) -> nn.Module:
    """:func:`hybrid_model` with rollfeed's packed attention and layers installed, as a scorer
    installs them."""
    model = hybrid_model(family, seed, **overrides)
    model.set_attn_implementation(register_packed_attention())
    install_packed_forwards(model)
    return model


def hybrid_samples(family: str, seed: int, lengths: list[int], *, weights: bool = False):
    """Samples with masks and routing other than the model's own (shifted by 3 of 8 experts),
    with random recorded weights when ``weights``."""
    tokens = [s.token_ids for s in make_samples(seed, lengths)]
    routing = own_routing(hybrid_model(family, seed), tokens)
    return make_samples(seed, lengths, own_routing=routing, routing_weights=weights)


def alone_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One sample ``ids [T]`` through a :func:`rollfeed_model` with a one-sample layout ->
    logits ``[T, V]``."""
    positions = torch.arange(ids.numel())
    chunk = CHUNK if "chunked_attention" in model.config.layer_types else None
    layout = packed_layout(positions, chunk_size=chunk)
    out = model(input_ids=ids[None], position_ids=positions[None], packing=layout, use_cache=False)
    return out.logits[0]


@contextmanager
def hand_routing(model: nn.Module, family: str, routing: Routing) -> Iterator[None]:
    """Every router of ``model`` patched by hand to the recorded ids of the covered rows (the
    router's own choice elsewhere) and the family's weights for them, or the recorded weights
    when ``routing.weights`` is given."""
    covered = routing.covered
    sites = find_routers(model)
    for layer, site in enumerate(sites):
        router = site.router
        ids = routing.experts[:, layer].long()
        weights = None if routing.weights is None else routing.weights[:, layer]
        router.forward = _patched(router, family, ids, covered, weights)
    try:
        yield
    finally:
        for site in sites:
            del site.router.forward


def _patched(router, family: str, ids, covered, weights):
    def forward(hidden: torch.Tensor):
        own = type(router).forward(router, hidden)
        dense = family == "llama4"
        own_ids = own[1].topk(router.top_k, dim=1).indices if dense else own[2]
        chosen = torch.where(covered[:, None], ids, own_ids)
        out = hand_routed_forward(router, family, chosen)(hidden)
        if weights is None:
            return out
        if dense:  # (dense scores [N, E], logits): the recorded weight at the id
            recorded = torch.zeros_like(out[0]).scatter(1, chosen, weights.to(out[0].dtype))
            return torch.where(covered[:, None], recorded, out[0]), out[1]
        logits, formula, _ = out
        return logits, torch.where(covered[:, None], weights.to(formula.dtype), formula), chosen

    return forward


def float64_norms(model: nn.Module) -> nn.Module:
    """``model`` with its zero-centred RMSNorms (Qwen3-Next's, Qwen3.5's: ``(1 + w)`` applied in
    float32 whatever the dtype, so their weights' gradients are float32 sums over the row)
    computed in the input's dtype: the same formula, exact in float64."""
    for module in model.modules():
        if type(module).__name__ in ("Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm"):
            module.forward = functools.partial(_zero_centred_norm, module)
    return model


def _zero_centred_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight)
