import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_policy_scorer_cp2_equals_single_rank_on_the_moe_families() -> None:
    torchrun("tests/dist/run_policy_families.py", nproc=2, timeout=180)
