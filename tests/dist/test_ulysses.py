import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_ulysses_over_cp2_matches_cp1_contiguous_and_zigzag() -> None:
    torchrun("tests/dist/run_ulysses_cp.py", nproc=2, timeout=90)
