"""Which models packed scoring can score exactly: checked once, when a scorer wraps a model.

Packed scoring puts several samples in one row and keeps them apart in one place only: the
attention function (:mod:`rollfeed.models.packing_attention`), which attends within each sample.
That is exact for what it implements: causal full attention, grouped-query heads, rope computed
from ``position_ids`` (which restart at 0 per sample), sliding windows (a per-sample band),
attention sinks (gpt-oss) and value heads of another size than the query/key heads (MLA,
DeepSeek-V3). Anything else would mix samples or drop a term without an error, so
:func:`check_packable` refuses every layer where it detects:

- a layer type other than full or sliding attention in ``config.layer_types``: linear attention
  (Gated DeltaNet in Qwen3-Next and Qwen3.5), chunked attention (Llama-4), ...;
- a decoder layer whose token mixer is not attention, or that holds a recurrent, state-space or
  convolutional mixer (``linear_attn``, ``mamba``, ...): its state runs across the whole row;
- chunked attention from ``config.attention_chunk_size`` on a model without layer types;
- query scaling by the token's index in the row (``attn_temperature_tuning`` on Llama-4's NoPE
  layers computes positions with ``arange`` over the row, not from ``position_ids``);
- attention logit soft-capping and non-causal attention modules.

Example: a two-layer Qwen3-Next with ``layer_types = ["linear_attention", "full_attention"]``::

    check_packable(model)  ->  UnpackableAttentionError: ... layer 0 (model.layers.0):
        linear attention (layer type 'linear_attention'), token mixer linear_attn is a
        Qwen3NextGatedDeltaNet ...
"""

from __future__ import annotations

import re

from torch import nn

from rollfeed.models.errors import UnpackableAttentionError

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


def _layer_type_feature(layer_type: str, config: object) -> str:
    if layer_type == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        return (
            f"chunked attention (layer type 'chunked_attention', chunks of {chunk} tokens counted "
            "over the row, not per sample)"
        )
    if layer_type == "linear_attention":
        return "linear attention (layer type 'linear_attention')"
    return f"layer type {layer_type!r}"


# Wrappers a trainer puts around a layer (activation checkpointing, FSDP1, torch.compile).
_WRAPPED = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def _unwrap(layer: nn.Module) -> nn.Module:
    inner = next(
        (getattr(layer, a) for a in _WRAPPED if isinstance(getattr(layer, a, None), nn.Module)),
        None,
    )
    return layer if inner is None else _unwrap(inner)


def _mixer_features(layer: nn.Module) -> list[str]:
    children = dict(_unwrap(layer).named_children())
    found = [
        f"token mixer {attr} is a {type(child).__name__}, whose state runs across sample boundaries"
        for attr, child in children.items()
        if _MIXER_ATTR.search(attr) or _MIXER_CLASS.search(type(child).__name__)
    ]
    if not found and not any(_ATTENTION.search(attr) for attr in children):
        found.append(f"no attention module among its children {sorted(children)}")
    return found


def _attention_features(module: nn.Module) -> list[str]:
    found = []
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
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


def unpackable_features(model: nn.Module) -> list[tuple[str, str]]:
    """``(layer, feature)`` for every feature packed attention cannot reproduce (see module doc);
    empty when the model can be scored packed exactly."""
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
        if i < len(layer_types) and layer_types[i] not in SUPPORTED_LAYER_TYPES:
            features.append(_layer_type_feature(layer_types[i], config))
        elif not layer_types and chunk is not None:
            features.append(f"chunked attention (attention_chunk_size={chunk}, over the row)")
        features += _mixer_features(layer)
        for module in layer.modules():
            features += _attention_features(module)
        findings += [(where, feature) for feature in dict.fromkeys(features)]
    return findings


def check_packable(model: nn.Module) -> None:
    """Raise :class:`UnpackableAttentionError` listing every layer and feature that packed scoring
    cannot reproduce exactly (see module doc); return quietly otherwise. Reads only the config and
    the module tree (no forward, no device work)."""
    findings = unpackable_features(model)
    if findings:
        raise UnpackableAttentionError(type(model).__name__, findings)
