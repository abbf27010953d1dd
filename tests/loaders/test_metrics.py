"""Per-step loader metrics: the plan's counts, this rank's micro batches as handed out (what the
maker measured travels with each one), the trainer's wait; a truncation is a warning per step."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from tests.loaders.common import SEQ_LEN, reference, write_batch

TOPO = Topology(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
CONFIG = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")
WAITS = ("make_s", "samples_s", "wait_s", "wait_max_s", "wait_making_s", "wait_handover_s")
COUNTS = ("read_ahead",)  # of the micro batches, those a worker made before it was asked


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("metrics")
    samples = write_batch(base / "payload", 20, seed=12)
    (base / "steps").mkdir()
    write_step_file(base / "steps", 0, samples)
    ref, plan = reference(samples, dp_size=2, cp_size=2, cp_layout="zigzag", root=base / "payload")
    return base, ref[1, 1], plan


def _loader(base, topology=TOPO, **options):
    ds = RolloutDataset.from_step_dir(base / "steps")
    opts = LoaderOptions(**options)
    return build_dataloader(
        ds, topology, LoaderConfig(plan=CONFIG), root=base / "payload", options=opts
    )


def _expected(ref, plan, taken: int) -> dict:
    """What the metrics must say after ``taken`` micro batches, from the single-process
    reference: the planner's counts, and the reference tensors themselves."""
    tmbs = ref[:taken]
    masks = [t.fields["sampling_mask"] for t in tmbs if "sampling_mask" in t.fields]
    widths = np.concatenate([m.lengths().numpy() for m in masks])
    widths = widths[widths > 0]
    keys = ("samples", "tokens", "truncated", "truncated_tokens", "dropped", "padding_fraction")
    keys += ("loss_tokens", "samples_without_loss", "micro_batches_without_loss")
    keys += ("dummy_micro_batches", "truncated_before_image", "dropped_at_image")
    out = {k: plan.metrics[k] for k in keys}
    out.update(
        step=0,
        micro_steps=plan.metrics["micro_steps"],
        micro_batches=taken,
        rank_samples=sum(t.num_samples for t in tmbs),
        rank_tokens=sum(int(t.seq_lens.sum()) for t in tmbs),
        payload_bytes=sum(v.nbytes for t in tmbs for v in t.fields.values()),
        support_rows=len(widths),
        support_width_mean=float(widths.mean()),
        support_width_max=int(widths.max()),
        # no sample holds versions: every loss token of the whole rows is unversioned
        stale_samples=0,
        stale_dropped=0,
        reshard_restarted=0,  # a pass from the start: on_reshard did nothing
        reshard_skipped=0,
        tokens_lag0=0,
        tokens_lag_ahead=0,
        tokens_unversioned=sum(int(t.step_counts.sample_loss_tokens.sum()) for t in tmbs),
        stale_masked_tokens=0,
    )
    for q in (50, 90, 99):
        out[f"support_width_p{q}"] = int(np.quantile(widths, q / 100, method="inverted_cdf"))
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_metrics_count_the_micro_batches_handed_out_and_the_plan(run, num_workers):
    base, ref, plan = run
    assert plan.metrics["truncated"] > 0  # the data has overlong samples
    loader = _loader(base, num_workers=num_workers, receive_depth=3)
    assert loader.metrics == {}
    it = iter(loader)
    for _ in range(2):
        next(it)
    # the workers and the receive thread are ahead: only what was handed out is counted
    got = loader.metrics
    assert {k: got[k] for k in _expected(ref, plan, 2)} == pytest.approx(_expected(ref, plan, 2))
    rest = list(it)
    got = loader.metrics  # the pass ended: its metrics stay until the next pass starts
    want = _expected(ref, plan, 2 + len(rest))
    assert {k: got[k] for k in want} == pytest.approx(want)
    assert sorted(got) == sorted([*want, *WAITS, *COUNTS])
    assert 0 < got["samples_s"] < got["make_s"]
    assert got["make_s"] > 0 and got["wait_max_s"] <= got["wait_s"]
    assert got["wait_s"] == pytest.approx(got["wait_making_s"] + got["wait_handover_s"])
    # The keys' names before the kept set's public name became "support": read, with a warning.
    with pytest.warns(DeprecationWarning, match=r"loader.metrics\['support_width_max'\]"):
        assert got["kept_width_max"] == got["support_width_max"] > 0
    loader.close()


def test_truncation_is_a_warning_once_per_step_naming_samples_and_tokens(run, caplog):
    base, ref, plan = run
    loader = _loader(base, Topology(dp_rank=0, dp_size=2, cp_rank=0, cp_size=2))
    with caplog.at_level(logging.WARNING, logger="rollfeed.loaders"):
        assert len(loader) == len(ref)  # plans the step
        list(loader)  # plans it again only if it must: still one warning
    warned = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert len(warned) == 1, warned
    n, tokens = plan.metrics["truncated"], plan.metrics["truncated_tokens"]
    assert f"step 0: {n} of 20 samples" in warned[0] and f"{tokens} tokens cut" in warned[0]
    assert "overlong='error'" in warned[0]  # how to make it an error
    assert loader.metrics["truncated"] == n and loader.metrics["truncated_tokens"] == tokens
