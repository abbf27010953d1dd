"""Crafted loss runs in a step index are refused with a typed error or read as the samples' own:
no count taken from them reaches a micro batch (the ``loss_runs`` family,
:mod:`tests.loaders.run_attacks`)."""

from __future__ import annotations

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_crafted_loss_runs_never_reach_a_micro_batch(tmp_path):
    s = run_family("loss_runs", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 50 and s["correct"] and s["refused"], format_summary(s)
