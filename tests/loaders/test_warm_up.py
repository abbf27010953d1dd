"""A loader worker reads the samples of its first task as it starts, once, on its one thread,
before the task comes (and its read-ahead's threads with it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from rollfeed.loaders.warm_up import first_tasks
from tests.loaders.common import SEQ_LEN, write_batch

TOPO = Topology(dp_rank=0, dp_size=1)


class _Reads(RolloutDataset):
    """A step directory's dataset that logs each batch of samples read: ``pid indices``."""

    log = ""

    def __getitems__(self, indices):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {[int(i) for i in indices]}\n")
        return super().__getitems__(indices)


def test_each_worker_reads_its_first_tasks_samples_once_before_the_task(tmp_path):
    samples = write_batch(tmp_path / "payload", 16, seed=3)
    (tmp_path / "steps").mkdir()
    write_step_file(tmp_path / "steps", 0, samples)
    dataset = RolloutDataset.from_step_dir(tmp_path / "steps")
    ds = _Reads(dataset.source)
    ds.log = str(tmp_path / "reads.log")
    loader = build_dataloader(
        ds,
        TOPO,
        LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN)),
        root=tmp_path / "payload",
        options=LoaderOptions(num_workers=2, read_ahead=0),
    )
    micro = [[int(i) for i in m] for m in loader.batch_sampler.step_micro_batches(0)]
    assert len(micro) >= 3
    got = list(loader)
    loader.close()
    assert len(got) == len(micro)
    by_pid: dict[str, list[list[int]]] = {}
    for line in Path(ds.log).read_text().splitlines():
        pid, rest = line.split(" ", 1)
        by_pid.setdefault(pid, []).append(json.loads(rest))
    firsts = sorted(reads[0] for reads in by_pid.values())
    assert firsts == sorted(micro[:2])  # worker w warms on micro batch w, the pass's w-th task
    for reads in by_pid.values():
        # the warm-up, then the tasks: the first task's samples read twice, no other twice
        assert reads[0] == reads[1]
        assert len(reads) == len({tuple(r) for r in reads}) + 1
    assert sum(len(r) for r in by_pid.values()) == len(micro) + 2  # one warm-up a worker


class _Sampler:
    def __init__(self, step, consumed, micro, present) -> None:
        self.state = {"step": step, "micro_batches": consumed}
        self.micro, self.present = micro, present
        self.dataset = self

    def state_dict(self):
        return self.state

    def steps_from(self, step):
        return [s for s in self.present if s >= step]

    def step_micro_batches(self, step):
        return self.micro


def test_first_tasks_are_the_passs_first_per_worker_and_nothing_is_waited_for():
    micro = [[0], [1], [2], [3], [4]]
    assert first_tasks(_Sampler(3, 3, micro, [3]), 4) == ([3], [4], None, None)
    assert first_tasks(_Sampler(3, 0, micro, [3]), 2) == ([0], [1])
    assert first_tasks(_Sampler(3, 0, micro, [4]), 2) == (None, None)  # step 3 not there yet
