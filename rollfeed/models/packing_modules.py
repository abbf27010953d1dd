"""The layers packed scoring runs with a forward of its own, installed when a scorer wraps a model.

Attention layers keep their own forward and reach packed attention through transformers'
attention registry (:mod:`rollfeed.models.packing_attention`). Two kinds of layer compute
something the registry never sees, so the scorer replaces their ``forward`` on the instance,
with one that uses the layer's own parameters and submodules and reads the packed layout:

- Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE):
  :func:`~rollfeed.models.gated_deltanet.gated_deltanet_forward`;
- Llama-4's NoPE attention with query scaling:
  :func:`~rollfeed.models.nope_scaling.nope_attention_forward`.

The replacement stays for the model's life, like the attention implementation the scorer sets:
a backward that recomputes a checkpointed layer recomputes it the same way. Such a model's
forward then needs ``packing=`` (as packed attention does).

Example: a Qwen3-Next with layers [linear, full] -> ``["model.layers.0.linear_attn"]`` replaced.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from rollfeed.models.delta_rule import kernel_names
from rollfeed.models.gated_deltanet import gated_deltanet_forward, is_gated_deltanet
from rollfeed.models.nope_scaling import is_nope_scaled_attention, nope_attention_forward

logger = logging.getLogger(__name__)


def packed_forward(module: nn.Module) -> Callable[..., object] | None:
    """The forward packed scoring runs ``module`` with, or None when its own is exact."""
    if is_gated_deltanet(module):
        return gated_deltanet_forward
    if is_nope_scaled_attention(module):
        return nope_attention_forward
    return None


def install_packed_forwards(model: nn.Module) -> list[str]:
    """Replace the ``forward`` of every layer of ``model`` that :func:`packed_forward` names
    (idempotent); return their module paths."""
    installed = []
    for name, module in model.named_modules():
        forward = packed_forward(module)
        if forward is None:
            continue
        current = module.__dict__.get("forward")
        if not (isinstance(current, functools.partial) and current.func is forward):
            module.forward = functools.partial(forward, module)
        installed.append(name)
    if any(is_gated_deltanet(m) for m in model.modules()):
        param = next(model.parameters(), None)
        if param is not None:
            device, dtype = param.device, param.dtype
            logger.info(
                "Gated DeltaNet kernels for %s %s: %s",
                device,
                dtype,
                kernel_names(device, dtype if dtype.is_floating_point else torch.float32),
            )
    return installed
