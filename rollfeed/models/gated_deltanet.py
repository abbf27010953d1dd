"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE) over packed rows, split over ``cp`` (Ulysses).

The layer's own projections, conv weight, decay parameters, gated norm and output projection are
used; rollfeed supplies the sample boundaries to the two kernels that carry state along the row
(:mod:`rollfeed.models.delta_rule`), the way packed attention does for attention. The
scorer installs :func:`gated_deltanet_forward` as each such layer's ``forward``.

Under ``cp`` the layer exchanges heads for sequence like attention does (DeepSpeed-Ulysses): one
all-to-all after the input projections hands each rank a group of ``nk / cp`` key heads with
their value heads, for the whole row: its q, k, v (the matching conv channels of each block) and
its b, a (beta and the decay); the row is put in sample order before the conv and the recurrence
(zigzag included) and back after, and a second all-to-all returns the core output to row shards.
The gate ``z`` enters only the per-token, per-head norm after that return, so it stays local.
On a row holding prefix trees both kernels fork at each branch point: a branch starts from its
prefix's final recurrent state and convolves its prefix's last ``conv_kernel - 1`` inputs
(:mod:`rollfeed.models.delta_rule`).
``cp`` must divide the key heads (:func:`~rollfeed.models.packing_support.check_packable`).

Shapes, ``s = S / cp`` local tokens, ``nk`` key heads of ``dk``, ``nv = r · nk`` value heads of
``dv``, per key head the features ``F = 2 dk + r (dv + 2)`` (q, k, its r value heads' v, b, a)::

    in_proj_*      [1, s, hidden] -> per key head [1, s, nk, F], z [1, s, nv, dv]
    seq_to_heads   [1, s, nk, F]  -> [1, S, nk / cp, F]          (canonical order after this)
    conv, rule     [S, ...]       -> core [1, S, nv / cp, dv]
    heads_to_seq   core           -> [1, s, nv, dv] -> norm(core, z) -> out_proj [1, s, hidden]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollfeed.models.delta_rule import causal_conv1d_packed, gated_delta_rule_packed
from rollfeed.models.errors import PackingError
from rollfeed.models.packing_attention import PackedLayout
from rollfeed.models.ulysses import heads_to_seq, seq_to_heads

# The two projection layouts: Qwen3-Next's fused, grouped per key head; Qwen3.5's split, blocked.
_LAYOUTS = (("in_proj_qkvz", "in_proj_ba"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
_PARTS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether ``module`` is a Gated DeltaNet layer this file runs: one of the two projection
    layouts, a depthwise ``conv1d`` with SiLU, and the decay, norm and output parts."""
    names = set(dict(module.named_children())) | set(dict(module.named_parameters(recurse=False)))
    return (
        type(module).__name__.endswith("GatedDeltaNet")
        and any(set(layout) <= names for layout in _LAYOUTS)
        and set(_PARTS) <= names
        and getattr(module, "activation", None) in ("silu", "swish")
        and all(
            hasattr(module, a) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
        )
    )


def _per_key_head(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, s, hidden]`` -> ``(features [1, s, nk, F], z [1, s, nv, dv])``, the features of each
    key head laid out (q, k, v of its value heads, b, a), as in the module doc."""
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    r, (one, s) = nv // nk, hidden.shape[:2]
    if hasattr(module, "in_proj_qkvz"):
        qkvz = module.in_proj_qkvz(hidden).view(one, s, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = module.in_proj_ba(hidden).view(one, s, nk, 2 * r).split([r, r], dim=-1)
    else:
        q, k, v = module.in_proj_qkv(hidden).split([nk * dk, nk * dk, nv * dv], dim=-1)
        q, k, v = q.view(one, s, nk, dk), k.view(one, s, nk, dk), v.view(one, s, nk, r * dv)
        z = module.in_proj_z(hidden)
        b, a = (p(hidden).view(one, s, nk, r) for p in (module.in_proj_b, module.in_proj_a))
    return torch.cat([q, k, v, b, a], dim=-1), z.reshape(one, s, nv, dv)


def _conv_params(
    module: nn.Module, heads: slice, cp_enabled: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The conv weight ``[C, K]`` and bias ``[C]`` (or None) of this rank's channels: its key
    heads' rows of the q and k blocks and its value heads' rows of the v block."""
    weight, bias = module.conv1d.weight[:, 0], module.conv1d.bias
    if not cp_enabled:
        return weight, bias
    dk, dv, r = module.head_k_dim, module.head_v_dim, module.num_v_heads // module.num_k_heads
    key_dim = module.num_k_heads * dk
    q_rows = torch.arange(heads.start * dk, heads.stop * dk, device=weight.device)
    v_rows = torch.arange(heads.start * r * dv, heads.stop * r * dv, device=weight.device)
    rows = torch.cat([q_rows, q_rows + key_dim, v_rows + 2 * key_dim])
    return weight[rows], None if bias is None else bias[rows]


def gated_deltanet_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    cache_params: object = None,
    attention_mask: torch.Tensor | None = None,
    *,
    packing: PackedLayout,
    **kwargs: object,
) -> torch.Tensor:
    """The layer's forward over this rank's ``[1, S/cp, hidden]`` tokens of a packed row ->
    ``[1, S/cp, hidden]``, samples kept apart and the row split over ``packing.cp``."""
    del kwargs
    if cache_params is not None or attention_mask is not None or hidden_states.shape[0] != 1:
        raise PackingError(
            "packed Gated DeltaNet scores one packed row without a cache or a padding mask; got "
            f"batch {hidden_states.shape[0]}, cache {type(cache_params).__name__}, mask "
            f"{None if attention_mask is None else tuple(attention_mask.shape)}",
            layer=getattr(module, "layer_idx", None),
        )
    cp = packing.cp
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    r, local = nv // nk, nk // cp.size
    features, z = _per_key_head(module, hidden_states)
    features = seq_to_heads(features, cp, seq_dim=1, head_dim=2)[0]  # [S, nk / cp, F]
    if features.shape[0] != packing.length:
        raise PackingError(
            f"packing layout covers {packing.length} tokens, the linear-attention layer sees "
            f"{features.shape[0]}; build the layout from this forward's position ids",
            layer=getattr(module, "layer_idx", None),
        )
    if packing.inverse is not None:
        features = features.index_select(0, packing.inverse)
    rows = features.shape[0]
    q, k, v, b, a = features.split([dk, dk, r * dv, r, r], dim=-1)
    mixed = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
    heads = slice(cp.rank * local, (cp.rank + 1) * local)
    tree = packing.tree
    conv = _conv_params(module, heads, cp.enabled)
    history = None if tree is None else tree.history(conv[0].shape[1])
    mixed = causal_conv1d_packed(mixed, *conv, packing.samples, history=history)
    q, k, v = mixed.split([local * dk, local * dk, local * r * dv], dim=-1)
    values = slice(heads.start * r, heads.stop * r)
    beta = b.reshape(rows, -1).sigmoid()
    # The layer's decay, in float32 at least (in half precision A would overflow to -inf) and in
    # float64 for a float64 model (the stock layer computes it in float32 whatever the dtype).
    exact = torch.promote_types(module.A_log.dtype, torch.float32)
    decay = -module.A_log[values].to(exact).exp()
    g = decay * F.softplus(a.reshape(rows, -1).to(exact) + module.dt_bias[values])
    q, k = (x.reshape(rows, local, dk).repeat_interleave(r, dim=1) for x in (q, k))
    core = gated_delta_rule_packed(
        q,
        k,
        v.reshape(rows, -1, dv),
        g,
        beta,
        packing.samples,
        parents=None if tree is None else tree.parents,
    )
    if packing.inverse is not None:
        core = core.index_select(0, packing.order)
    core = heads_to_seq(core[None], cp, seq_dim=1, head_dim=2)  # [1, s, nv, dv]
    out = module.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return module.out_proj(out.reshape(*hidden_states.shape[:2], -1))
