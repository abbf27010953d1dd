"""Step files as the loader reads them: planning reads the index alone, a rank reads only its own
samples' records, a step is written as its samples come and appears whole, the index carries
each sample's group, shared prefix and policy version, what is wrong is a typed error naming the
file (and the sample), and a directory of JSON-lines step files is refused until converted."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import resource
from pathlib import Path

import numpy as np
import pytest

from rollfeed.cli import main
from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepFileError,
    StepMissingError,
    StepTimeoutError,
    StepWriter,
    Topology,
    build_dataloader,
    read_step_file,
    write_step_file,
)
from rollfeed.loaders.dataset import STEP_STRIDE
from rollfeed.loaders.step_files import listing_start, step_file_name
from rollfeed.payload import PayloadRoot
from rollfeed.payload.format.step_layout import group_hash
from tests.collate.gen import inline_batch
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch
from tests.loaders.step_bytes import flip, index_of, record_span

N = 21


@pytest.fixture
def run(tmp_path):
    samples = write_batch(tmp_path / "payload", N, seed=31)
    path = Path(write_step_file(tmp_path / "steps", 0, samples))
    return tmp_path, samples, path


def _rank_loader(tmp, dp_rank, **kw):
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    topo = Topology(dp_rank=dp_rank, dp_size=2, cp_rank=1, cp_size=2)
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2)
    loader = build_dataloader(
        ds, topo, LoaderConfig(plan=config), root=tmp / "payload", options=LoaderOptions(**kw)
    )
    return ds, loader


def _first_error(loader) -> Exception:
    """The error iterating ``loader`` raises, without its traceback (which would keep the workers
    alive until interpreter exit)."""
    try:
        list(loader)
    except Exception as err:  # the caller asserts the type
        return err.with_traceback(None)
    raise AssertionError("the loader raised nothing")


def test_planning_reads_the_index_alone_and_a_rank_only_its_records(run):
    tmp, samples, path = run
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    assert ds.lengths(0).tolist() == [len(s) for s in samples]
    assert ds.step_indices(0).tolist() == list(range(N))
    assert ds.metrics() == {"steps_loaded": 1, "samples_read": 0}
    assert [s.to_json() for s in read_step_file(path)] == [s.to_json() for s in samples]
    ds, loader = _rank_loader(tmp, 0, num_workers=0)
    mine = sum(len(mb) for mb in loader.batch_sampler.step_micro_batches(0))
    assert 0 < mine < N and len(list(loader)) > 1
    assert ds.metrics() == {"steps_loaded": 1, "samples_read": mine}


@pytest.mark.timeout(60)
def test_workers_never_read_records_of_other_ranks(run):
    tmp, samples, path = run
    _, probe = _rank_loader(tmp, 1)
    theirs = sorted(i for mb in probe.batch_sampler.step_micro_batches(0) for i in mb)
    victim = theirs[len(theirs) // 2]
    flip(path, record_span(path, victim)[0] + 40)  # in place: the index still fits the file
    ref, _ = reference(samples, dp_size=2, cp_size=2, cp_layout="contiguous", root=tmp / "payload")
    _, loader = _rank_loader(tmp, 0, num_workers=2)
    got = list(loader)
    loader.close()
    assert len(got) == len(ref[0, 1])
    for k, (a, b) in enumerate(zip(got, ref[0, 1], strict=True)):
        assert_bitwise(a, b, k)
    _, other = _rank_loader(tmp, 1, num_workers=2)
    err = _first_error(other)
    other.close()
    assert type(err) is StepFileError, repr(err)  # the worker's error itself, with its place
    assert (err.file, err.step, err.sample) == (str(path), 0, victim)
    assert any("worker process" in note for note in err.__notes__)


def test_bytes_after_the_footer_or_a_sample_past_the_step_are_named(run):
    tmp, _, path = run
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    with pytest.raises(StepFileError, match="which has 21") as err:
        ds[0 * STEP_STRIDE + N]
    assert err.value.file == str(path)
    with open(path, "ab") as f:
        f.write(b"\n")
    with pytest.raises(StepFileError, match="footer") as err:
        RolloutDataset.from_step_dir(tmp / "steps").lengths(0)
    assert err.value.file == str(path) and err.value.step == 0
    with pytest.raises(StepMissingError) as missing:
        ds.lengths(3)
    assert missing.value.step == 3 and missing.value.file == str(tmp / "steps/step_000003.rfs")
    assert f"in {tmp / 'steps'}" in str(missing.value) and "present: steps 0..0" in str(
        missing.value
    )


def test_pickled_dataset_reads_in_its_own_process_state(run):
    tmp, samples, _ = run
    ds = RolloutDataset.from_step_dir(tmp / "steps", cache_steps=1)
    assert ds[7].to_json() == samples[7].to_json()  # opens the step file here
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.metrics() == {"steps_loaded": 0, "samples_read": 0}
    assert copy[8].to_json() == samples[8].to_json()
    write_step_file(tmp / "steps", 1, samples[:2])
    assert copy[STEP_STRIDE + 1].to_json() == samples[1].to_json()  # step 0 evicted, file closed
    assert list(copy.source._held().files) == [1]


def test_a_step_is_written_as_its_samples_come_and_appears_whole(tmp_path):
    samples = inline_batch(np.random.default_rng(4), 6, 30)
    steps = tmp_path / "steps"
    with StepWriter(steps, 2, vocab_size=1000) as w:
        for i, s in enumerate(samples):
            w.append(s, group=f"p{i // 3}", shared_prefix=min(2, len(s)), policy_version=i)
            written_aside = [p.name for p in steps.iterdir()]  # the directory made at the first
            assert len(written_aside) == 1 and written_aside[0].startswith(".step_000002.rfs.")
            assert RolloutDataset.from_step_dir(steps).steps_from(0) == []
    assert [s.to_json() for s in read_step_file(w.path)] == [s.to_json() for s in samples]
    index = index_of(Path(w.path))
    assert index.policy_version.tolist() == list(range(6))
    assert index.group.view(np.uint64).tolist() == [group_hash(f"p{i // 3}") for i in range(6)]
    assert index.shared.tolist() == [min(2, len(s)) for s in samples]
    with StepWriter(steps, 3) as plain:
        plain.append(samples[0])
    index = index_of(Path(plain.path))
    assert (index.policy_version[0], index.group[0], index.shared[0]) == (-1, 0, 0)  # none
    big = samples[0].token_ids.copy()
    big[0] = 1000
    with pytest.raises(StepFileError, match="not below vocab_size=1000") as err:
        StepWriter(steps, 4, vocab_size=1000).append(
            samples[0].__class__(
                big,
                loss_mask=samples[0].loss_mask,
                advantages=samples[0].advantages,
                inference_logprobs=samples[0].inference_logprobs,
            )
        )
    assert (
        err.value.sample == 0 and sorted(p.name for p in steps.iterdir())[-1] == "step_000003.rfs"
    )


def _write_under_a_size_limit(directory, limit: int, samples, conn) -> None:
    """In a forked child: the kernel refuses writes past ``limit`` bytes (``RLIMIT_FSIZE``; Python
    ignores the SIGXFSZ that comes with it), part-way through a file, as a full disk does."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        write_step_file(directory, 4, samples)
        conn.send(("no error", None, None))
    except Exception as err:
        conn.send((type(err).__name__, str(err), getattr(err, "file", None)))


def test_a_write_the_disk_refuses_is_a_typed_error_leaving_nothing(tmp_path):
    samples = inline_batch(np.random.default_rng(5), 40, 30)
    size = Path(write_step_file(tmp_path / "probe", 4, samples)).stat().st_size
    (tmp_path / "steps").mkdir()
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_write_under_a_size_limit, args=(tmp_path / "steps", size // 2, samples, child)
    )
    proc.start()
    kind, message, file = parent.recv()
    proc.join(10)
    assert kind == "StepWriteError", (kind, message)
    assert file == str(tmp_path / "steps" / "step_000004.rfs") and "step 4" in message
    assert os.listdir(tmp_path / "steps") == []  # nothing written aside is left
    write_step_file(tmp_path / "steps", 4, samples)  # with room, the same write goes through
    assert len(RolloutDataset.from_step_dir(tmp_path / "steps").lengths(4)) == 40


def _json_steps(directory: Path, steps: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for step, samples in steps.items():
        lines = "".join(s.to_json() + "\n" for s in samples)
        (directory / f"step_{step:06d}.jsonl").write_text(lines)
        (directory / f"step_{step:06d}.index.json").write_text("{}")


def test_json_lines_steps_are_refused_until_converted(tmp_path, capsys):
    samples = inline_batch(np.random.default_rng(6), 9, 30)
    steps = tmp_path / "steps"
    _json_steps(steps, {0: samples[:4], 1: samples[4:]})
    with pytest.raises(StepFileError, match="python -m rollfeed steps convert") as err:
        RolloutDataset.from_step_dir(steps).lengths(0)
    assert err.value.file == str(steps / "step_000000.jsonl")
    assert main(["steps", "convert", str(steps)]) == 0
    out = capsys.readouterr().out
    assert "step_000000.jsonl -> step_000000.rfs: 4 samples" in out and "converted 2 of 2" in out
    ds = RolloutDataset.from_step_dir(steps)
    for step, want in ((0, samples[:4]), (1, samples[4:])):
        got = [ds[i].to_json() for i in ds.step_indices(step)]
        assert got == [s.to_json() for s in want]
    bad = samples[0].to_dict() | {"advantages": [0.0]}
    (steps / "step_000002.jsonl").write_text(samples[1].to_json() + "\n\n" + json.dumps(bad) + "\n")
    assert main(["steps", "convert", str(steps), "--remove"]) == 1
    out = capsys.readouterr().out
    assert "left as it is" in out and "BAD step_000002.jsonl line 3" in out, out
    assert sorted(os.listdir(steps)) == ["step_000000.rfs", "step_000001.rfs", "step_000002.jsonl"]
    with pytest.raises(StepFileError, match="step 2 is a step file of the JSON-lines format"):
        ds.steps_from(0)
    assert main(["steps", "convert", str(tmp_path)]) == 2  # nothing to convert: a usage error


def test_a_step_the_last_listing_found_is_waited_for_without_another(run, monkeypatch):
    tmp, samples, _ = run
    write_step_file(tmp / "steps", 1, samples)
    dataset = RolloutDataset.from_step_dir(tmp / "steps")
    directory, listings = dataset.source.steps, []
    listed = directory.entries
    monkeypatch.setattr(directory, "entries", lambda after="": listings.append(1) or listed(after))
    assert dataset.steps_from(1) == [1] and len(listings) == 1  # the next pass's, planned ahead
    assert dataset.wait_for_step(1, timeout_s=0.1) == 1 and len(listings) == 1  # no listing
    (tmp / "steps" / "step_000001.rfs").unlink()  # removed: read, it is missing
    with pytest.raises(StepMissingError, match=r"step 1 has no step file step_000001\.rfs"):
        dataset.lengths(1)
    with pytest.raises(StepTimeoutError, match="found there: step files up to step 0"):
        dataset.wait_for_step(1, timeout_s=0.1)  # the error's listing forgot it: waited for
    assert len(listings) >= 3


@pytest.mark.parametrize("step", [0, 1, 41, 99_999, 100_000, 123_456, 999_999, 10**6, 12_345_678])
def test_a_listing_from_a_step_holds_every_later_step_file_and_no_earlier_one(step):
    after = listing_start(step)  # names sort as text: step 10**6's sorts before step 999,999's
    later = {step, step + 1, step + 9, 2 * step + 1, 10 * step + 9, 10**6, 10**6 + 1, 10**7}
    for t in sorted(t for t in later if t >= step):
        name = step_file_name(t)
        assert name > after and name.replace(".rfs", ".jsonl") > after, (t, after)
    if 0 < step < 100_000:  # six digits and more below a million: nothing earlier is listed
        assert step_file_name(step - 1).replace(".rfs", ".jsonl") < after


def test_a_local_listing_from_a_step_lists_the_step_files_from_there(tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    for t in (0, 7, 99_999, 100_000, 999_999, 10**6):
        (steps / step_file_name(t)).write_bytes(b"")
    (steps / "step_000007.jsonl").write_bytes(b"")
    root = PayloadRoot(steps)
    got = [e.rel for e in root.store.names("", after=listing_start(7))]
    assert got[:2] == ["step_000007.jsonl", "step_000007.rfs"] and "step_000000.rfs" not in got
    assert {step_file_name(t) for t in (99_999, 100_000, 999_999, 10**6)} <= set(got)
    assert RolloutDataset.from_step_dir(steps).steps_from(999_999) == [999_999, 10**6]
