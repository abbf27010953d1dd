"""Step files and their indexes: an index that disagrees with its file, and crafted lines or index
files, are StepFileErrors naming the file (and the line where known), never a quietly shorter step
or a bare Python error."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource

import numpy as np
import pytest

from rollfeed.collate import Sample
from rollfeed.loaders import (
    RolloutDataset,
    StepFileError,
    StepMissingError,
    read_step_file,
    write_step_file,
)
from rollfeed.loaders.dataset import STEP_STRIDE
from rollfeed.loaders.step_index import index_path, read_step_index

N = 6


def _samples(n: int = N) -> list[Sample]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        T = 3 + i
        out.append(
            Sample(
                rng.integers(0, 100, T),
                loss_mask=np.arange(T) > 0,
                advantages=rng.standard_normal(T).astype(np.float32),
                inference_logprobs=-rng.random(T, dtype=np.float32),
                fields={"sampling_mask": (np.ones(T, np.int64), rng.integers(0, 100, T))},
                uid=f"s{i}",
            )
        )
    return out


@pytest.fixture
def step(tmp_path):
    path = write_step_file(tmp_path, 0, _samples())
    return tmp_path, path


def _index_record(path) -> dict:
    return json.loads(index_path(path).read_text())


def _write_index_record(path, record: dict) -> None:
    index_path(path).write_text(json.dumps(record))


def _keep(record: dict, keep: list[int]) -> dict:
    """The index of the samples ``keep`` only (their loss runs too)."""
    arrays = ("lengths", "offsets", "sizes", "lines", "crc32c", "loss_runs")
    first = np.cumsum([0, *record["loss_runs"]]).tolist()
    spans = [v for i in keep for v in record["loss_spans"][2 * first[i] : 2 * first[i + 1]]]
    return {**record, **{k: [record[k][i] for i in keep] for k in arrays}, "loss_spans": spans}


@pytest.mark.parametrize(
    ("keep", "first_unindexed_line"),
    [
        ([0, 1, 2], 4),  # the index was cut short: the last three samples
        ([0, 1, 3, 4, 5], 3),  # one sample in the middle left out
        ([1, 2, 3, 4, 5], 1),  # the first sample left out
    ],
    ids=["tail", "middle", "head"],
)
def test_index_with_fewer_entries_than_lines_is_a_step_file_error(step, keep, first_unindexed_line):
    tmp, path = step
    _write_index_record(path, _keep(_index_record(path), keep))
    ds = RolloutDataset.from_step_dir(tmp)
    with pytest.raises(StepFileError, match="does not cover the file's samples") as err:
        ds.lengths(0)
    assert err.value.file == str(path) and err.value.line == first_unindexed_line


def test_index_with_empty_arrays_is_a_step_file_error(step):
    tmp, path = step
    _write_index_record(path, _keep(_index_record(path), []))
    with pytest.raises(StepFileError, match="does not cover the file's samples") as err:
        RolloutDataset.from_step_dir(tmp).step_indices(0)
    assert err.value.file == str(path) and err.value.line == 1


def test_index_skipping_a_line_it_calls_blank_is_a_step_file_error(step):
    """Line numbers that skip line 3 say it is blank; the bytes there are a sample."""
    _, path = step
    record = _keep(_index_record(path), [0, 1, 3, 4, 5])
    assert record["lines"] == [1, 2, 4, 5, 6]
    _write_index_record(path, record)
    with pytest.raises(StepFileError, match="are not blank lines") as err:
        read_step_index(path)
    assert err.value.line == 3


def test_blank_lines_the_index_skips_are_counted(step):
    """Blank bytes between two entries must hold as many lines as the line numbers skip."""
    _, path = step
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"\n\n" + b"".join(lines[1:]))
    record = _index_record(path)
    record["file_bytes"] += 2
    record["offsets"] = [o + 2 * (i > 0) for i, o in enumerate(record["offsets"])]
    record["lines"] = [1] + [n + 1 for n in record["lines"][1:]]  # says one blank line, not two
    _write_index_record(path, record)
    with pytest.raises(StepFileError, match="hold 2 lines where the index says 1") as err:
        read_step_index(path)
    assert err.value.file == str(path) and err.value.line == 2


def test_index_entry_spanning_two_lines_is_refused_by_the_reading_worker(step):
    tmp, path = step
    record = _index_record(path)
    record["sizes"][1] += record["sizes"][2]
    record = _keep(record, [0, 1, 3, 4, 5])
    record["lines"] = [1, 2, 3, 4, 5]  # as if lines 2 and 3 were one
    _write_index_record(path, record)
    ds = RolloutDataset.from_step_dir(tmp)
    assert len(ds.lengths(0)) == N - 1  # contiguous and sized right: only reading line 2 tells
    with pytest.raises(StepFileError, match="not one whole line") as err:
        ds[1]
    assert err.value.file == str(path) and err.value.line == 2


@pytest.mark.parametrize(
    "crafted",
    [
        lambda r: {**r, "offsets": [2**64, *r["offsets"][1:]]},  # beyond int64
        lambda r: {**r, "offsets": [2**63 - 1, *r["offsets"][1:]]},  # offset + size wraps
        lambda r: {**r, "lengths": [1.5] * len(r["lengths"])},  # floats read as ints
        lambda r: {**r, "lines": [True, *r["lines"][1:]]},  # a boolean read as line 1
        lambda r: {**r, "file_bytes": 1e400},  # JSON infinity
        lambda r: "[" * 100_000 + "]" * 100_000,  # deeper than the parser's recursion limit
    ],
    ids=["int-beyond-int64", "wrapping-offset", "float-lengths", "bool-line", "inf", "deep"],
)
def test_crafted_index_is_a_typed_error_naming_the_index_file(step, crafted):
    _, path = step
    record = crafted(_index_record(path))
    text = record if isinstance(record, str) else json.dumps(record)
    index_path(path).write_text(text)
    with pytest.raises(StepFileError, match="step index") as err:
        read_step_index(path)
    assert err.value.file == str(index_path(path))


def test_step_index_read_back_checks_only_the_index_for_a_file_without_blank_lines(
    step, monkeypatch
):
    """Planning stays index-only: no byte of a step file without blank lines is read."""
    _, path = step
    reads = []
    real = os.pread
    monkeypatch.setattr(
        os, "pread", lambda fd, *a: reads.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd, *a)
    )
    index = read_step_index(path)
    assert len(index) == N and str(path) not in reads
    assert reads == [str(index_path(path))]  # the index, read through the open rule


@pytest.mark.parametrize(
    "line",
    [
        b"[1, 2, 3]",  # a JSON list, not an object
        b"null",
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser's recursion limit
        json.dumps(  # 1000 does not fit the uint8 the record claims
            {
                "token_ids": [1, 2],
                "loss_mask": [0, 1],
                "advantages": [0.0, 1.0],
                "inference_logprobs": [0.0, -1.0],
                "fields": {"routed_experts": {"dtype": "uint8", "shape": [2], "data": [1, 1000]}},
            }
        ).encode(),
        json.dumps(
            {
                "token_ids": [1, 2],
                "loss_mask": [0, 1],
                "advantages": [0.0, 1.0],
                "inference_logprobs": [0.0, -1.0],
                "fields": [],  # a list, not an object of field records
            }
        ).encode(),
    ],
    ids=["list", "null", "deep", "uint8-overflow", "fields-list"],
)
def test_step_line_that_is_a_json_list_is_a_typed_error(tmp_path, line):
    """Crafted lines of every kind are StepFileErrors naming the file and the line."""
    good = _samples(2)
    path = write_step_file(tmp_path, 0, good)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + line + b"\n" + lines[1])
    with pytest.raises(StepFileError) as err:
        read_step_file(path)
    assert err.value.file == str(path) and err.value.line == 2


def test_token_ids_beyond_int64_are_refused_not_wrapped(tmp_path):
    record = json.loads(_samples(1)[0].to_json())
    record["token_ids"] = [2**63 + t for t in record["token_ids"]]  # uint64: wraps in int64
    path = tmp_path / "step_000000.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(StepFileError, match="outside int64") as err:
        read_step_file(path)
    assert err.value.line == 1


def test_dataset_index_past_the_steps_samples_is_a_step_file_error(step):
    tmp, path = step
    ds = RolloutDataset.from_step_dir(tmp)
    assert len(ds.step_indices(0)) == N
    with pytest.raises(StepFileError, match="which has 6") as err:
        ds[0 * STEP_STRIDE + N]
    assert err.value.file == str(path)


def _write_under_a_size_limit(directory, limit: int, samples, conn) -> None:
    """In a forked child: the kernel refuses writes past ``limit`` bytes (``RLIMIT_FSIZE``; Python
    ignores the SIGXFSZ that comes with it), part-way through a file, as a full disk does."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        write_step_file(directory, 4, samples)
        conn.send(("no error", None, None))
    except Exception as err:
        conn.send((type(err).__name__, str(err), getattr(err, "file", None)))


def test_write_step_file_refused_by_the_disk_is_a_typed_error_leaving_nothing(tmp_path):
    samples = _samples(40)
    size = len(b"".join((s.to_json() + "\n").encode() for s in samples))
    before = sorted(os.listdir(tmp_path))
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_write_under_a_size_limit, args=(tmp_path, size // 2, samples, child)
    )
    proc.start()
    kind, message, file = parent.recv()
    proc.join(10)
    assert kind == "StepWriteError", (kind, message)
    assert file == str(tmp_path / "step_000004.jsonl") and "step 4" in message
    assert sorted(os.listdir(tmp_path)) == before  # no .tmp, no index of a step that is not there
    write_step_file(tmp_path, 4, samples)  # with room, the same write goes through
    assert len(RolloutDataset.from_step_dir(tmp_path).lengths(4)) == 40


@pytest.mark.parametrize("missing_index", ["parse", "error"])
def test_lengths_of_a_missing_step_names_the_step_and_the_directory(step, missing_index):
    tmp, _ = step
    ds = RolloutDataset.from_step_dir(tmp, missing_index=missing_index)
    with pytest.raises(StepMissingError) as err:
        ds.lengths(3)
    assert err.value.step == 3 and err.value.file == str(tmp / "step_000003.jsonl")
    assert f"in {tmp}" in str(err.value) and "present: steps 0..0" in str(err.value)
