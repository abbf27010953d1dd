"""Step files whose index claims shared prefixes read through the loader exactly as the same
samples planned in memory with those claims, or refused naming the step file (the
``tree_index`` family, :mod:`tests.loaders.tree_index_attacks`)."""

from __future__ import annotations

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_claims_in_a_step_index_read_as_planned_in_memory_or_name_the_file(tmp_path):
    s = run_family("tree_index", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 30 and s["correct"] and s["refused"], format_summary(s)
