"""Vocab-parallel support scoring on real gloo ranks equals TP=1 (see run_tp_scoring.py)."""

from __future__ import annotations

import re

import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_scoring_matches_tp1_with_one_max_and_one_sum(tp: int) -> None:
    out = torchrun("tests/dist/run_tp_scoring.py", nproc=tp)
    ranks = set(re.findall(rf"rank (\d+)/{tp} shard \[\d+, \d+\) ok", out))
    assert ranks == {str(r) for r in range(tp)}, out
