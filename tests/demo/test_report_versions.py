"""The demo report's policy versions: tokens by lag, the mismatch of lag 0 against lag 1 weighted
by each step's tokens, and a partial rollout's per-token versions as runs."""

import pytest

from rollfeed.demo.report import format_report, summarize, write_plot
from tests.demo.test_demo import ROLLOUTS, rank, step

RANKS = [rank([-0.5], [-0.5], [-0.6], [2])]
LAG0 = {
    "rows_centered": 3,
    "slots_invalid": 0,
    "lag0_tokens": 10,
    "lag0_kl": 1e-4,
    "lag0_k3": 2e-4,
    "lag0_chi2": 3e-4,
}
STEP1 = {
    "rows_centered": 3,
    "slots_invalid": 0,
    "lag0_tokens": 5,
    "lag0_kl": 4e-4,
    "lag0_k3": 5e-4,
    "lag0_chi2": 6e-4,
}
STEP1 |= {"lag1_tokens": 15, "lag1_kl": 7e-3, "lag1_k3": 1e-3, "lag1_chi2": 9e-3}


def trainer(partial):
    first = step(0, 0.5, [0.0], [1.0]) | {"objective": LAG0, "partial": []}
    first |= {"tokens_by_lag": {"lag0": 10}, "stale_dropped": 0}
    second = step(1, 0.4, [0.1], [1.0]) | {"objective": STEP1, "partial": partial}
    second |= {"tokens_by_lag": {"lag0": 5, "lag1": 15}, "stale_dropped": 2}
    return {"cp": 1, "ranks": RANKS, "lr": 1e-4, "clip_eps": 0.2, "train": [first, second]}


def test_report_shows_lag_0_against_lag_1_and_a_partial_rollout(tmp_path):
    partial = [{"sample": "ab12", "versions": [-1, -1, 0, 0, 1, -1]}]
    t = trainer(partial) | {"max_staleness": 1, "on_stale": "drop"}
    text = format_report(ROLLOUTS, summarize(ROLLOUTS, t))
    assert "loss tokens by lag (trained step - sampling version): lag 0 15, lag 1 15" in text
    assert "max_staleness 1 (on_stale 'drop'): 2 samples dropped; 1 partial rollouts" in text
    # lag 0 over both steps: k3 (2e-4 x 10 + 5e-4 x 5) / 15 = 3e-4, KL (1e-4 x 10 + 4e-4 x 5) / 15
    # = 2e-4, χ² (3e-4 x 10 + 6e-4 x 5) / 15 = 4e-4; lag 1 only at step 1.
    assert "     0      15   2.00e-04   3.00e-04   4.00e-04  sampled by the weights" in text
    assert "     1      15   7.00e-03   1.00e-03   9.00e-03  sampled one version" in text
    assert "     0   2.00e-04        n/a" in text  # step 0 has no lag-1 token: n/a, not 0
    assert "partial rollout: step 1, sample ab12: per-token versions in the micro batch " in text
    assert "[none x2, v0 x2, v1 x1, none x1]" in text
    pytest.importorskip("matplotlib", reason="the demo extra is not installed")
    png = write_plot(summarize(ROLLOUTS, t), tmp_path / "demo.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_a_partial_rollout_says_so():
    text = format_report(ROLLOUTS, summarize(ROLLOUTS, trainer([])))
    assert "partial rollout: none this run" in text


def test_a_trainer_without_versions_prints_no_version_lines():
    t = trainer([])
    for record in t["train"]:
        del record["tokens_by_lag"]
    assert "mismatch by version lag" not in format_report(ROLLOUTS, summarize(ROLLOUTS, t))
