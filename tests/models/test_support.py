"""Plain path: parity with the float64 reference (values, gradients) and the edge cases."""

from __future__ import annotations

import pytest
import torch

from rollfeed.models import SupportInputError, SupportLabelError, support_logprobs
from tests.devices import DEVICES
from tests.models.reference import random_batch, reference_scores

N, V = 47, 123


def _grads(out: torch.Tensor, x: torch.Tensor, seed: int) -> torch.Tensor:
    upstream = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype
    )
    (grad,) = torch.autograd.grad((out * upstream).sum(), x, retain_graph=True)
    return grad


TEMPERATURES = [1.0, 0.7, torch.linspace(0.5, 1.5, N, dtype=torch.float64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=["t1", "t0.7", "per_token"])
@pytest.mark.parametrize("with_fallback", [False, True])
def test_matches_reference_values_and_grads(
    temperature: float | torch.Tensor, with_fallback: bool, device: str
) -> None:
    b = random_batch(N, V, seed=1)
    fallback = torch.zeros(N, dtype=torch.bool)
    if with_fallback:
        fallback[[0, 10, 17]] = True  # an empty row, a singleton row, a multi-id row
    logits = b["logits"].requires_grad_()
    # The scorer runs on `device`; the float64 reference stays on the CPU.
    on_device = logits.detach().to(device).requires_grad_()
    got = support_logprobs(
        on_device,
        b["labels"].to(device),
        b["support"].to(device),
        temperature=temperature.to(device)
        if isinstance(temperature, torch.Tensor)
        else temperature,
        compute_entropy=True,
        entropy_requires_grad=True,
        fallback_mask=fallback.to(device) if with_fallback else None,
        missing_label="full_vocab",
    )
    ref_lp, ref_h, ref_valid = reference_scores(
        logits, b["labels"], b["support"], temperature=temperature, fallback_mask=fallback
    )
    assert got.entropy is not None
    assert got.logprobs.device == got.entropy.device == got.valid_mask.device == on_device.device
    assert all(v.device == on_device.device for v in got.metrics.values())
    assert torch.equal(got.valid_mask.cpu(), ref_valid)
    torch.testing.assert_close(got.logprobs.cpu(), ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.entropy.cpu(), ref_h, rtol=1e-12, atol=1e-12)
    for out, ref in ((got.logprobs, ref_lp), (got.entropy, ref_h)):
        grad = _grads(out.cpu(), on_device, 2)
        assert grad.device == on_device.device
        torch.testing.assert_close(grad.cpu(), _grads(ref, logits, 2))
    missing = int(got.metrics["rows_missing_label"])
    assert missing == 4  # the rows of kind 9 in random_batch
    assert int(got.metrics["rows_fallback"]) == missing + (3 if with_fallback else 0)


def test_float32_and_bfloat16_inputs_score_in_float32() -> None:
    b = random_batch(N, V, seed=3)
    ref_lp, ref_h, _ = reference_scores(b["logits"], b["labels"], b["support"])
    kw = {"compute_entropy": True, "missing_label": "full_vocab"}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        got = support_logprobs(b["logits"].to(dtype), b["labels"], b["support"].int(), **kw)
        assert got.logprobs.dtype == torch.float32
        torch.testing.assert_close(got.logprobs.double(), ref_lp, rtol=tol, atol=tol)
        assert got.entropy is not None
        torch.testing.assert_close(got.entropy.double(), ref_h, rtol=tol, atol=tol)


def test_singleton_scores_zero_with_zero_gradient() -> None:
    logits = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    support = torch.tensor([[4, -1, -1], [0, -1, -1], [10, -1, -1]])
    got = support_logprobs(
        logits, support[:, 0].clone(), support, compute_entropy=True, entropy_requires_grad=True
    )
    assert torch.equal(got.logprobs, torch.zeros(3, dtype=torch.float64))
    assert got.entropy is not None and torch.equal(got.entropy, torch.zeros(3, dtype=torch.float64))
    (grad,) = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), logits)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert int(got.metrics["rows_singleton"]) == 3


def test_padding_rows_are_invalid_zero_and_get_no_gradient() -> None:
    logits = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    support = torch.tensor([[-1, -1], [2, 5]])
    labels = torch.tensor([-100, 5])  # label of an unscored row is never read
    got = support_logprobs(
        logits, labels, support, compute_entropy=True, entropy_requires_grad=True
    )
    assert got.valid_mask.tolist() == [False, True]
    assert got.logprobs[0].item() == 0.0 and got.entropy[0].item() == 0.0  # type: ignore[index]
    (grad,) = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), logits)  # type: ignore[union-attr]
    assert torch.equal(grad[0], torch.zeros(7, dtype=torch.float64))
    assert torch.isfinite(grad).all()


def test_repeated_ids_count_once_and_padding_position_does_not_matter() -> None:
    logits = torch.randn(1, 9, dtype=torch.float64)
    labels = torch.tensor([3])
    base = support_logprobs(logits, labels, torch.tensor([[3, 7, 1, -1, -1]]), compute_entropy=True)
    for row in ([3, 7, 7, 1, 3], [7, -1, 3, 1, -1], [1, 1, 1, 7, 3]):
        got = support_logprobs(logits, labels, torch.tensor([row]), compute_entropy=True)
        torch.testing.assert_close(got.logprobs, base.logprobs, rtol=1e-15, atol=1e-15)
        torch.testing.assert_close(got.entropy, base.entropy, rtol=1e-15, atol=1e-15)
    dup = support_logprobs(logits, labels, torch.tensor([[3, 7, 7, 1, 3]]))
    assert int(dup.metrics["duplicate_ids"]) == 2


def test_label_outside_support_raises_naming_rows_or_falls_back() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3, dtype=torch.float64)
    labels = torch.tensor([0, 2, 2])
    support = torch.tensor([[0, 1, -1], [0, 1, -1], [-1, -1, -1]])
    with pytest.raises(SupportLabelError, match=r"first rows \[1\] \(labels \[2\]\)") as err:
        support_logprobs(logits, labels, support)
    assert (err.value.tensor, err.value.pos) == ("labels", 1)
    got = support_logprobs(logits, labels, support, missing_label="full_vocab")
    torch.testing.assert_close(got.logprobs[1], torch.log_softmax(logits[1], 0)[2])
    assert got.valid_mask.tolist() == [True, True, False]
    assert int(got.metrics["rows_missing_label"]) == 1 and int(got.metrics["rows_fallback"]) == 1


def test_extreme_logits_stay_finite() -> None:
    logits = torch.tensor([[1e4, -1e4, 0.0, 3e4]], requires_grad=True)
    got = support_logprobs(
        logits,
        torch.tensor([1]),
        torch.tensor([[0, 1, 3]]),
        compute_entropy=True,
        entropy_requires_grad=True,
    )
    (grad,) = torch.autograd.grad(got.logprobs.sum() + got.entropy.sum(), logits)  # type: ignore[union-attr]
    assert torch.isfinite(got.logprobs).all() and torch.isfinite(grad).all()


def test_entropy_is_a_detached_metric_unless_asked() -> None:
    logits = torch.randn(4, 6, requires_grad=True)
    support = torch.tensor([[0, 1], [2, 3], [4, -1], [5, 0]])
    got = support_logprobs(logits, support[:, 0].clone(), support, compute_entropy=True)
    assert got.logprobs.requires_grad and got.entropy is not None
    assert not got.entropy.requires_grad
    assert support_logprobs(logits, support[:, 0].clone(), support).entropy is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"support": torch.tensor([[0, 123], [1, -1]])}, "vocabulary \\[0, 123\\)"),
        ({"temperature": torch.ones(3)}, "scalar or \\[N=2\\]"),
        ({"missing_label": "drop"}, "missing_label must be"),
        ({"labels": torch.tensor([200, 0])}, "labels\\[0\\] = 200"),
        ({"support": torch.tensor([0, 1])}, "must be \\[N, W\\]"),
        ({"support": torch.tensor([[0.0], [1.0]])}, "int32/int64"),
        ({"labels": torch.tensor([0])}, "labels must be"),
        ({"temperature": 0.0}, "temperature must be finite and >= 1.175e-38"),
        ({"entropy_requires_grad": True}, "needs compute_entropy"),
        ({"fallback_mask": torch.tensor([1, 0])}, "fallback_mask must be bool"),
    ],
)
def test_bad_inputs_raise_naming_the_value(kwargs: dict, match: str) -> None:
    args = {"labels": torch.tensor([0, 1]), "support": torch.tensor([[0, -1], [1, 2]])}
    args.update(kwargs)
    with pytest.raises(SupportInputError, match=match):
        support_logprobs(torch.randn(2, 123), args.pop("labels"), args.pop("support"), **args)
