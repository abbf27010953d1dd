"""The step's loss normalised from the micro batches' own step counts, over dp 2 x cp 2 with
FSDP2 and sum_gradients, equals one process over the whole truncated step, for every aggregation
mode; DDP with sum_gradients sums (see run_loss_norm.py)."""

from __future__ import annotations

import re

import pytest

from rollfeed.objectives import AGGREGATIONS
from tests.dist.launch import torchrun


@pytest.mark.dist
def test_dp2_cp2_loss_and_gradients_equal_one_process(tmp_path):
    out = torchrun("tests/dist/run_loss_norm.py", nproc=4, args=["--workdir", str(tmp_path)])
    print("\n".join(line for line in out.splitlines() if line.startswith(("mode", "ddp"))))
    found = re.findall(r"mode (\S+) .* loss_diff (\S+) grad_diff (\S+)", out)
    assert sorted(m for m, _, _ in found) == sorted(AGGREGATIONS), out
    assert all(float(a) < 1e-10 and float(b) < 1e-10 for _, a, b in found), found
    assert "ddp sum_gradients diff" in out and "ddp default mean diff" in out, out
