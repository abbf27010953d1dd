"""Tree attention against a dense-mask reference: each token sees its ancestors' tokens and its
span's up to itself (windows and chunks counted by depth, sinks as a zero column), values and
gradients, grouped-query heads and a value head of another size; a layout that does not tile the
row is refused; the device's kernel (CUDA: varlen over the gathered keys) against float64 on the
CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollfeed.models import PackingError, tree_attention
from rollfeed.models.packing_attention import packed_layout
from rollfeed.models.tree_attention import attend_tree, tree_spans
from tests.devices import DEVICES

# A prompt of 10 with branches of 3, 3 and 5, the first branch forking again into 2 and 1 (a
# tree of depth 2), then a flat sample of 6 and 2 tokens of padding.
SPANS = dict(
    starts=(0, 10, 13, 15, 16, 19, 24, 30),
    depths=(0, 10, 13, 13, 10, 10, 0, 0),
    lengths=(10, 3, 2, 1, 3, 5, 6, 2),
    parents=(-1, 0, 1, 1, 0, 0, -1, -1),
)
S = 32


def _depth_of_tokens() -> torch.Tensor:
    depth = torch.zeros(S, dtype=torch.long)
    for a, d, n in zip(SPANS["starts"], SPANS["depths"], SPANS["lengths"], strict=True):
        depth[a : a + n] = torch.arange(d, d + n)
    return depth


def _dense_mask(window=None, chunk=None) -> torch.Tensor:
    """``[S, S]``: query i sees key j when j is on i's path at depth <= i's (written from the
    spans' parents, independently of the kernel's key lists)."""
    span_of = torch.zeros(S, dtype=torch.long)
    for s, (a, n) in enumerate(zip(SPANS["starts"], SPANS["lengths"], strict=True)):
        span_of[a : a + n] = s

    def ancestors(s):
        out = set()
        while s >= 0:
            out.add(s)
            s = SPANS["parents"][s]
        return out

    depth = _depth_of_tokens()
    allowed = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        on_path = ancestors(int(span_of[i]))
        for j in range(S):
            ok = int(span_of[j]) in on_path and depth[j] <= depth[i]
            if window is not None:
                ok &= bool(depth[i] - depth[j] < window)
            if chunk is not None:
                ok &= bool(depth[i] // chunk == depth[j] // chunk)
            allowed[i, j] = ok
    return allowed


def _reference(q, k, v, allowed, sinks=None):
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(1, -1, S, 1)
        weights = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(logits, -1)
    return weights @ v


@pytest.mark.parametrize("pieces", [False, True], ids=["whole_branches", "branch_pieces"])
@pytest.mark.parametrize(
    "feature", ["causal", "window", "chunk", "sinks", "mla_values"], ids=lambda f: f
)
def test_tree_attention_equals_the_dense_tree_mask(feature: str, pieces: bool, monkeypatch) -> None:
    if pieces:  # a branch's queries in pieces of 2 (on long branches: of QUERY_CHUNK)
        monkeypatch.setattr(tree_attention, "QUERY_CHUNK", 2)
    g = torch.Generator().manual_seed(0)
    dv = 12 if feature == "mla_values" else 16
    q = torch.randn(1, 4, S, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, S, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, S, dv, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=g, dtype=torch.float64) if feature == "sinks" else None
    window = 4 if feature == "window" else None
    chunk = 8 if feature == "chunk" else None
    spans = tree_spans(*SPANS.values(), torch.device("cpu"))
    got = attend_tree(
        q, k, v, spans, scale=None, dropout=0.0, window=window, chunk=chunk, sinks=sinks
    )
    want = _reference(q, k, v, _dense_mask(window, chunk), sinks)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), grad),
        torch.autograd.grad(want, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_layout_dense_view_and_refusals() -> None:
    layout = packed_layout(_depth_of_tokens(), tree=tuple(SPANS.values()))
    assert torch.equal(layout.allowed, _dense_mask())
    bad = dict(SPANS, depths=(0, 10, 12, 13, 10, 10, 0, 0))  # span 2 does not continue span 1
    with pytest.raises(PackingError, match="tree span 2"):
        packed_layout(_depth_of_tokens(), tree=tuple(bad.values()))
    with pytest.raises(PackingError, match="cover 32 tokens"):
        packed_layout(torch.arange(S + 2), tree=tuple(SPANS.values()))


@pytest.mark.parametrize("device", DEVICES)
def test_each_devices_kernel_in_bf16_matches_float64_on_the_cpu(device: str) -> None:
    """bf16 picks the varlen kernel on CUDA (one call over every span's gathered keys), sdpa on
    the CPU; both against the float64 CPU result, values and gradients."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, S, 64, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    for window in (None, 4):
        runs = []
        for where, dtype in (("cpu", torch.float64), (device, torch.bfloat16)):
            spans = tree_spans(*SPANS.values(), torch.device(where))
            inputs = [x.to(where, dtype).requires_grad_() for x in (q, k, v)]
            out = attend_tree(*inputs, spans, scale=None, dropout=0.0, window=window)
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
            runs.append([t.double().cpu() for t in (out, *grads)])
        for want, got in zip(*runs, strict=True):
            torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
        assert F.mse_loss(runs[1][0], runs[0][0]) < 1e-4
