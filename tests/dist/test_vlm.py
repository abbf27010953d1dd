import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_vlm_packed_cp2_and_fsdp2_image_text_ranks_equal_per_sample_stock_scoring() -> None:
    out = torchrun("tests/dist/run_vlm_cp.py", nproc=2, timeout=180)
    for line in ("cp2 contiguous", "cp2 zigzag", "fsdp2 image/text ranks"):
        assert line in out
