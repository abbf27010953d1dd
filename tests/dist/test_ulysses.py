import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_ulysses_sp2_matches_sp1_contiguous_and_zigzag() -> None:
    torchrun("tests/dist/run_ulysses_sp.py", nproc=2, timeout=90)
