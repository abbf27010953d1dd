"""A process's threads read a step directory's samples at once (a worker's read-ahead): the same
samples as one thread reading them in turn, from a local directory and from an object store, and
a step file evicted while a thread reads from it is closed only once that read ends."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rollfeed.loaders import RolloutDataset, write_step_file
from rollfeed.payload import StepRecordFile
from tests.loaders.common import write_batch
from tests.loaders.test_object_store_steps import store_options

STRIDE = 2**32
THREADS = 4


def _json(samples) -> list[str]:
    return [s.to_json() for s in samples]


def _read_at_once(ds: RolloutDataset, steps: dict[int, int]) -> list[list[str]]:
    """Every sample of ``steps`` (step -> sample count) read by each of THREADS threads, released
    together, each in its own order (so their reads interleave)."""
    indices = [s * STRIDE + i for s, n in steps.items() for i in range(n)]
    start = threading.Barrier(THREADS)

    def one(t: int) -> list[str]:
        start.wait()
        order = np.random.default_rng(t).permutation(len(indices)).tolist()
        got = {k: ds[indices[k]].to_json() for k in order}
        return [got[k] for k in range(len(indices))]

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(one, range(THREADS)))


@pytest.mark.timeout(60)
def test_threads_reading_a_local_steps_samples_get_what_one_thread_gets(tmp_path):
    samples = write_batch(tmp_path / "payload", 30, seed=3)
    for step, (a, b) in {0: (0, 12), 1: (12, 30)}.items():
        write_step_file(tmp_path / "steps", step, samples[a:b])
    # one cached step: the threads' reads of two steps evict each other's files as they go
    ds = RolloutDataset.from_step_dir(tmp_path / "steps", cache_steps=1)
    for got in _read_at_once(ds, {0: 12, 1: 18}):
        assert got == _json(samples)
    assert ds.metrics()["samples_read"] == THREADS * 30  # every read counted, none lost


@pytest.mark.timeout(90)
def test_threads_reading_a_stored_steps_samples_get_what_one_thread_gets(
    tmp_path, object_store, s3_url
):
    from rollfeed.payload import PayloadRoot

    samples = write_batch(PayloadRoot(f"{s3_url}/payload", **object_store.options()), 20, seed=4)
    access = store_options(object_store)
    write_step_file(f"{s3_url}/steps", 0, samples, store=access)
    ds = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=access)
    one = _json(ds[i] for i in range(20))
    assert one == _json(samples)
    fresh = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=access)  # nothing read yet
    for got in _read_at_once(fresh, {0: 20}):
        assert got == one


@pytest.mark.timeout(60)
def test_a_step_evicted_while_a_thread_reads_it_is_closed_after_that_read(tmp_path, monkeypatch):
    samples = write_batch(tmp_path / "payload", 6, seed=5)
    write_step_file(tmp_path / "steps", 0, samples[:3])
    write_step_file(tmp_path / "steps", 1, samples[3:])
    ds = RolloutDataset.from_step_dir(tmp_path / "steps", cache_steps=1)
    ds.lengths(0)
    reading, evicted = threading.Event(), threading.Event()
    read = StepRecordFile.read

    def held_up(f, index, i):  # thread A's read waits until step 0 has been evicted
        if f.rel.endswith("step_000000.rfs") and not evicted.is_set():
            reading.set()
            assert evicted.wait(10)
        return read(f, index, i)

    monkeypatch.setattr(StepRecordFile, "read", held_up)
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(lambda: ds[1].to_json())
        assert reading.wait(10)
        assert ds[STRIDE + 2].to_json() == samples[5].to_json()  # loads step 1: evicts step 0
        evicted.set()
        assert a.result(10) == samples[1].to_json()  # its file was still open for this read
    assert ds[0].to_json() == samples[0].to_json()  # step 0 again, a fresh file
