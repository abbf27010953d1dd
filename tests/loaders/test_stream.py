"""Stream mode: steps appear while training, workers persist, a stalled producer times out."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepTimeoutError,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.step_files import write_step_file
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch


@pytest.mark.timeout(60)
def test_stream_follows_producer_with_persistent_workers(tmp_path):
    samples = write_batch(tmp_path / "payload", 27, seed=8)
    steps = {7: samples[:10], 8: samples[10:18], 9: samples[18:]}
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 7, steps[7])

    def produce():
        for step in (8, 9):
            time.sleep(0.4)
            write_step_file(tmp_path / "steps", step, steps[step])

    producer = threading.Thread(target=produce)
    producer.start()
    topo = Topology(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    ds = RolloutDataset.from_step_dir(tmp_path / "steps")
    loader = build_dataloader(
        ds,
        topo,
        LoaderConfig(
            plan=PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag"),
            stream=True,
            step_timeout_s=10,
        ),
        root=tmp_path / "payload",
        options=LoaderOptions(num_workers=2),
    )
    got: dict[int, list] = {}
    pids = set()
    for _ in range(3):  # one pass per step; each micro batch labelled with its step
        it = iter(loader)
        for tmb in it:
            got.setdefault(it.step, []).append(tmb)
            pids.add(tuple(sorted(p.pid for p in multiprocessing.active_children())))
    producer.join()
    assert sorted(got) == [7, 8, 9]
    assert len(pids) == 1 and len(next(iter(pids))) >= 2  # the same workers served every step
    for step, batch in steps.items():
        root = tmp_path / "payload"
        ref, _ = reference(batch, dp_size=2, cp_size=2, cp_layout="zigzag", root=root)
        assert len(got[step]) == len(ref[1, 1])
        for k, (a, b) in enumerate(zip(got[step], ref[1, 1], strict=True)):
            assert_bitwise(a, b, (step, k))
    t0 = time.monotonic()
    loader.batch_sampler.step_timeout_s = 0.3
    with pytest.raises(StepTimeoutError, match=r"step_000010\.rfs"):
        next(iter(loader))
    assert time.monotonic() - t0 < 5
