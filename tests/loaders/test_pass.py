"""A pass is a step, with workers or without: ``for``, ``list()`` and ``len()`` agree, and a pass
ends with its step's last micro batch, never waiting for the next step's file.

The loop is a synchronous RL loop: step k + 1 is written only after step k was consumed, so a
pass that waits for the next step's file waits for a file that only its own end would bring.
"""

from __future__ import annotations

import time

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from tests.loaders.common import SEQ_LEN, reference, write_batch
from tests.loaders.resume import tmb_key

STEPS = 4
PER_STEP = 4  # samples: at most 4 micro batches, what two workers prefetch at the pass's start
STEP_TIMEOUT_S = 20  # a pass that waited for the next step would fail after this


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options",
    [dict(num_workers=0), dict(num_workers=0, receive_depth=1), dict(num_workers=2)],
    ids=["main", "main-thread", "workers"],
)
def test_synchronous_loop_passes_end_at_their_steps_last_micro_batch(tmp_path, options):
    samples = write_batch(tmp_path / "payload", STEPS * PER_STEP, seed=9)
    steps = [samples[k * PER_STEP : (k + 1) * PER_STEP] for k in range(STEPS)]
    refs = [
        [tmb_key(t) for t in reference(s, dp_size=1, cp_size=1, cp_layout="contiguous",
                                       root=tmp_path / "payload")[0][0, 0]]
        for s in steps
    ]  # fmt: skip
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 0, steps[0])
    loader = build_dataloader(
        RolloutDataset.from_step_dir(tmp_path / "steps"),
        Topology(dp_rank=0, dp_size=1),
        LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN), step_timeout_s=STEP_TIMEOUT_S),
        root=tmp_path / "payload",
        options=LoaderOptions(**options),
    )
    seconds = []
    for k in range(STEPS):
        t0 = time.monotonic()
        assert len(loader) == len(refs[k])  # the pass iter() would start: this step's
        if k % 2 == 0:
            got = list(loader)  # iter(), then len() as its length hint
        else:
            it = iter(loader)
            assert len(loader) == len(refs[k])  # a pass just started: still the whole step
            got = [tmb for tmb in it]
        seconds.append(time.monotonic() - t0)
        assert [tmb_key(t) for t in got] == refs[k], k
        assert loader.state_dict()["step"] == k + 1
        if k + 1 < STEPS:
            write_step_file(tmp_path / "steps", k + 1, steps[k + 1])  # only now
    print(f"pass seconds ({options}): {', '.join(f'{s:.3f}' for s in seconds)}")
    # the first pass starts the workers; none waits for the step that comes after it
    assert max(seconds) < 1.0, seconds
    loader.close()
