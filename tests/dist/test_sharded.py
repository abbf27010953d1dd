"""Sharded scoring and training (FSDP2, DTensor TP, sequence-parallel norms, Ulysses cp, MoE with
router replay) equal one unsharded float64 process, in one 4-rank launch (see run_sharded.py)."""

from __future__ import annotations

import re

import pytest

from tests.dist.launch import torchrun
from tests.dist.run_sharded import CASES


@pytest.mark.dist
def test_sharded_scoring_and_adamw_steps_equal_unsharded_reference_on_every_mesh() -> None:
    out = torchrun("tests/dist/run_sharded.py", nproc=4, timeout=240)
    for case in CASES:
        ranks = set(re.findall(rf"case {case.name} rank (\d) ok", out))
        assert ranks == {"0", "1", "2", "3"}, (case.name, out)
    for check in ("refused head", "topology"):
        assert set(re.findall(rf"{check} rank (\d) ok", out)) == {"0", "1", "2", "3"}, out
