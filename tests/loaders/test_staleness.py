"""The loader's staleness bound on a step file of samples with policy versions: ``"drop"`` leaves
stale samples out of the plan from the step index alone (their records never read), ``"mask"``
takes their stale tokens out of the loss, ``"error"`` names the first stale sample; each counted.

Step 9, ``max_staleness=1``; 12 loss tokens a sample (tokens 4..15), by sample: versions 9; 8; 6
then 9 (a partial rollout, stale); 5; none; 10 (ahead of the step); 7; 8 then 9 (not stale).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig, Sample
from rollfeed.loaders import LoaderConfig, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.staleness import StaleSampleError
from rollfeed.loaders.step_files import write_step_file

STEP, BOUND, T, PROMPT = 9, 1, 16, 4
SPANS = [
    [[4, 16, 9]],
    [[4, 16, 8]],
    [[4, 10, 6], [10, 16, 9]],
    [[4, 16, 5]],
    None,
    [[4, 16, 10]],
    [[4, 16, 7]],
    [[4, 8, 8], [8, 16, 9]],
]
STALE = [2, 3, 6]
TOPOLOGY = Topology(dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
PLAN = PlanConfig(seq_len=48)


def _sample(i: int, spans) -> Sample:
    mask = np.arange(T) >= PROMPT
    return Sample(
        (np.arange(T) * 7 + i) % 97,
        loss_mask=mask,
        advantages=np.where(mask, 1.0 + i, 0.0).astype(np.float32),
        inference_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        version_spans=spans,
        uid=f"s{i}",
    )


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stale-steps")
    write_step_file(directory, STEP, [_sample(i, s) for i, s in enumerate(SPANS)])
    return directory


def _pass(steps, **bound):
    dataset = RolloutDataset.from_step_dir(steps)
    loader = build_dataloader(dataset, TOPOLOGY, LoaderConfig(plan=PLAN, **bound), root=None)
    n = len(loader)  # plans the step
    assert dataset.metrics()["samples_read"] == 0  # from the step index alone
    tmbs = list(loader)
    assert len(tmbs) == n
    metrics = dict(loader.metrics)
    loader.close()
    return tmbs, metrics, dataset.metrics()["samples_read"]


def test_drop_leaves_stale_samples_out_of_the_plan_from_the_index(steps):
    tmbs, metrics, read = _pass(steps, max_staleness=BOUND, on_stale="drop")
    kept = len(SPANS) - len(STALE)
    assert read == kept  # the stale samples' records were never read
    assert (metrics["stale_samples"], metrics["stale_dropped"]) == (3, 3)
    assert metrics["samples"] == sum(t.num_samples for t in tmbs) == kept
    assert sum(int(t.loss_mask.sum()) for t in tmbs) == 12 * kept
    assert sorted({float(a) for t in tmbs for a in t.advantages[t.loss_mask]}) == [
        1.0 + i for i in range(len(SPANS)) if i not in STALE
    ]
    # lag 0: sample 0 and 8 tokens of sample 7; lag 1: sample 1 and 4 of sample 7
    assert (metrics["tokens_lag0"], metrics["tokens_lag1"]) == (20, 16)
    assert (metrics["tokens_lag_ahead"], metrics["tokens_unversioned"]) == (12, 12)
    assert metrics["stale_masked_tokens"] == 0 and "tokens_lag2" not in metrics


def test_mask_takes_stale_tokens_out_of_the_loss(steps):
    plain, _, _ = _pass(steps)
    tmbs, metrics, read = _pass(steps, max_staleness=BOUND, on_stale="mask")
    assert read == len(SPANS) and (metrics["stale_samples"], metrics["stale_dropped"]) == (3, 0)
    masked = 0
    for got, want in zip(tmbs, plain, strict=True):
        v = want.versions.to(torch.int64)
        stale = (v >= 0) & (v < STEP - BOUND)
        assert torch.equal(got.loss_mask, want.loss_mask & ~stale)
        masked += int((want.loss_mask & stale).sum())
        assert torch.equal(got.versions, want.versions)
        assert got.step_counts == want.step_counts  # the plan's normalisation stays
        for name in ("input_ids", "labels", "advantages", "inference_logprobs"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert masked == 6 + 12 + 12 == metrics["stale_masked_tokens"]
    # counted before the mask: lag 3 (6 tokens of sample 2), 4 (sample 3), 2 (sample 6)
    assert [metrics[f"tokens_lag{k}"] for k in range(5)] == [20 + 6, 16, 12, 6, 12]


def test_error_names_the_first_stale_sample_at_plan_time(steps):
    dataset = RolloutDataset.from_step_dir(steps)
    config = LoaderConfig(plan=PLAN, max_staleness=BOUND)
    loader = build_dataloader(dataset, TOPOLOGY, config, root=None)
    with pytest.raises(StaleSampleError) as err:
        len(loader)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert "sample 2 of step 9" in message and "policy version 6" in message
    assert "max_staleness=1" in message and f"step_{STEP:06d}" in message
    assert dataset.metrics()["samples_read"] == 0
    loader.close()
