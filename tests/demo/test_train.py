"""The demo's training loss: the clip-only worked example, centering's, and the normalisation."""

import dataclasses
import math

import pytest
import torch

from rollfeed.collate import RaggedRows, StepCounts, TensorMicroBatch
from rollfeed.demo.objective import DemoObjective
from rollfeed.demo.train import checkpoint_path, latest_checkpoint
from rollfeed.models import SupportScores
from rollfeed.objectives import aggregate


def _micro_batch(sampler, advantages, fields=None):  # type: ignore[no-untyped-def]
    n = len(sampler)
    return TensorMicroBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        position_ids=torch.arange(n),
        labels=torch.tensor([3] * n),
        loss_mask=torch.ones(n, dtype=torch.bool),
        advantages=torch.tensor(advantages),
        inference_logprobs=torch.tensor(sampler),
        temperatures=torch.ones(n),
        positions=torch.arange(n),
        seq_lens=torch.tensor([n + 1], dtype=torch.int32),
        cu_seqlens=torch.tensor([0, n + 1], dtype=torch.int32),
        seq_len=n + 1,
        cp_rank=0,
        cp_size=1,
        cp_layout="contiguous",
        fields=fields or {},
        step_counts=_counts(n),
    )


def _counts(loss_tokens: int) -> StepCounts:
    """A step of one sample whose ``loss_tokens`` loss tokens are all in this micro batch, or
    (more of them) partly elsewhere."""
    return StepCounts(
        loss_tokens=loss_tokens,
        samples=1,
        samples_with_loss=1,
        sample_loss_tokens=torch.tensor([loss_tokens]),
    )


def _scores(logprobs, kept=None):  # type: ignore[no-untyped-def]
    n = logprobs.numel()
    if kept is None:
        kept = RaggedRows(torch.zeros(n + 1, dtype=torch.int64), logprobs.new_zeros(0))
    return SupportScores(
        logprobs=logprobs,
        entropy=None,
        valid_mask=torch.ones(n, dtype=torch.bool),
        support_logprobs=kept,
    )


def test_clip_only_worked_example():
    sampler = [-1.0, -2.0, -0.5]
    mb = _micro_batch(sampler, [1.0, 1.0, -2.0])
    logprobs = (
        torch.tensor(sampler, dtype=torch.float64) + torch.tensor([0.0, 0.5, -0.5])
    ).requires_grad_()
    objective = DemoObjective(clip_eps=0.2, correction="none", centering=False)
    terms = objective.terms(mb, _scores(logprobs), cp_group=None)
    loss = aggregate(terms.loss, mb)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 1.6) / 3, abs=1e-7)
    loss.backward()
    # Clipped ratios carry no gradient; the unclipped one: -A * r / N.
    assert logprobs.grad.tolist() == pytest.approx([-1 / 3, 0.0, 0.0], abs=1e-7)
    # The same tokens as part of a step with 12 loss tokens on all ranks: a quarter of the loss.
    part = aggregate(terms.loss, dataclasses.replace(mb, step_counts=_counts(12)))
    assert part.item() == pytest.approx(loss.item() / 4, abs=1e-12)


def test_centering_worked_example():
    # S = {3, 5}: p^S = [0.5, 0.5], q^S = [0.8, 0.2]; no clip, no correction, A = 1.
    z = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    kept_lp = z - torch.logsumexp(z, 0)
    mask = torch.tensor([[3, 5]], dtype=torch.int32)
    logprobs_field = torch.full((2, 2), -math.inf, dtype=torch.float64)
    logprobs_field[1] = torch.tensor([math.log(0.8), math.log(0.2)], dtype=torch.float64)
    mb = _micro_batch(
        [math.log(0.8)],
        [1.0],
        fields={"sampling_mask": mask, "sampling_mask_logprobs": logprobs_field},
    )
    kept = RaggedRows(torch.tensor([0, 2]), kept_lp)
    terms = DemoObjective(clip_eps=0.0, correction="none", centering=True).terms(
        mb, _scores(kept_lp[:1], kept), cp_group=None
    )
    assert terms.loss.item() == pytest.approx(0.0, abs=1e-12)
    terms.loss.sum().backward()
    assert z.grad.tolist() == pytest.approx([-0.2, 0.2], abs=1e-12)  # plain score: -0.5, 0.5


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
