"""Loaders on real ranks: DP 2 x CP 2 and DP 1 x CP 4, num_workers 0 and 2 (one launch each)."""

from __future__ import annotations

import json

import pytest

from rollfeed.loaders import write_step_file
from tests.dist.launch import torchrun
from tests.loaders.common import write_batch


@pytest.mark.dist
@pytest.mark.parametrize("cp_size", [2, 4])
def test_loader_ranks_equal_reference(tmp_path, cp_size):
    samples = write_batch(tmp_path / "payload", 19, seed=21)
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 0, samples)
    torchrun("tests/dist/run_loader.py", nproc=4, args=[str(tmp_path), str(cp_size)], timeout=90)
    ok = json.loads((tmp_path / f"ok_cp{cp_size}.json").read_text())
    assert ok == {"ranks": 4, "samples": 19}
