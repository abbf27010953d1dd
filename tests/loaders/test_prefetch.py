"""Receive thread: bitwise output, state of the consumed batches, rewind, no thread left behind."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from rollfeed.loaders import (
    LoaderConfigError,
    PrefetchIterator,
    PrefetchStepDataLoader,
    RolloutDataset,
    StepTimeoutError,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.prefetch import THREAD_NAME
from rollfeed.loaders.step_files import read_step_file, write_step_file
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch
from tests.loaders.test_resume import tmb_key

TOPO = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("prefetch")
    samples = write_batch(base / "payload", 24, seed=6)
    (base / "steps").mkdir()
    write_step_file(base / "steps", 0, samples[:14])
    write_step_file(base / "steps", 1, samples[14:])
    return base


def _loader(run, **kw):
    ds = RolloutDataset.from_step_dir(run / "steps")
    return build_dataloader(ds, TOPO, seq_len=SEQ_LEN, root=run / "payload", **kw)


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _wait_no_thread(seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while _threads() and time.monotonic() < end:
        gc.collect()
        time.sleep(0.02)
    assert not _threads(), _threads()


def _micro_batches(state: dict) -> tuple[int, int]:
    main = state.get("_snapshot", {}).get("_main_snapshot", state)
    sampler = main["_index_sampler_state"]
    return sampler["step"], sampler["micro_batches"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_threaded_passes_equal_reference_bitwise(run, num_workers):
    loader = _loader(run, num_workers=num_workers, prefetch_thread=True)
    assert isinstance(loader, PrefetchStepDataLoader) and isinstance(loader, StatefulDataLoader)
    for step in (0, 1):
        samples = read_step_file(run / "steps" / f"step_{step:06d}.jsonl")
        ref, _ = reference(
            samples, dp_size=1, cp_size=2, cp_layout="contiguous", root=run / "payload"
        )
        assert len(loader) == len(ref[0, 1]) > 2
        got = list(loader)
        assert len(got) == len(ref[0, 1])
        for k, (a, b) in enumerate(zip(got, ref[0, 1], strict=True)):
            assert_bitwise(a, b, (step, k))
    loader.batch_sampler.step_timeout_s = 0.1
    with pytest.raises(StepTimeoutError, match=r"step_000002\.jsonl"):
        list(loader)  # no step left: a bounded wait, then the error, never an empty pass
    _wait_no_thread()


def test_default_is_threaded_only_with_workers(run):
    assert isinstance(_loader(run, num_workers=2), PrefetchStepDataLoader)
    plain = _loader(run, num_workers=0)
    assert not isinstance(plain, PrefetchStepDataLoader)
    assert not isinstance(iter(plain), PrefetchIterator)
    with pytest.raises(LoaderConfigError, match="depth"):
        _loader(run, num_workers=2, prefetch_depth=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_is_that_of_consumed_batches_while_thread_is_ahead(run, num_workers):
    loader = _loader(run, num_workers=num_workers, prefetch_depth=3, prefetch_thread=True)
    it = iter(loader)
    assert _micro_batches(loader.state_dict()) == (0, 0)
    next(it)
    end = time.monotonic() + 10
    while it._pump.queue.qsize() < 3 and time.monotonic() < end:
        time.sleep(0.01)
    assert it._pump.fetched >= 4  # 1 taken, 3 queued (and maybe one waiting to be queued)
    assert _micro_batches(loader.state_dict()) == (0, 1)
    next(it)
    assert _micro_batches(loader.state_dict()) == (0, 2)
    it.close()
    assert not _threads()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_abandoned_pass_rewinds_to_consumed(run, num_workers):
    ref = [tmb_key(t) for t in _loader(run, num_workers=0)]  # step 0
    loader = _loader(run, num_workers=num_workers, prefetch_thread=True)
    it = iter(loader)
    first = [tmb_key(next(it)) for _ in range(2)]
    time.sleep(0.2)  # let the thread receive ahead
    rest = [tmb_key(t) for t in loader]  # a new pass: the rest of step 0, nothing skipped
    assert first + rest == ref
    _wait_no_thread()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_close_stops_thread_and_keeps_position(run, num_workers):
    ref = [tmb_key(t) for t in _loader(run, num_workers=0)]
    loader = _loader(run, num_workers=num_workers, prefetch_thread=True)
    it = iter(loader)
    taken = [tmb_key(next(it)) for _ in range(3)]
    loader.close()
    assert not _threads()
    with pytest.raises(StopIteration):
        next(it)  # a closed pass ends
    assert _micro_batches(loader.state_dict()) == (0, 3)
    assert taken + [tmb_key(t) for t in loader] == ref
    _wait_no_thread()


def test_del_mid_pass_stops_thread(run):
    loader = _loader(run, num_workers=2, prefetch_thread=True)
    it = iter(loader)
    next(it)
    assert len(_threads()) == 1
    del it, loader
    _wait_no_thread()
    loader = _loader(run, num_workers=2, prefetch_thread=True)
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
