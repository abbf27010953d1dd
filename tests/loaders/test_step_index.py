"""Step index: round trip, lengths without parsing, workers read only their lines, typed errors on
disagreement, and the counted whole-file fallback for step files without an index."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest

from rollfeed.collate import PlanConfig
from rollfeed.collate.loss_runs import mask_runs
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    LoaderOptions,
    RolloutDataset,
    StepFileError,
    Topology,
    build_dataloader,
    read_step_file,
    write_step_file,
)
from rollfeed.loaders.dataset import STEP_STRIDE
from rollfeed.loaders.step_index import (
    ARRAYS,
    build_step_index,
    index_path,
    read_step_index,
    write_step_index,
)
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch

N = 21


@pytest.fixture
def run(tmp_path):
    samples = write_batch(tmp_path / "payload", N, seed=31)
    (tmp_path / "steps").mkdir()
    path = write_step_file(tmp_path / "steps", 0, samples)
    return tmp_path, samples, path


def _lines(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_index_round_trip_matches_the_file(run):
    _, samples, path = run
    assert index_path(path).name == "step_000000.index.json"
    index = read_step_index(path)
    lines = _lines(path)
    assert len(index) == len(lines) == N
    assert index.file_bytes == path.stat().st_size
    assert index.lengths.tolist() == [len(s) for s in samples]
    assert index.sizes.tolist() == [len(b) for b in lines]
    assert index.offsets.tolist() == np.cumsum([0] + [len(b) for b in lines[:-1]]).tolist()
    assert index.lines.tolist() == list(range(1, N + 1))
    for i, s in enumerate(samples):
        at = int(index.offsets[i])
        assert path.read_bytes()[at : at + int(index.sizes[i])].decode() == s.to_json() + "\n"
    written = index_path(path).read_bytes()
    index_path(path).unlink()
    assert read_step_index(path) is None
    assert build_step_index(path) == index_path(path)
    assert index_path(path).read_bytes() == written  # built from the file == written with it


def test_step_file_into_a_missing_directory_makes_it(run):
    """A new run's first step makes its step directory, as a payload writer makes its group."""
    tmp, samples, _ = run
    path = write_step_file(tmp / "new" / "steps", 3, samples[:2])
    assert path == tmp / "new" / "steps" / "step_000003.jsonl"
    assert [s.to_json() for s in read_step_file(path)] == [s.to_json() for s in samples[:2]]
    assert read_step_index(path).lengths.tolist() == [len(s) for s in samples[:2]]


def test_build_index_skips_blank_lines_and_reads_back(run):
    tmp, samples, path = run
    lines = _lines(path)
    path.write_bytes(b"\n" + lines[0] + b"  \n" + b"".join(lines[1:4]) + lines[4].rstrip(b"\n"))
    index_path(path).unlink()
    build_step_index(path)
    index = read_step_index(path)
    assert index.lines.tolist() == [2, 4, 5, 6, 7]
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    got = [ds[int(i)].to_json() for i in ds.step_indices(0)]
    assert got == [s.to_json() for s in samples[:5]]  # the last line has no "\n"


def test_lengths_come_from_the_index_alone(run):
    tmp, _, path = run
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    parsed = [len(s) for s in read_step_file(path)]
    assert ds.lengths(0).tolist() == parsed
    assert ds.step_indices(0).tolist() == list(range(N))
    assert ds.metrics() == {"indexed_steps": 1, "unindexed_steps": 0, "lines_parsed": 0}


def _rank_loader(tmp, dp_rank, **kw):
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    topo = Topology(dp_rank=dp_rank, dp_size=2, cp_rank=1, cp_size=2)
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=2)
    loader = build_dataloader(
        ds, topo, LoaderConfig(plan=config), root=tmp / "payload", options=LoaderOptions(**kw)
    )
    return ds, loader


def test_main_process_parses_only_this_ranks_lines(run):
    tmp, _, _ = run
    ds, loader = _rank_loader(tmp, 0, num_workers=0)
    mine = sum(len(mb) for mb in loader.batch_sampler.step_micro_batches(0))
    assert 0 < mine < N
    assert len(list(loader)) > 1
    assert ds.metrics() == {"indexed_steps": 1, "unindexed_steps": 0, "lines_parsed": mine}


@pytest.mark.timeout(60)
def test_workers_never_read_lines_of_other_ranks(run):
    tmp, samples, path = run
    _, probe = _rank_loader(tmp, 1)
    theirs = sorted(i for mb in probe.batch_sampler.step_micro_batches(0) for i in mb)
    victim = theirs[len(theirs) // 2]
    lines = _lines(path)
    lines[victim] = b"{" + b"x" * (len(lines[victim]) - 2) + b"\n"  # same size: index still fits
    path.write_bytes(b"".join(lines))
    ref, _ = reference(samples, dp_size=2, cp_size=2, cp_layout="contiguous", root=tmp / "payload")
    _, loader = _rank_loader(tmp, 0, num_workers=2)
    got = list(loader)
    assert len(got) == len(ref[0, 1])
    for k, (a, b) in enumerate(zip(got, ref[0, 1], strict=True)):
        assert_bitwise(a, b, k)
    loader.close()
    _, other = _rank_loader(tmp, 1, num_workers=2)
    err = _first_error(other)
    other.close()
    assert type(err) is StepFileError, repr(err)  # the worker's error itself, with its place
    assert (err.file, err.line) == (str(path), victim + 1)
    assert any("worker process" in note for note in err.__notes__)


def _first_error(loader) -> Exception:
    """The error iterating ``loader`` raises, without its traceback (which would keep the workers
    alive until interpreter exit)."""
    try:
        list(loader)
    except Exception as err:  # the caller asserts the type
        return err.with_traceback(None)
    raise AssertionError("the loader raised nothing")


def test_file_grown_after_index_names_step_file(run):
    tmp, _, path = run
    with open(path, "ab") as f:
        f.write(b"\n")
    with pytest.raises(StepFileError, match=r"says \d+ bytes") as err:
        RolloutDataset.from_step_dir(tmp / "steps").lengths(0)
    assert err.value.file == str(path)


def test_lines_moved_after_index_name_file_and_line(run):
    tmp, _, path = run
    lines = _lines(path)
    assert len(lines[0]) != len(lines[1])
    path.write_bytes(b"".join([lines[1], lines[0], *lines[2:]]))  # same size, lines moved
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    assert ds.lengths(0).tolist()  # size agrees: planning does not read lines
    with pytest.raises(StepFileError, match="not one whole line") as err:
        ds[0]
    assert err.value.file == str(path) and err.value.line == 1


def test_token_count_disagreement_names_line(run):
    tmp, _, path = run
    index = read_step_index(path)
    lengths = index.lengths.copy()
    lengths[3] += 1
    write_step_index(path, type(index)(**{**_fields(index), "lengths": lengths}))
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    assert ds[2].to_json()
    with pytest.raises(StepFileError, match=r"says \d+ tokens") as err:
        ds[3]
    assert err.value.file == str(path) and err.value.line == 4


def _fields(index):
    return {k: getattr(index, k) for k in ("file_bytes", *ARRAYS, "runs")}


@pytest.mark.parametrize(
    "bad",
    [
        b"{not json",
        b'{"format": "rollfeed.step_index", "version": 99}',
        json.dumps({"format": "rollfeed.step_index", "version": 2}).encode(),
    ],
)
def test_unreadable_index_names_index_file(run, bad):
    tmp, _, path = run
    index_path(path).write_bytes(bad)
    with pytest.raises(StepFileError, match="unreadable step index") as err:
        RolloutDataset.from_step_dir(tmp / "steps").lengths(0)
    assert err.value.file == str(index_path(path))


def test_inconsistent_index_names_index_file(run):
    tmp, _, path = run
    index = read_step_index(path)
    offsets = index.offsets.copy()
    offsets[5] = offsets[4]  # overlaps line 5
    write_step_index(path, type(index)(**{**_fields(index), "offsets": offsets}))
    with pytest.raises(StepFileError, match="inconsistent") as err:
        RolloutDataset.from_step_dir(tmp / "steps").lengths(0)
    assert err.value.file == str(index_path(path))


def test_index_holds_each_samples_loss_runs(run):
    _, samples, path = run
    runs = read_step_index(path).runs
    assert runs.counts.sum() > 0
    for i, s in enumerate(samples):
        mask = np.zeros(len(s), bool)
        for a, b in runs.of(i).tolist():
            mask[a:b] = True
        assert np.array_equal(mask, s.loss_mask), i


def _with_runs(path, i: int, spans: list[int]) -> None:
    """The index of ``path`` with sample ``i``'s loss runs replaced by ``spans`` (flat)."""
    record = json.loads(index_path(path).read_bytes())
    counts, flat = record["loss_runs"], record["loss_spans"]
    at = 2 * sum(counts[:i])
    flat[at : at + 2 * counts[i]] = spans
    counts[i] = len(spans) // 2
    index_path(path).write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("what", "spans"),
    [
        ("out of order", [5, 7, 1, 3]),
        ("overlapping", [1, 5, 3, 7]),
        ("touching", [1, 3, 3, 5]),
        ("empty", [2, 2]),
        ("past the sample", [1, 10_000]),
    ],
)
def test_loss_runs_that_cannot_be_the_samples_name_index_file_and_line(run, what, spans):
    tmp, _, path = run
    _with_runs(path, 6, spans)
    with pytest.raises(StepFileError, match="loss runs of sample 6") as err:
        RolloutDataset.from_step_dir(tmp / "steps").lengths(0)
    assert (err.value.file, err.value.line) == (str(index_path(path)), 7), what


def test_loss_runs_other_than_the_lines_are_refused_when_the_line_is_read(run):
    tmp, samples, path = run
    T = len(samples[4])
    assert T >= 2
    true = mask_runs(samples[4].loss_mask).ravel().tolist()
    _with_runs(path, 4, [0, T] if true != [0, T] else [0, T - 1])  # well formed, not sample 4's
    ds = RolloutDataset.from_step_dir(tmp / "steps")
    assert ds.lengths(0).tolist()  # planning reads the index only
    with pytest.raises(StepFileError, match="loss runs") as err:
        ds[4]
    assert (err.value.file, err.value.line) == (str(path), 5)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_step_file_without_index_loads_whole_and_is_counted(run, caplog, num_workers):
    tmp, samples, path = run
    ref, _ = reference(samples, dp_size=2, cp_size=2, cp_layout="contiguous", root=tmp / "payload")
    want = ref[0, 1]
    index_path(path).unlink()
    ds, loader = _rank_loader(tmp, 0, num_workers=num_workers)
    with caplog.at_level(logging.WARNING, logger="rollfeed.loaders.step_load"):
        got = list(loader)
        ds.lengths(0)
    if num_workers:
        loader.close()  # stop the workers now, not at interpreter exit
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise(a, b, k)
    assert ds.metrics() == {"indexed_steps": 0, "unindexed_steps": 1, "lines_parsed": N}
    warned = [r for r in caplog.records if "has no index" in r.getMessage()]
    assert len(warned) == 1 and "step_000000.jsonl" in warned[0].getMessage()
    strict = RolloutDataset.from_step_dir(tmp / "steps", missing_index="error")
    with pytest.raises(StepFileError, match="missing_index") as err:
        strict.lengths(0)
    assert err.value.file == str(path)
    with pytest.raises(LoaderConfigError, match="missing_index"):
        RolloutDataset.from_step_dir(tmp / "steps", missing_index="skip")


def test_pickled_dataset_reads_lines_in_its_own_process_state(run):
    tmp, samples, _ = run
    ds = RolloutDataset.from_step_dir(tmp / "steps", cache_steps=1)
    assert ds[7].to_json() == samples[7].to_json()  # opens the step file here
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.metrics()["lines_parsed"] == 0
    assert copy[STEP_STRIDE * 0 + 8].to_json() == samples[8].to_json()
    write_step_file(tmp / "steps", 1, samples[:2])
    assert copy[STEP_STRIDE + 1].to_json() == samples[1].to_json()  # step 0 evicted, file closed
    assert list(copy._files) == [1]
