"""Packed attention alone: parity with a float64 explicit-mask reference (values and gradients),
chunked layers included, the layout's contents, no ``[S, S]`` tensor anywhere in a forward +
backward, and on every available device the kernel that device runs (one varlen call on CUDA)
against a float32 reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from rollfeed.models.packing_attention import (
    PackingError,
    packed_attention_forward,
    packed_layout,
)
from rollfeed.models.segment_attention import segment_kernel, varlen_kernel
from tests.devices import DEVICES
from tests.models.tiny import VOCAB, tiny_qwen3

HEADS, KV_HEADS, DIM = 4, 2, 5
# Odd sizes, two samples of equal length (one batched SDPA call), and a tail padding slot.
LENGTHS = [1, 7, 13, 7, 1, 4]
S = sum(LENGTHS)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _reference(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Plain float64 attention with an explicit block-diagonal causal mask, canonical order.
    q ``[1, H, S, d]``, k/v ``[1, KV, S, d]`` -> ``[1, S, H, d]``."""
    n = sum(lengths)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    lo = 0
    for length in lengths:
        allowed[lo : lo + length, lo : lo + length] = torch.ones(length, length).tril().bool()
        lo += length
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)


def _qkv(seed: int, n: int = S, heads: int = HEADS, kv: int = KV_HEADS, dim: int = DIM):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, heads, n, dim), (1, kv, n, dim), (1, kv, n, dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def _zigzag(n: int, chunks: int) -> torch.Tensor:
    """A permutation of 0..n-1 shaped like a zigzag CP layout: chunk pairs (0, c-1), (1, c-2).."""
    parts = torch.arange(n).tensor_split(chunks)
    return torch.cat([torch.cat([parts[i], parts[chunks - 1 - i]]) for i in range(chunks // 2)])


# Samples are read off position ids only when they arrive in canonical order; otherwise cu_seqlens.
@pytest.mark.parametrize(
    ("arrival", "use_cu"),
    [("canonical", False), ("canonical", True), ("zigzag", True), ("reversed", True)],
)
def test_matches_explicit_mask_reference_values_and_grads(arrival: str, use_cu: bool) -> None:
    order = {
        "canonical": torch.arange(S),
        "zigzag": _zigzag(S, 4),
        "reversed": torch.arange(S).flip(0),
    }[arrival]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    layout = packed_layout(
        pos[order], canonical_index=order, cu_seqlens=_cu(LENGTHS) if use_cu else None
    )
    q, k, v = _qkv(1)
    up = torch.randn(1, S, HEADS, DIM, generator=torch.Generator().manual_seed(2), dtype=q.dtype)

    got, _ = packed_attention_forward(
        torch.nn.Module().eval(),
        q[:, :, order],
        k[:, :, order],
        v[:, :, order],
        None,
        packing=layout,
    )
    ref = _reference(q, k, v, LENGTHS)
    torch.testing.assert_close(got, ref[:, order], atol=1e-12, rtol=0)
    got_g = torch.autograd.grad((got * up[:, order]).sum(), (q, k, v))
    ref_g = torch.autograd.grad((ref * up).sum(), (q, k, v))
    for a, e, name in zip(got_g, ref_g, "qkv", strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=name)


def _reference_features(q, k, v, lengths, window, sinks) -> torch.Tensor:
    """Eager attention written out: block-diagonal causal mask cut to ``window`` (query i sees key
    j when ``0 <= i - j < window``), one sink logit per head appended to each row's logits and
    dropped after the softmax (as gpt-oss's eager attention). ``v`` may be narrower than q/k."""
    n = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(n)
    allowed = (seg[:, None] == seg[None, :]) & (i[:, None] >= i[None, :])
    allowed &= (i[:, None] - i[None, :]) < window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(1, -1, n, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("arrival", ["canonical", "zigzag"])
def test_sliding_window_sinks_and_narrower_values_match_explicit_reference(arrival: str) -> None:
    order = torch.arange(S) if arrival == "canonical" else _zigzag(S, 4)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    layout = packed_layout(pos[order], canonical_index=order, cu_seqlens=_cu(LENGTHS))
    gen = torch.Generator().manual_seed(8)
    q, k, _ = _qkv(7)
    v = torch.randn(1, KV_HEADS, S, DIM - 2, generator=gen, dtype=q.dtype).requires_grad_()
    sinks = torch.randn(HEADS, generator=gen, dtype=q.dtype).requires_grad_()
    window = 3  # shorter than the samples of 7 and 13 tokens, longer than those of 1 and 4
    up = torch.randn(1, S, HEADS, DIM - 2, generator=gen, dtype=q.dtype)
    got, _ = packed_attention_forward(
        torch.nn.Module().eval(),
        q[:, :, order],
        k[:, :, order],
        v[:, :, order],
        None,
        packing=layout,
        sliding_window=window,
        s_aux=sinks,
    )
    ref = _reference_features(q, k, v, LENGTHS, window, sinks)
    torch.testing.assert_close(got, ref[:, order], atol=1e-12, rtol=0)
    got_g = torch.autograd.grad((got * up[:, order]).sum(), (q, k, v, sinks))
    ref_g = torch.autograd.grad((ref * up).sum(), (q, k, v, sinks))
    for a, e, name in zip(got_g, ref_g, ["q", "k", "v", "sinks"], strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=name)
    assert ref_g[3].abs().min() > 0  # every head's sink gets a gradient


def test_layout_groups_equal_lengths_and_drops_empty_samples() -> None:
    layout = packed_layout(torch.tensor([0, 1, 2, 0, 1, 0, 1]))
    assert layout.bounds == (0, 3, 5, 7)
    assert layout.groups == ((2, (3, 5)), (3, (0,)))
    assert layout.inverse is None
    # An empty sample and a last sample running past the row's end (truncated) are clipped.
    clipped = packed_layout(torch.arange(7), cu_seqlens=torch.tensor([0, 3, 3, 5, 9]))
    assert clipped.bounds == (0, 3, 5, 7)
    order = torch.tensor([2, 0, 1])
    permuted = packed_layout(torch.tensor([2, 0, 1]), canonical_index=order)
    assert permuted.inverse.tolist() == [1, 2, 0]
    assert permuted.bounds == (0, 3)


def test_canonical_index_that_is_not_a_permutation_is_refused() -> None:
    with pytest.raises(PackingError, match=r"permutation of 0\.\.3"):
        packed_layout(torch.arange(4), canonical_index=torch.tensor([0, 1, 1, 3]))
    with pytest.raises(PackingError, match=r"permutation of 0\.\.3"):
        packed_layout(torch.arange(4), canonical_index=torch.tensor([0, 1, 2, 7]))


def test_layout_of_another_length_is_refused() -> None:
    q, k, v = _qkv(3, n=6)
    with pytest.raises(PackingError, match="covers 5 tokens, attention sees 6"):
        packed_attention_forward(
            torch.nn.Module(), q, k, v, None, packing=packed_layout(torch.arange(5))
        )


def test_dropout_applies_in_training_only() -> None:
    q, k, v = _qkv(4)
    layout = packed_layout(torch.cat([torch.arange(n) for n in LENGTHS]))
    module = torch.nn.Module()
    with torch.no_grad():
        plain, _ = packed_attention_forward(module.eval(), q, k, v, None, packing=layout)
        ignored, _ = packed_attention_forward(
            module.eval(), q, k, v, None, packing=layout, dropout=0.5
        )
        dropped, _ = packed_attention_forward(
            module.train(), q, k, v, None, packing=layout, dropout=0.5
        )
    assert torch.equal(plain, ignored)
    assert not torch.allclose(plain, dropped)


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op produces, and any tensor with two dims >= ``side``."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.side, self.largest, self.square = side, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if sum(d >= self.side for d in t.shape) >= 2:
                    self.square.append((str(func), tuple(t.shape)))
        return out


def test_spy_sees_the_dense_mask() -> None:
    # The check below could not fail if the spy missed an [S, S] tensor: it does not.
    layout = packed_layout(torch.arange(64) % 16)
    with _Largest(64) as spy:
        mask = layout.allowed
    assert mask.shape == (64, 64)
    assert spy.largest == 64 * 64 and spy.square


@pytest.mark.parametrize(
    ("arrival", "features"), [("canonical", False), ("zigzag", False), ("zigzag", True)]
)
def test_attention_never_allocates_s_by_s(arrival: str, features: bool) -> None:
    n, samples = 4096, 8
    order = torch.arange(n) if arrival == "canonical" else _zigzag(n, 4)
    lengths = [n // samples + 37, n // samples - 37] * (samples // 2)
    pos = torch.cat([torch.arange(length) for length in lengths])
    q, k, v = _qkv(5, n=n, heads=2, kv=1, dim=4)
    # A sliding window shorter than every sample and sinks: per-sample [L, L + 1] masks only.
    extra = dict(sliding_window=64, s_aux=torch.zeros(2, dtype=q.dtype)) if features else {}
    with _Largest(n) as spy:
        layout = packed_layout(pos[order], canonical_index=order, cu_seqlens=_cu(lengths))
        out, _ = packed_attention_forward(
            torch.nn.Module().eval(),
            q[:, :, order],
            k[:, :, order],
            v[:, :, order],
            None,
            packing=layout,
            **extra,
        )
        out.sum().backward()
    assert spy.square == []
    # With a mask SDPA's math path holds a sample's [H, L, L + 1] scores: still far from S².
    assert spy.largest < n * n // (8 if features else 64)


def test_model_forward_and_backward_never_allocate_s_by_s() -> None:
    n, samples = 512, 8
    lengths = [n // samples] * samples
    pos = torch.cat([torch.arange(length) for length in lengths])
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(6))
    model = tiny_qwen3(seed=6, dtype=torch.float32)
    with _Largest(n) as spy:
        logits = model(
            input_ids=ids[None], position_ids=pos[None], packing=packed_layout(pos)
        ).logits
        logits.logsumexp(-1).sum().backward()
    assert spy.square == []
    assert spy.largest < n * n // 2


class _ChunkedLayer(torch.nn.Module):
    """A module as a chunked-attention layer presents itself to packed attention."""

    def __init__(self, chunk: int) -> None:
        super().__init__()
        self.layer_idx = 0
        self.config = SimpleNamespace(layer_types=["chunked_attention"], attention_chunk_size=chunk)


def _reference_chunked(q, k, v, lengths: list[int], chunk: int) -> torch.Tensor:
    """Explicit mask: same sample, causal, and the same chunk of ``chunk`` tokens counted from
    the sample's first token (as transformers' chunked mask over one sample)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    i = torch.arange(sum(lengths))
    allowed = (seg[:, None] == seg[None, :]) & (i[:, None] >= i[None, :])
    allowed &= (pos[:, None] // chunk) == (pos[None, :] // chunk)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("arrival", ["canonical", "zigzag"])
def test_chunked_layer_attends_within_chunks_counted_from_each_sample(arrival: str) -> None:
    order = torch.arange(S) if arrival == "canonical" else _zigzag(S, 4)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    layout = packed_layout(pos[order], canonical_index=order, cu_seqlens=_cu(LENGTHS), chunk_size=3)
    q, k, v = _qkv(9)
    up = torch.randn(1, S, HEADS, DIM, generator=torch.Generator().manual_seed(10), dtype=q.dtype)
    got, _ = packed_attention_forward(
        _ChunkedLayer(3).eval(),
        q[:, :, order],
        k[:, :, order],
        v[:, :, order],
        None,
        packing=layout,
    )
    ref = _reference_chunked(q, k, v, LENGTHS, 3)
    torch.testing.assert_close(got, ref[:, order], atol=1e-12, rtol=0)
    for a, e, name in zip(
        torch.autograd.grad((got * up[:, order]).sum(), (q, k, v)),
        torch.autograd.grad((ref * up).sum(), (q, k, v)),
        "qkv",
        strict=True,
    ):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=name)
    # The chunks matter here (samples of 7 and 13 span several), and a layout without them or
    # with another chunk size is refused, not attended over whole samples.
    assert (ref - _reference(q, k, v, LENGTHS)).abs().max() > 1e-3
    for wrong in (packed_layout(pos), packed_layout(pos, chunk_size=4)):
        with pytest.raises(PackingError, match="attends in chunks of 3 tokens"):
            packed_attention_forward(_ChunkedLayer(3), q, k, v, None, packing=wrong)


# bf16 on the device against float32 on the CPU: bf16 keeps 8 bits of mantissa, and these outputs
# and gradients are O(1), so 3e-2 bounds the rounding of inputs and of the kernel's accumulations.
BF16_TOL = dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_attention_on_each_device_matches_the_float32_reference(device, monkeypatch):
    """On CUDA a plain causal, a sliding-window and a chunked layer each run as one varlen call
    (no SDPA call) where this torch or flash-attn has one; elsewhere the per-sample SDPA path."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    lengths = [5, 17, 1, 17, 24]
    n, pos = sum(lengths), torch.cat([torch.arange(m) for m in lengths])
    q, k, v = _qkv(11, n=n, heads=4, kv=2, dim=16)
    up = torch.randn(1, n, 4, 16, generator=torch.Generator().manual_seed(12), dtype=q.dtype)
    varlen = device == "cuda" and varlen_kernel() is not None
    cases = [
        (torch.nn.Module(), {}, _reference(q, k, v, lengths)),
        (torch.nn.Module(), {"sliding_window": 6}, None),
        (_ChunkedLayer(8), {}, _reference_chunked(q, k, v, lengths, 8)),
    ]
    for module, extra, ref in cases:
        if ref is None:  # the window: the features reference without sinks (a -inf sink)
            sinks = torch.full((4,), float("-inf"), dtype=q.dtype)
            ref = _reference_features(q, k, v, lengths, extra["sliding_window"], sinks)
        layout = packed_layout(pos.to(device), cu_seqlens=_cu(lengths).to(device), chunk_size=8)
        inputs = [x.detach().to(device, torch.bfloat16).requires_grad_() for x in (q, k, v)]
        calls.clear()
        got, _ = packed_attention_forward(module.eval(), *inputs, None, packing=layout, **extra)
        assert segment_kernel(inputs[0], inputs[2], sinks=None, dropout=0.0) == (
            "varlen" if varlen else "sdpa"
        )
        assert (calls == []) == varlen
        got_g = torch.autograd.grad((got * up.to(device, torch.bfloat16)).sum(), inputs)
        torch.testing.assert_close(got.float().cpu(), ref.float(), **BF16_TOL)
        ref_g = torch.autograd.grad((ref * up).sum(), (q, k, v))
        for a, e, name in zip(got_g, ref_g, "qkv", strict=True):
            torch.testing.assert_close(a.float().cpu(), e.float(), **BF16_TOL, msg=name)
