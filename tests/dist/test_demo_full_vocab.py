import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_demo_full_vocab_scores_a_tree_micro_batch_over_cp2_as_its_flat_twin() -> None:
    out = torchrun("tests/dist/run_demo_full_vocab.py", nproc=2, timeout=120)
    assert "demo full vocab cp 2 zigzag tree" in out, out
