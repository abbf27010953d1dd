"""Receive thread: bitwise output, state of the consumed batches, rewind, no thread left behind."""

from __future__ import annotations

import gc
import math
import multiprocessing
import threading
import time

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    LoaderOptions,
    RolloutDataset,
    RolloutLoader,
    StepTimeoutError,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.receive import THREAD_NAME
from rollfeed.loaders.step_files import read_step_file, write_step_file
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch
from tests.loaders.resume import tmb_key

TOPO = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
CONFIG = PlanConfig(seq_len=SEQ_LEN, cp_size=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("prefetch")
    samples = write_batch(base / "payload", 24, seed=6)
    (base / "steps").mkdir()
    write_step_file(base / "steps", 0, samples[:14])
    write_step_file(base / "steps", 1, samples[14:])
    return base


def _loader(run, **kw) -> RolloutLoader:
    ds = RolloutDataset.from_step_dir(run / "steps")
    return build_dataloader(
        ds, TOPO, LoaderConfig(plan=CONFIG), root=run / "payload", options=LoaderOptions(**kw)
    )


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _wait_no_thread(seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while _threads() and time.monotonic() < end:
        gc.collect()
        time.sleep(0.02)
    assert not _threads(), _threads()


def _position(state: dict) -> tuple[int, int]:
    return state["step"], state["micro_batches"]


@pytest.mark.parametrize(
    ("num_workers", "handover"),
    [(0, None), (2, None), (2, "torch")],
    ids=["main", "memfd", "torch"],
)
def test_threaded_passes_equal_reference_bitwise(run, num_workers, handover):
    loader = _loader(run, num_workers=num_workers, receive_depth=2, handover=handover)
    for step in (0, 1):
        samples = read_step_file(run / "steps" / f"step_{step:06d}.rfs")
        ref, _ = reference(
            samples, dp_size=1, cp_size=2, cp_layout="contiguous", root=run / "payload"
        )
        assert len(loader) == len(ref[0, 1]) > 2
        got = list(loader)
        assert len(got) == len(ref[0, 1])
        for k, (a, b) in enumerate(zip(got, ref[0, 1], strict=True)):
            assert_bitwise(a, b, (step, k))
    loader.batch_sampler.step_timeout_s = 0.1
    with pytest.raises(StepTimeoutError, match=r"step_000002\.rfs"):
        list(loader)  # no step left: a bounded wait, then the error, never an empty pass
    _wait_no_thread()


@pytest.mark.parametrize(
    ("options", "threads"),
    [
        (dict(num_workers=2), 1),
        (dict(num_workers=2, receive_depth=0), 0),
        (dict(num_workers=0), 0),
        (dict(num_workers=0, receive_depth=1), 1),
    ],
    ids=["workers", "workers-no-thread", "main", "main-thread"],
)
def test_one_loader_type_with_a_receive_thread_by_default_only_with_workers(run, options, threads):
    loader = _loader(run, **options)
    assert type(loader) is RolloutLoader
    it = iter(loader)
    next(it)
    assert len(_threads()) == threads
    it.close()
    assert not _threads()


def test_bad_options_are_config_errors():
    with pytest.raises(LoaderConfigError, match="receive_depth"):
        LoaderOptions(num_workers=2, receive_depth=-1)
    with pytest.raises(LoaderConfigError, match="num_workers"):
        LoaderOptions(num_workers=-1)
    with pytest.raises(LoaderConfigError, match="num_workers"):
        LoaderOptions(num_workers=True)
    for bad in (dict(timeout_s=-1), dict(timeout_s=math.inf), dict(stopped_s=0)):
        with pytest.raises(LoaderConfigError, match="timeout_s"):
            LoaderOptions(num_workers=1, **bad)
    with pytest.raises(LoaderConfigError, match="handover"):
        LoaderOptions(num_workers=1, handover="pipe")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_is_that_of_consumed_batches_while_thread_is_ahead(run, num_workers):
    loader = _loader(run, num_workers=num_workers, receive_depth=3)
    it = iter(loader)
    assert _position(loader.state_dict()) == (0, 0)
    next(it)
    end = time.monotonic() + 10
    while _position(loader.batch_sampler.state_dict())[1] < 4 and time.monotonic() < end:
        time.sleep(0.01)
    assert _position(loader.batch_sampler.state_dict()) >= (0, 4)  # drawn ahead: 1 taken, 3+
    assert _position(loader.state_dict()) == (0, 1)
    next(it)
    assert _position(loader.state_dict()) == (0, 2)
    it.close()
    assert not _threads()


@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_abandoned_pass_rewinds_to_consumed(run, num_workers, depth):
    ref = [tmb_key(t) for t in _loader(run, num_workers=0)]  # step 0
    loader = _loader(run, num_workers=num_workers, receive_depth=depth)
    it = iter(loader)
    first = [tmb_key(next(it)) for _ in range(2)]
    time.sleep(0.2)  # let the thread or the workers work ahead
    rest = [tmb_key(t) for t in loader]  # a new pass: the rest of step 0, nothing skipped
    assert first + rest == ref
    _wait_no_thread()


@pytest.mark.parametrize("depth", [0, 2])
def test_state_saved_at_a_pass_end_with_workers_resumes_at_the_next_step(run, depth):
    """A finished pass is saved as (next step, 0); a loader with workers loading it yields the
    next step whole (loading such a state into torchdata's loader skipped that step)."""
    plain = _loader(run, num_workers=0)
    steps = [[tmb_key(t) for t in plain] for _ in range(2)]
    loader = _loader(run, num_workers=2, receive_depth=depth)
    assert [tmb_key(t) for t in loader] == steps[0]
    state = loader.state_dict()
    assert _position(state) == (1, 0)
    resumed = _loader(run, num_workers=2, receive_depth=depth)
    resumed.load_state_dict(state)
    assert [tmb_key(t) for t in resumed] == steps[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_close_stops_thread_and_keeps_position(run, num_workers):
    ref = [tmb_key(t) for t in _loader(run, num_workers=0)]
    before = set(multiprocessing.active_children())
    loader = _loader(run, num_workers=num_workers, receive_depth=2)
    it = iter(loader)
    taken = [tmb_key(next(it)) for _ in range(3)]
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == num_workers
    loader.close()
    assert not _threads()
    assert not workers & set(multiprocessing.active_children())  # joined by close()
    with pytest.raises(StopIteration):
        next(it)  # a closed pass ends
    assert _position(loader.state_dict()) == (0, 3)
    assert taken + [tmb_key(t) for t in loader] == ref
    _wait_no_thread()


def test_del_mid_pass_stops_thread(run):
    loader = _loader(run, num_workers=2)
    it = iter(loader)
    next(it)
    assert len(_threads()) == 1
    del it, loader
    _wait_no_thread()
    loader = _loader(run, num_workers=2)
    for _ in loader:
        break  # the for loop drops the iterator; the loader stays
    _wait_no_thread()
    it = iter(loader)
    first = tmb_key(next(it))
    del loader  # the iterator keeps its loader: the pass goes on to its end
    rest = [tmb_key(t) for t in it]
    assert [first, *rest] == [tmb_key(t) for t in _loader(run)][1:]  # one taken by the break
    del it
    _wait_no_thread()
