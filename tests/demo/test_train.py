"""The demo's training loss: the clipped surrogate's worked example, values and gradients."""

import pytest
import torch

from rollfeed.demo.train import checkpoint_path, clipped_surrogate, latest_checkpoint


def test_clipped_surrogate_worked_example():
    sampler = torch.tensor([-1.0, -2.0, -0.5])
    logprobs = (
        sampler.double() + torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)
    ).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -2.0])
    loss = clipped_surrogate(logprobs, sampler, advantages, total_tokens=3, clip_eps=0.2)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 1.6) / 3, abs=1e-12)
    loss.backward()
    # Clipped ratios carry no gradient; the unclipped one: -A * r / N.
    assert logprobs.grad.tolist() == pytest.approx([-1 / 3, 0.0, 0.0], abs=1e-12)


def test_clipped_surrogate_normalises_by_the_global_count():
    lp = torch.tensor([-0.1, -0.2], dtype=torch.float64)
    adv = torch.tensor([0.5, -1.5])
    one = clipped_surrogate(lp, lp.float(), adv, total_tokens=2, clip_eps=0.2)
    # The same tokens as part of a step with 8 loss tokens on all ranks: a quarter of the loss.
    part = clipped_surrogate(lp, lp.float(), adv, total_tokens=8, clip_eps=0.2)
    assert one.item() == pytest.approx(-(0.5 - 1.5) / 2, abs=1e-7)
    assert part.item() == pytest.approx(one.item() / 4, abs=1e-12)


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((1, True), (2, True), (3, False)):  # step 3: interrupted mid-save
        path = checkpoint_path(tmp_path, step)
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"")
        if complete:
            (path / ".metadata").write_bytes(b"")
    assert checkpoint_path(tmp_path, 2).name == "step_000002"
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)
