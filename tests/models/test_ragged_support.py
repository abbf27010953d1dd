"""Ragged supports: parity with the padded scorer's math (values, entropy, kept logprobs, every
gradient), the padded form, no tensor as wide as the widest row, kept-logprob semantics, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollfeed.collate import RaggedRows
from rollfeed.models import (
    SupportInputError,
    VocabularyRangeError,
    fused_support_logprobs,
    support_logprobs,
)
from tests.devices import DEVICES
from tests.dist.shape_record import ShapeRecord
from tests.models.reference import padded_reference, ragged_batch

N, V, H, W = 40, 2203, 8, 2000
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _fallback() -> torch.Tensor:
    mask = torch.zeros(N, dtype=torch.bool)
    mask[[1, 4, 10]] = True  # the widest row, and two others
    return mask


def _temperature(kind: str) -> float | torch.Tensor:
    return torch.linspace(0.6, 1.4, N, dtype=torch.float64) if kind == "per_row" else 1.0


def _loss(logp, entropy, kept):  # type: ignore[no-untyped-def]
    """A loss over every output; ``kept`` is ``[nnz]`` (ragged) or ``[N, W']`` (padded)."""
    g = torch.Generator().manual_seed(3)
    up = torch.randn(2, N, generator=g, dtype=torch.float64)
    kept_w = torch.randn(kept.shape, generator=g, dtype=torch.float64)
    finite = torch.where(torch.isfinite(kept), kept * kept_w, 0)
    return (logp * up[0]).sum() + (entropy * up[1]).sum() + finite.sum()


def _ragged_kept_weights_like_padded(b: dict, kept: torch.Tensor) -> torch.Tensor:
    """``kept [nnz]`` laid out as the padded reference's ``[N, W]`` (so both losses weigh each
    slot alike)."""
    return RaggedRows(b["support"].offsets, kept).padded(
        width=b["padded"].shape[1], fill=float("-inf")
    )


def _reference(b: dict, t, fallback, logits: torch.Tensor):  # type: ignore[no-untyped-def]
    lp, ent, kept, valid = padded_reference(
        logits, b["labels"], b["padded"], temperature=t, fallback_mask=fallback
    )
    return lp, ent, kept, valid


@pytest.mark.parametrize(
    ("seed", "temperature", "ids"), [(0, "scalar", torch.int32), (1, "per_row", torch.int64)]
)
def test_plain_ragged_matches_padded_math(seed: int, temperature: str, ids: torch.dtype) -> None:
    b = ragged_batch(N, V, seed=seed, max_width=W, dtype=ids)
    t, fb = _temperature(temperature), _fallback()
    ref_logits = b["logits"].clone().requires_grad_()
    lp, ent, kept, valid = _reference(b, t, fb, ref_logits)
    (ref_grad,) = torch.autograd.grad(_loss(lp, ent, kept), ref_logits)

    logits = b["logits"].clone().requires_grad_()
    got = support_logprobs(
        logits,
        b["labels"],
        b["support"],
        temperature=t,
        compute_entropy=True,
        entropy_requires_grad=True,
        return_support_logprobs=True,
        fallback_mask=fb,
        missing_label="full_vocab",
    )
    assert got.support_logprobs is not None and torch.equal(
        got.support_logprobs.offsets, b["support"].offsets
    )
    got_kept = _ragged_kept_weights_like_padded(b, got.support_logprobs.values)
    assert torch.equal(got.valid_mask, valid)
    torch.testing.assert_close(got.logprobs, lp, **TOL)
    torch.testing.assert_close(got.entropy, ent, **TOL)
    torch.testing.assert_close(got_kept, kept, **TOL)
    (grad,) = torch.autograd.grad(_loss(got.logprobs, got.entropy, got_kept), logits)
    torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [61, 2048])
def test_fused_ragged_matches_padded_math(chunk_size: int, device: str) -> None:
    b = ragged_batch(N, V, seed=2, max_width=W, hidden=H)
    t, fb = _temperature("per_row"), _fallback()
    h_ref, w_ref = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    lp, ent, kept, valid = _reference(b, t, fb, h_ref @ w_ref.T)
    ref_gh, ref_gw = torch.autograd.grad(_loss(lp, ent, kept), (h_ref, w_ref))

    # The scorer runs on `device`; the float64 reference stays on the CPU.
    h, w = (b[k].to(device).requires_grad_() for k in ("hidden", "weight"))
    got = fused_support_logprobs(
        h,
        w,
        b["labels"].to(device),
        b["support"].to(device),
        chunk_size=chunk_size,
        temperature=t.to(device),
        compute_entropy=True,
        entropy_requires_grad=True,
        return_support_logprobs=True,
        fallback_mask=fb.to(device),
        missing_label="full_vocab",
    )
    assert got.support_logprobs.device == h.device
    got = dataclasses.replace(
        got,
        logprobs=got.logprobs.cpu(),
        entropy=got.entropy.cpu(),
        valid_mask=got.valid_mask.cpu(),
        support_logprobs=got.support_logprobs.to("cpu"),
    )
    got_kept = _ragged_kept_weights_like_padded(b, got.support_logprobs.values)
    assert torch.equal(got.valid_mask, valid)
    torch.testing.assert_close(got.logprobs, lp, **TOL)
    torch.testing.assert_close(got.entropy, ent, **TOL)
    torch.testing.assert_close(got_kept, kept, **TOL)
    gh, gw = torch.autograd.grad(_loss(got.logprobs, got.entropy, got_kept), (h, w))
    torch.testing.assert_close(gh.cpu(), ref_gh, **TOL)
    torch.testing.assert_close(gw.cpu(), ref_gw, **TOL)
    # Only the kept pairs are projected: each row's distinct ids, and the fallback rows' labels.
    distinct = sum(
        len({int(v) for v in r if v >= 0})
        for n, r in enumerate(b["padded"])
        if not fb[n] and not (torch.isinf(kept[n]).all())
    )
    assert int(got.metrics["pairs_projected"]) == distinct + int(
        (valid & ~torch.isfinite(kept).any(1)).sum()
    )


def test_padded_form_scores_as_the_ragged_form() -> None:
    b = ragged_batch(N, V, seed=4, max_width=300, hidden=H)
    kw = dict(compute_entropy=True, return_support_logprobs=True, missing_label="full_vocab")
    ragged = fused_support_logprobs(b["hidden"], b["weight"], b["labels"], b["support"], **kw)
    padded = fused_support_logprobs(b["hidden"], b["weight"], b["labels"], b["padded"], **kw)
    torch.testing.assert_close(padded.logprobs, ragged.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(padded.entropy, ragged.entropy, rtol=0, atol=0)
    # The padded form's kept logprobs are rows of W slots: padded() gives them back as [N, W].
    width = b["padded"].shape[1]
    assert padded.support_logprobs.values.shape == (N * width,)
    torch.testing.assert_close(
        padded.support_logprobs.padded(fill=float("-inf")),
        ragged.support_logprobs.padded(width=width, fill=float("-inf")),
        rtol=0,
        atol=0,
    )
    for name in ragged.metrics:
        assert int(padded.metrics[name]) == int(ragged.metrics[name]), name


def _row_wide(rec: ShapeRecord, width: int) -> list[tuple[int, ...]]:
    return rec.matching(vocab={width, width + 1}, rows={N})


def test_no_tensor_as_wide_as_the_widest_row_on_the_ragged_path() -> None:
    b = ragged_batch(N, V, seed=5, max_width=W, hidden=H)
    logits = (b["hidden"] @ b["weight"].T).requires_grad_()
    h, w = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    kw = dict(
        compute_entropy=True,
        entropy_requires_grad=True,
        return_support_logprobs=True,
        fallback_mask=_fallback(),
        missing_label="full_vocab",
    )
    with ShapeRecord() as rec:
        plain = support_logprobs(logits, b["labels"], b["support"], **kw)
        fused = fused_support_logprobs(h, w, b["labels"], b["support"], chunk_size=1024, **kw)
        for s in (plain, fused):
            loss = s.logprobs.sum() + s.entropy.sum()
            loss = (
                loss
                + torch.where(
                    torch.isfinite(s.support_logprobs.values), s.support_logprobs.values, 0
                ).sum()
            )
            loss.backward()
    assert len(rec.shapes) > 20
    assert _row_wide(rec, W) == []
    assert not [s for s in rec.shapes if len(s) == 3 and W in s]  # no [N, W, H]
    # The recorder sees such a tensor where one exists: the padded math.
    with ShapeRecord() as dense:
        _reference(b, 1.0, _fallback(), logits)
    assert (N, W) in _row_wide(dense, W)


def test_kept_logprobs_semantics_on_a_literal_example() -> None:
    logits = torch.tensor(
        [
            [0.0, 1.0, 2.0, 3.0, 4.0],
            [1.0, 0.0, 0.0, 0.0, 0.0],
            [0.5, 1.5, 0.0, 2.5, 3.5],
            [0.0] * 5,
        ],
        dtype=torch.float64,
    )
    # Rows [2, 3], [0] (singleton), [4, -1, 4, 1] (padding inside, a repeat), [] (unscored).
    support = RaggedRows(torch.tensor([0, 2, 3, 7, 7]), torch.tensor([2, 3, 0, 4, -1, 4, 1]))
    labels = torch.tensor([2, 0, 4, 0])
    out = support_logprobs(logits, labels, support, return_support_logprobs=True)
    kept = out.support_logprobs
    assert torch.equal(kept.offsets, support.offsets)
    lse0 = torch.logsumexp(torch.tensor([2.0, 3.0], dtype=torch.float64), 0)
    lse2 = torch.logsumexp(torch.tensor([3.5, 1.5], dtype=torch.float64), 0)
    inf = float("-inf")
    want = torch.stack([2 - lse0, 3 - lse0, torch.tensor(0.0, dtype=torch.float64)])
    want = torch.cat(
        [want, torch.stack([3.5 - lse2]), torch.tensor([inf, inf]), (1.5 - lse2)[None]]
    )
    torch.testing.assert_close(kept.values, want, rtol=0, atol=1e-15)
    # The label's slot holds the label's logprob.
    torch.testing.assert_close(kept.values[[0, 2, 3]], out.logprobs[:3], rtol=0, atol=0)
    assert out.valid_mask.tolist() == [True, True, True, False]
    assert int(out.metrics["duplicate_ids"]) == 1 and int(out.metrics["rows_singleton"]) == 1
    # A fallback row's slots are -inf (it is not scored over its support).
    fb = torch.tensor([True, False, False, False])
    fallen = support_logprobs(
        logits, labels, support, return_support_logprobs=True, fallback_mask=fb
    )
    assert torch.isinf(fallen.support_logprobs.values[:2]).all()
    assert support_logprobs(logits, labels, support).support_logprobs is None


def test_ragged_support_errors_name_the_row_and_slot() -> None:
    logits = torch.zeros(3, 10, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3])
    offsets = torch.tensor([0, 1, 3, 6])
    bad = RaggedRows(offsets, torch.tensor([1, 2, 5, 3, -2, 4]))
    with pytest.raises(VocabularyRangeError, match=r"support\[2, 1\] = -2"):
        support_logprobs(logits, labels, bad)
    beyond = RaggedRows(offsets, torch.tensor([1, 2, 10, 3, 4, 4]))
    with pytest.raises(VocabularyRangeError, match=r"support\[1, 1\] = 10"):
        support_logprobs(logits, labels, beyond)
    with pytest.raises(SupportInputError, match="N=3 rows"):
        support_logprobs(logits, labels, RaggedRows(offsets[:3], torch.tensor([1, 2, 5])))
    with pytest.raises(SupportInputError, match="int32/int64"):
        support_logprobs(logits, labels, RaggedRows(offsets, torch.ones(6)))


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_backward_is_bitwise_reproducible(device: str) -> None:
    b = ragged_batch(N, V, seed=6, max_width=500, hidden=H)
    b = {k: v.to(device) for k, v in b.items()}
    grads = []
    for _ in range(2):
        h, w = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
        s = fused_support_logprobs(
            h,
            w,
            b["labels"],
            b["support"],
            compute_entropy=True,
            entropy_requires_grad=True,
            return_support_logprobs=True,
            missing_label="full_vocab",
            chunk_size=64,
        )
        kept = s.support_logprobs.values
        loss = s.logprobs.sum() + s.entropy.sum() + torch.where(torch.isfinite(kept), kept, 0).sum()
        grads.append(torch.autograd.grad(loss, (h, w)))
    assert all(torch.equal(a, c) for a, c in zip(*grads, strict=True))
