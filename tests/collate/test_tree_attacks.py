"""Samples that claim a prefix they do not share, and trees that do not fit their samples, are
refused with a typed error or read exactly as the samples packed one by one (the ``trees``
family, :mod:`tests.collate.tree_attacks`)."""

from __future__ import annotations

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_claimed_prefixes_that_do_not_hold_never_read_silently(tmp_path):
    s = run_family("trees", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 300 and s["correct"] and s["refused"], format_summary(s)
