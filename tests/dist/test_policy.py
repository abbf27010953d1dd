import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_policy_scorer_sp2_equals_single_rank_on_planner_micro_batches() -> None:
    torchrun("tests/dist/run_policy_sp.py", nproc=2, timeout=120)


@pytest.mark.dist
def test_policy_scorer_sp2_tp2_vocab_parallel_head_equals_single_rank() -> None:
    torchrun("tests/dist/run_policy_sp.py", nproc=4, timeout=150)
