"""Step files and indexes are opened by the payload's open rule and read within bounds: a FIFO, a
directory or a symlink under their names is a StepFileError naming the path at once (a FIFO never
blocks), an index too large is refused unread, a line rewritten in place to the same size is a
StepFileError naming file and line; the index (version 2) holds a CRC-32C per line, in the
documented bytes, and an index of version 1 is treated as no index; and the attack family
``step_guards`` (:mod:`tests.loaders.guard_attacks`) finds nothing else."""

from __future__ import annotations

import json
import logging
import os
import threading

import crc32c
import numpy as np
import pytest

from rollfeed.collate import PlanConfig, Sample
from rollfeed.loaders import (
    LoaderConfig,
    RolloutDataset,
    StepFileError,
    Topology,
    build_dataloader,
    read_step_file,
    write_step_file,
)
from rollfeed.loaders.errors import StepIndexVersionError
from rollfeed.loaders.step_index import build_step_index, index_path
from tests.collate.gen import inline_batch
from tests.loaders.step_attacks import same_sizes_other_tokens
from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES

N = 13


@pytest.fixture
def step(tmp_path):
    samples = inline_batch(np.random.default_rng(8), N, 30)
    return tmp_path, samples, write_step_file(tmp_path, 0, samples)


def _bounded(call, seconds: float = 5.0):
    """``call()``'s error (or ``None``), failing the test if it is still running after
    ``seconds`` (a thread: a blocked ``open`` of a FIFO would never return)."""
    out: list = []

    def body():
        try:
            call()
            out.append(None)
        except Exception as err:  # the caller asserts the type
            out.append(err)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), out[0] if out else None


@pytest.mark.parametrize("target", ["step", "index"])
def test_fifo_under_a_step_file_or_index_name_is_refused_at_once(step, target):
    tmp, _, path = step
    fifo = path if target == "step" else index_path(path)
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        blocked, err = _bounded(lambda: RolloutDataset.from_step_dir(tmp).lengths(0))
        assert not blocked, "reading the step blocked on a FIFO"
    finally:  # a reader blocked in open() is let go by a writer's open
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK) if blocked else None
        if fd is not None:
            os.close(fd)
    assert type(err) is StepFileError, repr(err)
    assert err.file == str(fifo) and "is a FIFO" in str(err)


@pytest.mark.parametrize("target", ["step", "index"])
@pytest.mark.parametrize("thing", ["directory", "symlink", "dangling symlink"])
def test_directory_or_symlink_under_a_step_file_or_index_name_is_refused(step, target, thing):
    tmp, _, path = step
    name = path if target == "step" else index_path(path)
    good = tmp / "elsewhere" / name.name
    good.parent.mkdir()
    os.replace(name, good)
    if thing == "directory":
        name.mkdir()
    else:
        name.symlink_to(good if thing == "symlink" else tmp / "gone")
    with pytest.raises(StepFileError) as err:
        RolloutDataset.from_step_dir(tmp).lengths(0)
    assert err.value.file == str(name)
    assert ("a directory" if thing == "directory" else "a symlink") in str(err.value)
    if target == "step":
        with pytest.raises(StepFileError):
            read_step_file(name)


def test_index_larger_than_the_bound_is_refused_unread(step):
    tmp, _, path = step
    with open(index_path(path), "wb") as f:
        f.truncate(1 << 36)  # sparse: 64 GiB that a whole read would allocate
    with pytest.raises(StepFileError, match="more than the") as err:
        RolloutDataset.from_step_dir(tmp).lengths(0)
    assert err.value.file == str(index_path(path))


def test_line_above_the_line_bound_is_refused(step, monkeypatch):
    import rollfeed.loaders.step_index_check as check
    import rollfeed.loaders.step_lines as lines

    tmp, samples, path = step
    longest = max(len(s.to_json()) for s in samples) + 1
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", longest - 1)
    monkeypatch.setattr(check, "MAX_LINE_BYTES", longest - 1)
    with pytest.raises(StepFileError, match="more than a step line may hold"):
        read_step_file(path)
    ds = RolloutDataset.from_step_dir(tmp)
    with pytest.raises(StepFileError, match="more than a step line may hold"):
        [ds[int(i)] for i in ds.step_indices(0)]


def test_same_size_rewrite_in_place_mid_pass_names_file_and_line(step):
    tmp, samples, path = step
    loader = build_dataloader(
        RolloutDataset.from_step_dir(tmp),
        Topology(),
        LoaderConfig(plan=PlanConfig(seq_len=32)),
        root=None,
    )
    planned = loader.batch_sampler.step_micro_batches(0)
    assert len(planned) >= 3
    victim = planned[-1][0]  # a sample of the last micro batch: read after the rewrite
    line = (same_sizes_other_tokens(samples)[victim].to_json() + "\n").encode()
    before = (samples[victim].to_json() + "\n").encode()
    assert len(line) == len(before) and line != before
    offset = sum(len(s.to_json()) + 1 for s in samples[:victim])
    it = iter(loader)
    next(it)
    with open(path, "r+b") as f:  # the same inode, the same size, the same token count
        f.seek(offset)
        f.write(line)
    with pytest.raises(StepFileError, match="CRC-32C") as err:
        list(it)
    assert (err.value.file, err.value.line) == (str(path), victim + 1)


def test_index_bytes_are_the_documented_layout(tmp_path):
    samples = [
        Sample(
            np.arange(1, T + 1),
            loss_mask=np.arange(T) > 0,
            advantages=np.zeros(T, np.float32),
            inference_logprobs=np.zeros(T, np.float32),
        )
        for T in (3, 2)
    ]
    path = write_step_file(tmp_path, 0, samples)
    lines = path.read_bytes().splitlines(keepends=True)
    sizes = [len(x) for x in lines]
    want = (
        '{"format":"rollfeed.step_index","version":2,'
        f'"file_bytes":{sum(sizes)},"lengths":[3,2],"offsets":[0,{sizes[0]}],'
        f'"sizes":[{sizes[0]},{sizes[1]}],"lines":[1,2],'
        f'"crc32c":[{crc32c.crc32c(lines[0])},{crc32c.crc32c(lines[1])}],'
        '"loss_runs":[1,1],"loss_spans":[1,3,1,2]}'  # loss_mask [0, 1, 1] and [0, 1]
    )
    assert index_path(path).read_bytes() == want.encode()


def test_index_of_version_1_is_not_used(step, caplog):
    tmp, samples, path = step
    record = json.loads(index_path(path).read_text())
    del record["crc32c"]
    index_path(path).write_text(json.dumps({**record, "version": 1}))
    ds = RolloutDataset.from_step_dir(tmp)
    with caplog.at_level(logging.WARNING, logger="rollfeed.loaders.step_load"):
        assert ds.lengths(0).tolist() == [len(s) for s in samples]
    assert ds.metrics()["unindexed_steps"] == 1  # parsed whole, counted
    assert any("version 1" in r.getMessage() for r in caplog.records)
    strict = RolloutDataset.from_step_dir(tmp, missing_index="error")
    with pytest.raises(StepIndexVersionError, match="build_step_index") as err:
        strict.lengths(0)
    assert err.value.file == str(index_path(path))
    build_step_index(path)
    again = RolloutDataset.from_step_dir(tmp, missing_index="error")
    assert again.lengths(0).tolist() == [len(s) for s in samples]
    assert again.metrics()["indexed_steps"] == 1


def test_step_guard_attacks_never_read_other_data_or_hang(tmp_path):
    s = run_family("step_guards", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 110 and s["correct"] >= 15 and s["refused"] >= 90, format_summary(s)
