import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_tree_scoring_over_cp2_equals_one_rank_and_each_sample_alone() -> None:
    torchrun("tests/dist/run_tree_cp.py", nproc=2, timeout=150)
