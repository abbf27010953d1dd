"""Fused LM-head path: parity with the float64 reference (values; hidden and weight gradients),
bounded temporaries, candidate reuse and fp32 weight-gradient accumulation."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollfeed.models import SupportInputError, fused_support_logprobs
from tests.devices import DEVICES
from tests.models.reference import random_batch, reference_scores

N, V, H, W = 47, 123, 16, 5
FALLBACK_ROWS = [0, 10, 17]  # an empty row, a singleton row, a multi-id row


def _batch(seed: int) -> dict[str, torch.Tensor]:
    return random_batch(N, V, seed=seed, width=W, hidden=H)


def _fallback() -> torch.Tensor:
    mask = torch.zeros(N, dtype=torch.bool)
    mask[FALLBACK_ROWS] = True
    return mask


def _loss(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    up = torch.randn(2, N, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return (lp * up[0].to(lp.dtype)).sum() + (ent * up[1].to(lp.dtype)).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, "per_token"])
def test_matches_reference_values_and_grads(
    chunk_size: int, temperature: object, device: str
) -> None:
    b = _batch(1)
    t = torch.linspace(0.5, 1.5, N, dtype=torch.float64) if temperature == "per_token" else 1.0
    h, w = b["hidden"].requires_grad_(), b["weight"].requires_grad_()
    # The scorer runs on `device`; the float64 reference stays on the CPU.
    hd, wd = (x.detach().to(device).requires_grad_() for x in (h, w))
    got = fused_support_logprobs(
        hd,
        wd,
        b["labels"].to(device),
        b["support"].to(device),
        chunk_size=chunk_size,
        temperature=t.to(device) if isinstance(t, torch.Tensor) else t,
        compute_entropy=True,
        entropy_requires_grad=True,
        fallback_mask=_fallback().to(device),
        missing_label="full_vocab",
    )
    ref_lp, ref_h, ref_valid = reference_scores(
        h @ w.T, b["labels"], b["support"], temperature=t, fallback_mask=_fallback()
    )
    assert got.entropy is not None
    assert got.logprobs.device == got.entropy.device == got.valid_mask.device == hd.device
    assert all(v.device == hd.device for v in got.metrics.values())
    assert torch.equal(got.valid_mask.cpu(), ref_valid)
    torch.testing.assert_close(got.logprobs.cpu(), ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.entropy.cpu(), ref_h, rtol=1e-12, atol=1e-12)
    got_g = torch.autograd.grad(_loss(got.logprobs.cpu(), got.entropy.cpu()), (hd, wd))
    ref_g = torch.autograd.grad(_loss(ref_lp, ref_h), (h, w))
    for a, e in zip(got_g, ref_g, strict=True):
        assert a.device == hd.device
        torch.testing.assert_close(a.cpu(), e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_two_backward_runs_give_bitwise_equal_gradients(device: str) -> None:
    # Many rows share few candidate ids, so each weight row sums about a hundred contributions
    # and each hidden row several: an accumulation whose order varies from run to run (atomics)
    # shows up in the last bits of float32.
    rows, vocab, hidden = 1024, 32, 64
    b = random_batch(rows, vocab, seed=5, width=8, hidden=hidden)
    fallback = torch.zeros(rows, dtype=torch.bool)
    fallback[::61] = True
    up = torch.randn(rows, generator=torch.Generator().manual_seed(8)).to(device)
    grads = []
    for _ in range(2):
        h = b["hidden"].float().to(device).requires_grad_()
        w = b["weight"].float().to(device).requires_grad_()
        got = fused_support_logprobs(
            h,
            w,
            b["labels"].to(device),
            b["support"].to(device),
            chunk_size=256,
            compute_entropy=True,
            entropy_requires_grad=True,
            fallback_mask=fallback.to(device),
            missing_label="full_vocab",
        )
        assert got.entropy is not None
        loss = (got.logprobs * up).sum() + got.entropy.sum()
        grads.append(torch.autograd.grad(loss, (h, w)))
    for first, second in zip(*grads, strict=True):
        assert first.abs().sum() > 0
        assert torch.equal(first, second)


def test_projects_each_distinct_candidate_once() -> None:
    b = _batch(2)
    got = fused_support_logprobs(
        b["hidden"], b["weight"], b["labels"], b["support"], missing_label="full_vocab"
    )
    expected = 0
    for n in range(N):
        ids = {int(i) for i in b["support"][n] if int(i) >= 0}
        if ids and int(b["labels"][n]) in ids:
            expected += len(ids)  # the label reuses its support column
        elif ids:
            expected += 1  # a missing label falls back: only the label pair is projected
    assert int(got.metrics["pairs_projected"]) == expected


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_scales_with_n_times_v() -> None:
    rows, vocab, hidden = 300, 2000, 4  # N·V = 600k, far above the weight (8k) and chunk sizes
    b = random_batch(rows, vocab, seed=3, width=W, hidden=hidden)
    fallback = torch.zeros(rows, dtype=torch.bool)
    fallback[::50] = True
    h, w = b["hidden"].requires_grad_(), b["weight"].requires_grad_()
    with _LargestTensor() as spy:
        got = fused_support_logprobs(
            h,
            w,
            b["labels"],
            b["support"],
            chunk_size=64,
            compute_entropy=True,
            entropy_requires_grad=True,
            fallback_mask=fallback,
            missing_label="full_vocab",
        )
        (got.logprobs.sum() + got.entropy.sum()).backward()  # type: ignore[union-attr]
    assert spy.largest <= max(vocab * hidden, rows * (W + 1))


def test_bfloat16_weights_match_the_reference_within_bf16_tolerance() -> None:
    b = _batch(4)
    h64, w64 = b["hidden"].requires_grad_(), b["weight"].requires_grad_()
    kw = {"compute_entropy": True, "entropy_requires_grad": True, "missing_label": "full_vocab"}
    ref = fused_support_logprobs(h64, w64, b["labels"], b["support"], **kw)
    ref_g = torch.autograd.grad(_loss(ref.logprobs, ref.entropy), (h64, w64))  # type: ignore[arg-type]
    h = b["hidden"].detach().float().requires_grad_()
    w = b["weight"].detach().bfloat16().requires_grad_()
    got = fused_support_logprobs(h, w, b["labels"], b["support"], chunk_size=3, **kw)
    assert got.logprobs.dtype == torch.float32
    # bf16 weights: inputs rounded to 8 mantissa bits, so ~1e-2 relative on values and grads.
    torch.testing.assert_close(got.logprobs.double(), ref.logprobs, rtol=2e-2, atol=2e-2)
    gh, gw = torch.autograd.grad(_loss(got.logprobs, got.entropy), (h, w))  # type: ignore[arg-type]
    assert gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh.double(), ref_g[0], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(gw.double(), ref_g[1], rtol=3e-2, atol=3e-2)


def test_singletons_give_zero_and_no_gradient_to_hidden_or_weight() -> None:
    h = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    support = torch.tensor([[4, -1], [0, -1], [8, -1]])
    got = fused_support_logprobs(
        h, w, support[:, 0].clone(), support, compute_entropy=True, entropy_requires_grad=True
    )
    assert torch.equal(got.logprobs, torch.zeros(3, dtype=torch.float64))
    gh, gw = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), (h, w))  # type: ignore[union-attr]
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_bad_shapes_raise() -> None:
    with pytest.raises(SupportInputError, match="weight \\[V_local, H\\]"):
        fused_support_logprobs(
            torch.randn(2, 4),
            torch.randn(9, 5),
            torch.zeros(2, dtype=torch.long),
            torch.zeros(2, 1, dtype=torch.long),
        )
