import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_policy_scorer_cp2_equals_single_rank_on_planner_micro_batches() -> None:
    torchrun("tests/dist/run_policy_cp.py", nproc=2, timeout=120)


@pytest.mark.dist
def test_policy_scorer_cp2_tp2_from_topology_equals_single_rank_and_refuses_mismatch() -> None:
    torchrun("tests/dist/run_policy_cp.py", nproc=4, timeout=150)
