"""The ``objectives`` attack family (:mod:`tests.objectives.adversary_objectives`) finds nothing:
no wrong term, gradient or metric, no hang, no untyped error, over a grid of at least 300 cases."""

from __future__ import annotations

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_the_objectives_family_finds_nothing(tmp_path):
    summary = run_family("objectives", tmp_path, timeout_s=120.0)
    print(format_summary(summary))
    assert summary["tried"] >= 300, format_summary(summary)
    assert {k: summary[k] for k in FAILURES} == dict.fromkeys(FAILURES, 0), format_summary(summary)
    assert summary["correct"] >= 150 and summary["refused"] >= 100, format_summary(summary)
