"""Gated DeltaNet's packed kernels alone: the delta rule against its per-token recurrence and the
conv against ``F.conv1d`` per sample (float64, values and gradients), and on every available
device the kernels that device runs (causal-conv1d and flash-linear-attention on CUDA when
installed) against the float64 CPU reference."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from rollfeed.models.delta_rule import (
    causal_conv1d_packed,
    gated_delta_rule_packed,
    kernel_names,
)
from rollfeed.models.row_segments import make_segments
from tests.devices import DEVICES

# One token, shorter than the conv kernel, at / around the 64-token chunk, two chunks and more.
LENGTHS = [1, 3, 63, 64, 65, 130, 7]
HEADS, DK, DV = 3, 5, 7


def _inputs(seed: int, heads: int = HEADS, dk: int = DK, dv: int = DV):
    gen = torch.Generator().manual_seed(seed)
    n, dtype = sum(LENGTHS), torch.float64
    q, k = (torch.randn(n, heads, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=gen, dtype=dtype)
    g = -torch.rand(n, heads, generator=gen, dtype=dtype)  # log decays <= 0
    beta = torch.rand(n, heads, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _recurrence(q, k, v, g, beta):
    """The gated delta rule token by token, state [H, dk, dv] from zero (one sample)."""
    unit = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = unit(q) * DK**-0.5, unit(k)
    state = torch.zeros(HEADS, DK, DV, dtype=q.dtype)
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out)


def test_delta_rule_equals_its_recurrence_per_sample_values_and_grads() -> None:
    inputs = _inputs(0)
    segments = make_segments(LENGTHS, torch.device("cpu"))
    got = gated_delta_rule_packed(*inputs, segments)
    bounds = segments.bounds
    want = torch.cat(
        [_recurrence(*(x[a:b] for x in inputs)) for a, b in itertools.pairwise(bounds)]
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    got_g = torch.autograd.grad((got * up).sum(), inputs)
    want_g = torch.autograd.grad((want * up).sum(), inputs)
    for a, e, name in zip(got_g, want_g, ["q", "k", "v", "g", "beta"], strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=name)


def test_conv_equals_conv1d_per_sample_values_and_grads() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(LENGTHS), 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    segments = make_segments(LENGTHS, torch.device("cpu"))
    got = causal_conv1d_packed(x, weight, bias, segments)
    bounds = segments.bounds
    parts = []
    for a, b in itertools.pairwise(bounds):  # zero left padding: nothing before a
        conv = F.conv1d(x[a:b].T[None], weight[:, None], bias, padding=3, groups=6)
        parts.append(F.silu(conv[0, :, : b - a].T))
    want = torch.cat(parts)
    torch.testing.assert_close(got, want, atol=1e-13, rtol=0)
    up = torch.randn(got.shape, generator=gen, dtype=got.dtype)
    for a, e, name in zip(
        torch.autograd.grad((got * up).sum(), (x, weight, bias)),
        torch.autograd.grad((want * up).sum(), (x, weight, bias)),
        ["x", "weight", "bias"],
        strict=True,
    ):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_each_devices_kernels_match_the_float64_cpu_reference(device: str) -> None:
    names = kernel_names(torch.device(device), torch.float32)
    fast = device == "cuda"
    assert names == {
        "conv1d": "causal_conv1d"
        if fast and importlib.util.find_spec("causal_conv1d")
        else "torch",
        "delta_rule": "fla" if fast and importlib.util.find_spec("fla") else "torch",
    }
    # flash-linear-attention's Triton kernels may round through tf32: a looser bound there.
    tol = 3e-3 if names["delta_rule"] == "fla" else 1e-5
    ref_in = _inputs(3, heads=2, dk=32, dv=32)  # head sizes the CUDA kernels take
    dev_in = [x.detach().float().to(device).requires_grad_() for x in ref_in]
    want = gated_delta_rule_packed(*ref_in, make_segments(LENGTHS, torch.device("cpu")))
    got = gated_delta_rule_packed(*dev_in, make_segments(LENGTHS, torch.device(device)))
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=want.dtype)
    want_g = torch.autograd.grad((want * up).sum(), ref_in)
    got_g = torch.autograd.grad((got * up.float().to(device)).sum(), dev_in)
    for a, e, name in zip(got_g, want_g, ["q", "k", "v", "g", "beta"], strict=True):
        torch.testing.assert_close(a.double().cpu(), e, atol=10 * tol, rtol=10 * tol, msg=name)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(LENGTHS), 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    want = causal_conv1d_packed(x, weight, None, make_segments(LENGTHS, torch.device("cpu")))
    got = causal_conv1d_packed(
        x.float().to(device),
        weight.float().to(device),
        None,
        make_segments(LENGTHS, torch.device(device)),
    )
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
