"""Step files and payload only in an object store (the session's SeaweedFS): the loader yields,
bitwise, what the single-process reference yields from a local root and a local step directory,
with 0 and 2 workers, in stream mode, and after a resume."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    LoaderOptions,
    RolloutDataset,
    StepTimeoutError,
    Topology,
    build_dataloader,
    write_step_file,
)
from rollfeed.loaders.step_files import listing_start, step_file_name
from rollfeed.payload import PayloadIOError, PayloadRoot
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch

CONFIG = PlanConfig(seq_len=SEQ_LEN, cp_size=2, cp_layout="zigzag")


def store_options(server) -> dict:
    opts = server.options()
    return {k: opts[k] for k in ("endpoint", "access_key_id", "secret_access_key", "region")}


def steps_in_store(tmp_path, server, url):
    """The same 27 samples by handle under a local root and under ``url/payload``, cut into
    steps 7, 8, 9; the local ones are the reference's."""
    local = write_batch(tmp_path / "payload", 27, seed=8)
    root = PayloadRoot(f"{url}/payload", **server.options())
    remote = write_batch(root, 27, seed=8)
    cuts = {7: (0, 10), 8: (10, 18), 9: (18, 27)}
    return (
        root,
        {s: local[a:b] for s, (a, b) in cuts.items()},
        {s: remote[a:b] for s, (a, b) in cuts.items()},
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_from_the_store_equals_the_local_reference(tmp_path, object_store, s3_url, workers):
    root, local, remote = steps_in_store(tmp_path, object_store, s3_url)
    steps, access = f"{s3_url}/steps", store_options(object_store)
    write_step_file(steps, 7, remote[7], store=access)

    def produce():
        for step in (8, 9):
            time.sleep(0.3)
            write_step_file(steps, step, remote[step], store=access)

    producer = threading.Thread(target=produce)
    producer.start()
    ds = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=store_options(object_store))
    loader = build_dataloader(
        ds,
        Topology(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2),
        LoaderConfig(plan=CONFIG, stream=True, step_timeout_s=10),
        root=root,
        options=LoaderOptions(num_workers=workers),
    )
    got: dict[int, list] = {}
    for _ in range(3):
        it = iter(loader)
        for tmb in it:
            got.setdefault(it.step, []).append(tmb)
    producer.join()
    assert sorted(got) == [7, 8, 9]
    for step, batch in local.items():
        ref, _ = reference(
            batch, dp_size=2, cp_size=2, cp_layout="zigzag", root=tmp_path / "payload"
        )
        assert len(got[step]) == len(ref[1, 1])
        for k, (a, b) in enumerate(zip(got[step], ref[1, 1], strict=True)):
            assert_bitwise(a, b, (step, k))  # the step counts too
        stored = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=store_options(object_store))
        runs, listed = stored.loss_runs(step), RolloutDataset(batch).loss_runs()
        assert runs.spans.tolist() == listed.spans.tolist()  # from the step file's index
        assert runs.counts.tolist() == listed.counts.tolist()
    if workers == 0:
        assert ds.metrics()["steps_loaded"] == 3  # planned from the step files' indexes
    t0 = time.monotonic()
    loader.batch_sampler.step_timeout_s = 0.3
    with pytest.raises(StepTimeoutError, match=r"s3://.*step_000010\.rfs") as err:
        next(iter(loader))
    said = str(err.value)  # where it looked, what it found, the producer's last step
    assert f"in {s3_url}/steps within" in said and "step files up to step 9" in said, said
    assert "the producer's last step seen: 9" in said
    assert time.monotonic() - t0 < 5
    loader.close()


def test_resume_mid_step_from_the_store(tmp_path, object_store, s3_url):
    root, local, remote = steps_in_store(tmp_path, object_store, s3_url)
    for step in (7, 8):
        write_step_file(f"{s3_url}/steps", step, remote[step], store=store_options(object_store))

    def loader():
        ds = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=store_options(object_store))
        topo = Topology(dp_rank=0, dp_size=2, cp_rank=0, cp_size=2)
        return build_dataloader(
            ds, topo, LoaderConfig(plan=CONFIG), root=root, options=LoaderOptions(num_workers=0)
        )

    first = loader()
    it = iter(first)
    taken = [next(it)]
    state = json.loads(json.dumps(first.state_dict()))
    rest = list(it)
    second = loader()
    second.load_state_dict(state)
    again = list(iter(second))
    assert len(again) == len(rest) and rest
    for k, (a, b) in enumerate(zip(again, rest, strict=True)):
        assert_bitwise(a, b, k)
    ref, _ = reference(
        local[7], dp_size=2, cp_size=2, cp_layout="zigzag", root=tmp_path / "payload"
    )
    for k, (a, b) in enumerate(zip(taken + rest, ref[0, 0], strict=True)):
        assert_bitwise(a, b, ("ref", k))
    first.close()
    second.close()


def test_step_prefix_lists_and_refuses_a_missing_step_within_its_bound(object_store, s3_url):
    steps = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=store_options(object_store))
    assert steps.steps_from(0) == []
    t0 = time.monotonic()
    with pytest.raises(
        StepTimeoutError, match="found there: nothing: the directory is empty"
    ) as err:
        steps.wait_for_step(3, timeout_s=0.2)
    assert err.value.step == 3 and "the producer's last step seen: none" in str(err.value)
    assert time.monotonic() - t0 < 3
    assert "secret" not in repr(steps.source.root).lower()


def test_a_listing_from_a_step_starts_there_in_the_store(object_store, s3_url):
    steps = [0, 7, 99_999, 100_000, 999_999, 10**6]
    root = PayloadRoot(f"{s3_url}/steps", **object_store.options())
    for t in steps:
        assert root.store.put_blob(step_file_name(t), b"")
    root.store.put_blob("step_000007.jsonl", b"")
    got = [e.rel for e in root.store.names("", after=listing_start(7))]
    assert got[:2] == ["step_000007.jsonl", "step_000007.rfs"] and "step_000000.rfs" not in got
    assert {step_file_name(t) for t in steps[2:]} <= set(got)
    dataset = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=store_options(object_store))
    assert dataset.steps_from(999_999) == [999_999, 10**6]
    assert dataset.steps_from(8) == steps[2:]


def test_a_run_prefix_given_for_its_steps_is_refused_as_the_first_pass_starts(
    tmp_path, object_store, s3_url
):
    root, _, remote = steps_in_store(tmp_path, object_store, s3_url)
    write_step_file(f"{s3_url}/run/steps", 7, remote[7], store=store_options(object_store))
    dataset = RolloutDataset.from_step_dir(f"{s3_url}/run", store=store_options(object_store))
    topology = Topology(dp_rank=0, dp_size=1, cp_rank=0, cp_size=2)
    config = LoaderConfig(plan=CONFIG, step_timeout_s=600)
    loader = build_dataloader(dataset, topology, config, root=root)
    t0 = time.monotonic()
    with pytest.raises(LoaderConfigError, match=r"holds no step file, but .*/run/steps holds"):
        next(iter(loader))
    assert time.monotonic() - t0 < 30  # not a wait of step_timeout_s
    loader.close()


def test_a_store_out_of_reach_is_a_typed_error_naming_the_store():
    # nothing listens on port 1: the listing fails at once, as an error a loader can name
    access = {"endpoint": "http://127.0.0.1:1", "region": "us-east-1"}
    steps = RolloutDataset.from_step_dir(
        "s3://bucket/steps", store={**access, "access_key_id": "AK", "secret_access_key": "SK"}
    )
    with pytest.raises(PayloadIOError, match=r"s3://bucket/steps.*out of reach"):
        steps.steps_from(0)


@pytest.mark.timeout(120)
def test_two_workers_read_payload_and_steps_through_obstore_alone(tmp_path, object_store, s3_url):
    """Workers from a fork server, after the trainer's process listed and planned over the
    store: every read (a step's index and records, payload objects) is obstore's, as the store
    sees it (its ``User-Agent``), and the micro batches are the reference's, bitwise."""
    from tests.payload.store_proxy import StoreProxy

    _, local, remote = steps_in_store(tmp_path, object_store, s3_url)
    write_step_file(f"{s3_url}/steps", 7, remote[7], store=store_options(object_store))
    with StoreProxy(object_store.endpoint) as proxy:  # passes every answer; notes who asked
        via = {**store_options(object_store), "endpoint": proxy.endpoint}
        loader = build_dataloader(
            RolloutDataset.from_step_dir(f"{s3_url}/steps", store=via),
            Topology(dp_rank=0, dp_size=1, cp_rank=0, cp_size=2),
            LoaderConfig(plan=CONFIG),
            root=PayloadRoot(f"{s3_url}/payload", **via),
            options=LoaderOptions(num_workers=2),
        )
        got = list(loader)
        loader.close()
        asked = list(zip(proxy.requests, proxy.agents, strict=True))
    ref, _ = reference(
        local[7], dp_size=1, cp_size=2, cp_layout="zigzag", root=tmp_path / "payload"
    )
    assert len(got) == len(ref[0, 0])
    for k, (a, b) in enumerate(zip(got, ref[0, 0], strict=True)):
        assert_bitwise(a, b, k)
    reads = [agent for (method, target), agent in asked if "list-type" not in target]
    assert {m for (m, _), _ in asked} <= {"GET", "HEAD"} and len(reads) >= len(got)
    assert all(agent.startswith("object_store/") for agent in reads), set(reads)
