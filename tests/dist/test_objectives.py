"""Loss objectives over cp 2 (both layouts) and TP 2 equal one process (see run_objectives.py)."""

from __future__ import annotations

import re

import pytest

from tests.dist.launch import torchrun


@pytest.mark.dist
def test_objectives_over_cp_and_tp_equal_one_process() -> None:
    out = torchrun("tests/dist/run_objectives.py", nproc=2, timeout=240)
    cp = set(re.findall(r"rank (\d) cp (\S+) ok", out))
    tp = set(re.findall(r"rank (\d)/2 tp (\S+) shard", out))
    layouts = {
        f"{lay}/{name}"
        for lay in ("contiguous", "zigzag")
        for name in ("tis+seq-sum-cap", "clip+mis+seq-mean-band+veto")
    }
    assert cp == {(r, w) for r in "01" for w in layouts}, out
    assert tp == {(r, n) for r in "01" for n in ("tis+seq-sum-cap", "clip+mis+seq-mean-band+veto")}
