"""Read-ahead: each worker makes the micro batches it is given next (the rest of its step's, then
the first of the next step, planned during the pass) while the trainer works, and every micro
batch is still the single-process reference's, bitwise; a step's records come from a store in a
GET per block, not per sample."""

from __future__ import annotations

import time

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, LoaderOptions, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.hints import MAX_DEPTH, Pace, worker_hints
from rollfeed.loaders.step_files import step_file_name, write_step_file
from rollfeed.payload import PayloadRoot
from rollfeed.payload.stores.object_blocks import BLOCK_BYTES
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch

CONFIG = PlanConfig(seq_len=SEQ_LEN)
TOPO = Topology(dp_rank=0, dp_size=1)


def test_hints_are_the_workers_next_tasks_then_the_next_steps() -> None:
    micro, nxt = [f"m{i}" for i in range(8)], [f"n{i}" for i in range(6)]
    # task at position 1, drawn 1st in its pass (worker 1 of 2): positions 3 and 5 follow
    assert worker_hints(7, micro, k=1, j=1, workers=2, depth=2) == ((7, "m3"), (7, "m5"))
    # near the end: position 6's worker (0) starts the next step at positions 0, 2
    got = worker_hints(7, micro, k=6, j=4, workers=2, depth=3, following=(8, nxt))
    assert got == ((8, "n0"), (8, "n2"), (8, "n4"))
    got = worker_hints(7, micro, k=5, j=3, workers=2, depth=2, following=(8, nxt))
    assert got == ((7, "m7"), (8, "n1"))
    assert worker_hints(7, micro, k=7, j=5, workers=2, depth=2) == ()  # nothing planned after


def test_pace_sizes_the_depth_from_making_time_and_the_trainers_time() -> None:
    pace = Pace()
    assert pace.depth(2) == MAX_DEPTH  # nothing measured yet: as deep as allowed
    pace.add(0.090, 0.020)  # 90 ms to make one, the trainer takes one per 20 ms, 2 workers
    assert pace.depth(2) == 3
    pace = Pace()
    pace.add(0.010, 0.100)
    assert pace.depth(2) == 1  # a slow trainer: one at a time keeps up
    pace = Pace()
    pace.add(0.050, 0.0)
    assert pace.depth(2) == MAX_DEPTH  # a trainer that never waits: as deep as allowed


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    base = tmp_path_factory.mktemp("read-ahead")
    samples = write_batch(base / "payload", 24, seed=5)
    (base / "steps").mkdir()
    for step, part in ((0, samples[:12]), (1, samples[12:])):
        write_step_file(base / "steps", step, part)
    refs = [
        reference(part, dp_size=1, cp_size=1, cp_layout="contiguous", root=base / "payload")[0]
        for part in (samples[:12], samples[12:])
    ]
    return base, [r[0, 0] for r in refs]


def _drain(loader, busy_s: float) -> tuple[list, dict]:
    got = []
    for tmb in loader:
        got.append(tmb)
        time.sleep(busy_s)  # the trainer's step: the workers read ahead meanwhile
    return got, loader.metrics


@pytest.mark.timeout(120)
def test_the_next_steps_first_micro_batches_are_made_ahead_and_every_one_is_the_references(
    two_steps,
):
    base, refs = two_steps
    loader = build_dataloader(
        RolloutDataset.from_step_dir(base / "steps"),
        TOPO,
        LoaderConfig(plan=CONFIG),
        root=base / "payload",
        options=LoaderOptions(num_workers=2, read_ahead=2),
    )
    first, _ = _drain(loader, 0.05)
    assert len(refs[1]) >= 4  # each worker has two of the next step's to make ahead
    t0 = time.monotonic()
    it = iter(loader)
    second = [next(it)]
    waited = time.monotonic() - t0
    rest, metrics = _drain(it, 0.0)
    second += rest
    for step, (got, ref) in enumerate(((first, refs[0]), (second, refs[1]))):
        assert len(got) == len(ref)
        for k, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert_bitwise(a, b, (step, k))
    # made during step 0, before the trainer asked: at least each worker's first two
    assert metrics["read_ahead"] >= 4, metrics
    assert metrics["wait_making_s"] < waited + 1e-3
    loader.close()
    off = build_dataloader(
        RolloutDataset.from_step_dir(base / "steps"),
        TOPO,
        LoaderConfig(plan=CONFIG),
        root=base / "payload",
        options=LoaderOptions(num_workers=2, read_ahead=0),
    )
    got, metrics = _drain(off, 0.0)
    assert metrics["read_ahead"] == 0 and len(got) == len(refs[0])
    off.close()


@pytest.mark.timeout(120)
def test_a_stores_step_records_are_read_a_block_at_a_time(tmp_path, object_store, s3_url):
    """Two workers over a step file in the store, opened with a 4 KiB first GET (so its records
    lie beyond it): the file is read in at most its opening GET and one GET per block in each
    process that reads it (the loader's, planning, and each worker's), not one per sample as
    before (12 samples, 3 processes: 21 GETs), and the micro batches are the reference's."""
    from tests.payload.store_proxy import StoreProxy

    opts = object_store.options()
    access = {k: opts[k] for k in ("endpoint", "access_key_id", "secret_access_key", "region")}
    local = write_batch(tmp_path / "payload", 12, seed=9)
    remote = write_batch(PayloadRoot(f"{s3_url}/payload", **opts), 12, seed=9)
    write_step_file(f"{s3_url}/steps", 0, remote, store=access)
    size = PayloadRoot(f"{s3_url}/steps", **access).store.open_file(step_file_name(0)).size
    with StoreProxy(object_store.endpoint) as proxy:
        via = {**access, "endpoint": proxy.endpoint}
        loader = build_dataloader(
            RolloutDataset.from_step_dir(f"{s3_url}/steps", store={**via, "open_bytes": 4096}),
            TOPO,
            LoaderConfig(plan=CONFIG),
            root=PayloadRoot(f"{s3_url}/payload", **via),
            options=LoaderOptions(num_workers=2),
        )
        got = list(loader)
        loader.close()
        asked = list(proxy.requests)
    ref = reference(local, dp_size=1, cp_size=1, cp_layout="contiguous", root=tmp_path / "payload")
    assert len(got) == len(ref[0][0, 0])
    for k, (a, b) in enumerate(zip(got, ref[0][0, 0], strict=True)):
        assert_bitwise(a, b, k)
    assert size > 3 * 4096  # records beyond the opening GET, in every process
    gets = [t for m, t in asked if m == "GET" and t.split("?")[0].endswith(step_file_name(0))]
    assert 3 <= len(gets) <= 3 * (1 + -(-size // BLOCK_BYTES)), gets
