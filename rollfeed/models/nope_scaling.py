"""Llama-4's NoPE attention layers over packed rows: query scaling by each token's position in
its sample.

Llama-4's layers without rope scale their queries by ``1 + attn_scale · log(1 + floor((p + 1) /
floor_scale))`` (attention temperature tuning, Nakanishi, "Scalable-Softmax Is Superior for
Attention", arXiv:2501.19399), ``p`` the token's position. The stock attention takes ``p`` from
``arange`` over the row it is given — over a packed row the index in the row, and under ``cp``
the index in the rank's shard — and its decoder layer does not pass ``position_ids`` down. The
scorer installs :func:`nope_attention_forward` as such a layer's ``forward``: the same
projections and formula (in float32, as the stock layer computes it), with ``p`` the position
ids of the packed layout (each sample's own positions, this rank's tokens), then packed
attention. Rope layers need nothing: their rope comes from the position ids already.

Example, a row of two samples [3, 2], ``floor_scale = 2``, ``attn_scale = 0.1``::

    p      [0, 1, 2, 0, 1]   (the stock layer would use [0, 1, 2, 3, 4])
    scale  [1, 1.0693, 1.0693, 1, 1.0693]
"""

from __future__ import annotations

import torch
from torch import nn

from rollfeed.models.errors import PackingError
from rollfeed.models.packing_attention import PackedLayout, packed_attention_forward

_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def is_nope_scaled_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-4 attention layer without rope whose queries are scaled by
    position (the layer this file runs)."""
    names = set(dict(module.named_children()))
    return (
        type(module).__name__ == "Llama4TextAttention"
        and set(_PARTS) <= names
        and not getattr(module, "use_rope", True)
        and bool(getattr(module, "attn_temperature_tuning", False))
        and not hasattr(module, "qk_norm")
    )


def query_scales(position_ids: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """``[n]`` positions -> ``[n]`` float32 query scales (see the module doc)."""
    p = position_ids.float()
    return torch.log1p(torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


def nope_attention_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: object = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: object = None,
    *,
    packing: PackedLayout,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The layer's forward over this rank's ``[1, S/cp, hidden]`` tokens -> ``([1, S/cp, hidden],
    None)``, queries scaled by ``packing.position_ids``."""
    del position_embeddings, attention_mask, kwargs
    batch, tokens = hidden_states.shape[:2]
    if past_key_values is not None or packing.position_ids.numel() != batch * tokens:
        raise PackingError(
            f"packed NoPE attention scores one packed row without a cache; got {tokens} tokens "
            f"for {packing.position_ids.numel()} position ids, cache "
            f"{type(past_key_values).__name__}",
            layer=getattr(module, "layer_idx", None),
        )
    shape = (batch, tokens, -1, module.head_dim)
    query = module.q_proj(hidden_states).view(shape)
    key = module.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    scales = query_scales(packing.position_ids, module.floor_scale, module.attn_scale)
    query = (query * scales.view(1, tokens, 1, 1)).to(query.dtype).transpose(1, 2)
    out, _ = packed_attention_forward(
        module,
        query,
        key,
        value,
        None,
        packing=packing,
        scaling=module.scaling,
        dropout=module.attention_dropout,
    )
    return module.o_proj(out.reshape(batch, tokens, -1)), None
