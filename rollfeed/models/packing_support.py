"""Which models packed scoring can score exactly: checked once, when a scorer wraps a model.

Packed scoring puts several samples in one row and keeps them apart where tokens meet: the
attention function (:mod:`rollfeed.models.packing_attention`), which attends within each sample,
and the layers the scorer runs with its own forward (:mod:`rollfeed.models.packing_modules`).
That is exact for what they implement: causal full attention, grouped-query heads, rope computed
from ``position_ids`` (which restart at 0 per sample), sliding windows (a per-sample band),
attention sinks (gpt-oss), value heads of another size than the query/key heads (MLA,
DeepSeek-V3), chunked attention counted from each sample's first token (Llama-4's
``chunked_attention`` layers), Llama-4's NoPE query scaling from the position ids, and Gated
DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE: conv and delta-rule state reset per sample).
Anything else would mix samples or drop a term without an error, so :func:`check_packable`
refuses every layer where it detects:

- a layer type other than full, sliding, chunked or (Gated DeltaNet) linear attention in
  ``config.layer_types``, or one of the latter two on a layer that does not hold what packing
  runs (an attention module with the config's ``attention_chunk_size``; a Gated DeltaNet);
- a decoder layer whose token mixer is not attention, or that holds a recurrent, state-space or
  convolutional mixer other than a Gated DeltaNet (``mamba``, ...): its state runs across the row;
- a Gated DeltaNet whose key heads the ``cp`` group cannot split (``cp`` must divide them);
- chunked attention from ``config.attention_chunk_size`` on a model without layer types;
- query scaling by the token's index in the row (``attn_temperature_tuning``) on a layer other
  than Llama-4's NoPE attention;
- attention logit soft-capping and non-causal attention modules.

Example: a two-layer Mamba-attention hybrid with ``layer_types = ["mamba", "full_attention"]``::

    check_packable(model)  ->  UnpackableAttentionError: ... layer 0 (model.layers.0):
        layer type 'mamba', token mixer mamba is a MambaMixer, whose state runs across sample
        boundaries
"""

from __future__ import annotations

import re

from torch import nn

from rollfeed.models.errors import UnpackableAttentionError
from rollfeed.models.gated_deltanet import is_gated_deltanet
from rollfeed.models.nope_scaling import is_nope_scaled_attention

SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Token mixers that are not attention (they carry state along the row), by attribute name
# (snake_case) or class name (CamelCase; case-sensitive, so "GptOssMLP" is not an "SSM").
_MIXER_ATTR = re.compile(r"mamba|deltanet|linear_attn|ssm|rwkv|recurren|retention|hyena|conv")
_MIXER_CLASS = re.compile(
    r"Mamba|DeltaNet|LinearAttention|SSM|Rwkv|RWKV|Recurren|Retention|Hyena|Conv"
)
_ATTENTION = re.compile(r"attn|attention", re.I)
_NOT_TEXT = re.compile(r"vision|visual|audio")


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` of the text decoder's layers: the first ``ModuleList`` named ``layers``
    outside a vision or audio tower."""
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and name.rsplit(".", 1)[-1] == "layers"
            and not _NOT_TEXT.search(name)
        ):
            return [(f"{name}.{i}", layer) for i, layer in enumerate(module)]
    return []


def _layer_type_feature(
    layer_type: str, config: object, layer: nn.Module, index: int
) -> str | None:
    """Why a layer of ``layer_type`` cannot be packed, or None when it can."""
    if layer_type in SUPPORTED_LAYER_TYPES:
        return None
    if layer_type == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        if isinstance(chunk, int) and chunk > 0 and _attends_as(layer, index):
            return None
        return (
            f"chunked attention (layer type 'chunked_attention', chunks of {chunk} tokens) on a "
            "layer whose attention module does not name its layer (layer_idx) and config"
        )
    if layer_type == "linear_attention":
        if any(is_gated_deltanet(m) for m in _unwrap(layer).children()):
            return None
        return "linear attention (layer type 'linear_attention') other than a Gated DeltaNet"
    return f"layer type {layer_type!r}"


def _attends_as(layer: nn.Module, index: int) -> bool:
    """Whether the layer's attention module carries ``layer_idx == index`` and the config whose
    ``layer_types`` packed attention reads to find the layer's chunks."""
    return any(
        getattr(m, "layer_idx", None) == index
        and hasattr(getattr(m, "config", None), "layer_types")
        for m in layer.modules()
        if _ATTENTION.search(type(m).__name__)
    )


# Wrappers a trainer puts around a layer (activation checkpointing, FSDP1, torch.compile).
_WRAPPED = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def _unwrap(layer: nn.Module) -> nn.Module:
    inner = next(
        (getattr(layer, a) for a in _WRAPPED if isinstance(getattr(layer, a, None), nn.Module)),
        None,
    )
    return layer if inner is None else _unwrap(inner)


def _mixer_features(layer: nn.Module, cp_size: int) -> list[str]:
    children = dict(_unwrap(layer).named_children())
    found = [
        f"token mixer {attr} is a {type(child).__name__}, whose state runs across sample boundaries"
        for attr, child in children.items()
        if (_MIXER_ATTR.search(attr) or _MIXER_CLASS.search(type(child).__name__))
        and not is_gated_deltanet(child)
    ]
    found += [
        f"token mixer {attr} ({type(child).__name__}) has {child.num_k_heads} key heads, which "
        f"cp={cp_size} ranks cannot split; choose a cp size dividing {child.num_k_heads}"
        for attr, child in children.items()
        if is_gated_deltanet(child) and child.num_k_heads % cp_size
    ]
    if not found and not any(_ATTENTION.search(attr) for attr in children):
        found.append(f"no attention module among its children {sorted(children)}")
    return found


def _attention_features(module: nn.Module) -> list[str]:
    found = []
    tuned = getattr(module, "attn_temperature_tuning", False) and not getattr(
        module, "use_rope", True
    )
    if tuned and not is_nope_scaled_attention(module):
        found.append(
            "query scaling by the token's index in the row (attn_temperature_tuning, floor_scale="
            f"{getattr(module, 'floor_scale', None)}), not by its position in its sample"
        )
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        found.append(f"attention logit soft-capping ({softcap})")
    if getattr(module, "is_causal", True) is False:
        found.append("non-causal attention")
    return found


def unpackable_features(model: nn.Module, cp_size: int = 1) -> list[tuple[str, str]]:
    """``(layer, feature)`` for every feature packed scoring cannot reproduce over a ``cp`` group
    of ``cp_size`` ranks (see module doc); empty when the model can be scored packed exactly."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    chunk = getattr(config, "attention_chunk_size", None)
    layers = _decoder_layers(model)
    if not layers:
        return [(type(model).__name__, "no decoder layers found (a ModuleList named 'layers')")]
    findings = []
    for i, (path, layer) in enumerate(layers):
        where = f"layer {i} ({path})"
        features = []
        if i < len(layer_types):
            kind = _layer_type_feature(layer_types[i], config, layer, i)
            features += [] if kind is None else [kind]
        elif not layer_types and chunk is not None:
            features.append(f"chunked attention (attention_chunk_size={chunk}, over the row)")
        features += _mixer_features(layer, cp_size)
        for module in layer.modules():
            features += _attention_features(module)
        findings += [(where, feature) for feature in dict.fromkeys(features)]
    return findings


def check_packable(model: nn.Module, cp_size: int = 1) -> None:
    """Raise :class:`UnpackableAttentionError` listing every layer and feature that packed scoring
    over ``cp_size`` ranks cannot reproduce exactly (see module doc); return quietly otherwise.
    Reads only the config and the module tree (no forward, no device work)."""
    findings = unpackable_features(model, cp_size)
    if findings:
        raise UnpackableAttentionError(type(model).__name__, findings)
