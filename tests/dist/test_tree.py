import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_tree_scoring_over_cp2_equals_one_rank_and_each_sample_alone() -> None:
    out = torchrun("tests/dist/run_tree_cp.py", nproc=2, timeout=150)
    measured = [line for line in out.splitlines() if line.startswith("cp 2 ")]
    assert len(measured) == 5, out  # dense and MoE, two layouts; the Gated DeltaNet
    print("\n".join(measured))  # the largest differences, shown with -s
