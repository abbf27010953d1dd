"""The cursor attack family (:mod:`tests.orchestrator.cursor_attacks`): a producer's cursor log
cut, flipped, spliced or forged reads back as the records whole before a torn tail, or is refused
with a typed error; never other records."""

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_cursor_attacks_read_a_prefix_or_are_refused(tmp_path):
    s = run_family("cursor", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 120 and s["correct"] >= 60 and s["refused"] >= 50, format_summary(s)
