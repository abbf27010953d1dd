"""The ``cli_steps`` attack family (:mod:`tests.cli.adversary_cli`): ``verify --steps`` names
exactly what the loader cannot read, and never raises, hangs or mistakes its exit status."""

from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


def test_verify_steps_agrees_with_the_loader_on_crafted_step_files(tmp_path):
    s = run_family("cli_steps", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 90 and s["correct"] and s["refused"] >= 80, format_summary(s)
