"""The attention kernels of packed rows: causal attention within each segment of a row.

A row's segments (:class:`~rollfeed.models.row_segments.Segments`: its samples, or their
chunks on a chunked layer) attend only within themselves. Two kernels compute that:

- **varlen** (CUDA, fp16/bf16): one call over the whole row with the segments' ``cu_seqlens``,
  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) or, where torch lacks it,
  ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed. Causal, with an optional
  left window; grouped-query heads natively;
- **sdpa** (everywhere, the reference): causal SDPA on each segment, segments of equal length
  stacked into one batched call, so at most ``sqrt(2 S)`` calls per layer.

:func:`segment_kernel` picks varlen for what it computes exactly (one row, equal query/key and
value head sizes, no sinks, no dropout, a head size flash kernels take) and sdpa otherwise; both
are exact, so the choice is the device's, never a fallback that changes results.

Example, a row of two samples [3, 2] on CUDA in bf16::

    varlen_attn(q [5, H, d], k, v, cu_seqlens [0, 3, 5], max 3)   one call
    on CPU: sdpa(q[0:3]), sdpa(q[3:5])                             one call per length
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from rollfeed.models.row_segments import Segments

Kernel = Literal["varlen", "sdpa"]
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """The varlen attention function of this installation, as ``f(q, k, v, cu, max_len, *,
    scale, left, gqa, cu_k=None, max_k=None) -> out`` over ``[T, H, d]`` tensors (keys bounded by
    ``cu_k`` when given, else by ``cu``; a causal mask over more keys than queries is aligned to
    the lower right), or None when there is none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None and "window_size" in inspect.signature(varlen_attn).parameters:

        def torch_varlen(q, k, v, cu, max_len, *, scale, left, gqa, cu_k=None, max_k=None):
            return varlen_attn(
                q,
                k,
                v,
                cu,
                cu if cu_k is None else cu_k,
                max_len,
                max_len if max_k is None else max_k,
                scale=scale,
                window_size=(left, 0),
                enable_gqa=gqa,
            )

        return torch_varlen
    try:
        flash = importlib.import_module("flash_attn")
    except ImportError:
        return None

    def flash_varlen(q, k, v, cu, max_len, *, scale, left, gqa, cu_k=None, max_k=None):
        del gqa  # flash-attn takes fewer key/value heads as they come
        return flash.flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            cu if cu_k is None else cu_k,
            max_len,
            max_len if max_k is None else max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=True,
            window_size=(left, 0),
        )

    return flash_varlen


def segment_kernel(
    query: torch.Tensor,
    value: torch.Tensor,
    *,
    sinks: torch.Tensor | None,
    dropout: float,
) -> Kernel:
    """Which kernel :func:`attend_segments` runs for these inputs (see the module doc)."""
    head = query.shape[-1]
    if (
        query.is_cuda
        and query.dtype in _VARLEN_DTYPES
        and query.shape[0] == 1
        and value.shape[-1] == head
        and head % 8 == 0
        and head <= 256
        and sinks is None
        and dropout == 0.0
        and varlen_kernel() is not None
    ):
        return "varlen"
    return "sdpa"


def attend_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    *,
    scale: float | None,
    dropout: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each segment. q ``[B, H, S, dk]``, k ``[B, KV, S, dk]``, v
    ``[B, KV, S, dv]`` (``dv`` may differ from ``dk``: MLA), canonical order -> ``[B, H, S, dv]``.
    ``window``: a sliding window (query ``i`` sees key ``j`` when ``0 <= i - j < window``);
    ``sinks [H]``: per-head sink logits (an extra zero key/value column, see
    :func:`_sample_mask`)."""
    if segment_kernel(query, value, sinks=sinks, dropout=dropout) == "varlen":
        kernel = varlen_kernel()
        assert kernel is not None
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [S, heads, d]
        out = kernel(
            q,
            k,
            v,
            segments.cu_seqlens,
            segments.max_length,
            scale=scale,
            left=-1 if window is None else window - 1,
            gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(0, 1)[None]
    return _sdpa_segments(
        query, key, value, segments, scale=scale, dropout=dropout, window=window, sinks=sinks
    )


def _stack(x: torch.Tensor, starts: tuple[int, ...], length: int) -> torch.Tensor:
    """``[B, H, S, d]`` -> ``[len(starts) * B, H, length, d]``: the samples at ``starts`` stacked
    into the batch dim (a view for a single sample)."""
    if len(starts) == 1:
        return x[:, :, starts[0] : starts[0] + length]
    return torch.cat([x[:, :, s : s + length] for s in starts], dim=0)


def _sample_mask(
    length: int, window: int | None, sinks: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor | None:
    """The attention mask of one sample of ``length`` tokens, or None for plain causal attention.

    ``allowed [L, L]``: causal, and within ``window`` when given (query ``i`` sees key ``j`` when
    ``0 <= i - j < window``, as transformers' sliding window does). With ``sinks [H]`` the mask is
    additive, ``[1, H, L, L + 1]``: 0 where allowed, ``-inf`` elsewhere, and a last column holding
    each head's sink logit, the logit of an extra key whose value is 0 (it takes softmax mass and
    adds nothing). Example, L = 3, window 2, no sinks::

        [[1, 0, 0],
         [1, 1, 0],
         [0, 1, 1]]
    """
    banded = window is not None and window < length
    if sinks is None and not banded:
        return None
    i = torch.arange(length, device=like.device)
    allowed = i[:, None] >= i[None, :]
    if banded:
        allowed &= (i[:, None] - i[None, :]) < window
    if sinks is None:
        return allowed
    bias = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
    bias = bias.masked_fill(~allowed, float("-inf")).expand(sinks.numel(), length, length)
    column = sinks.to(like.dtype).view(-1, 1, 1).expand(-1, length, 1)
    return torch.cat([bias, column], dim=-1)[None]


def _sdpa_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    *,
    scale: float | None,
    dropout: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`attend_segments` by SDPA: one call per distinct segment length (measured on CPU at
    ~0.4 ms per call forward + backward, launch overhead included); equal-length segments are
    stacked into the batch dim (a copy of their q/k/v, ``O(S)``)."""
    batch = query.shape[0]
    gqa = query.shape[1] != key.shape[1]
    pieces: dict[int, torch.Tensor] = {}
    for length, starts in segments.groups:
        q, k, v = (_stack(x, starts, length) for x in (query, key, value))
        mask = _sample_mask(length, window, sinks, q)
        if sinks is not None:  # the sink column: a zero key and a zero value
            k, v = (torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[3])], dim=2) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        for start, part in zip(starts, out.split(batch, dim=0), strict=True):
            pieces[start] = part
    return torch.cat([pieces[s] for s in segments.bounds[:-1]], dim=2)
