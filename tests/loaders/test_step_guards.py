"""Step files are opened by the payload's open rule and read within bounds: a FIFO, a directory or
a symlink under a step file's name is a StepFileError naming the path at once (a FIFO never
blocks), a footer claiming an index too large is refused unread, a record rewritten in place to
the same size is a StepFileError naming file and sample, a file of another format version is
refused naming it; and the attack family ``step_guards`` (:mod:`tests.loaders.guard_attacks`)
finds nothing else."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    RolloutDataset,
    StepFileError,
    Topology,
    build_dataloader,
    read_step_file,
    write_step_file,
)
from tests.collate.gen import inline_batch
from tests.loaders.step_attacks import same_sizes_other_tokens
from tests.loaders.step_bytes import footer_fields, record_span, write_at
from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES

N = 13


@pytest.fixture
def step(tmp_path):
    samples = inline_batch(np.random.default_rng(8), N, 30)
    return tmp_path, samples, Path(write_step_file(tmp_path, 0, samples))


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


def test_fifo_under_a_step_file_name_is_refused_at_once(step):
    tmp, _, path = step
    path.unlink()
    os.mkfifo(path)
    try:
        blocked, err = _bounded(lambda: RolloutDataset.from_step_dir(tmp).lengths(0))
        assert not blocked, "reading the step blocked on a FIFO"
    finally:  # a reader blocked in open() is let go by a writer's open
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK) if blocked else None
        if fd is not None:
            os.close(fd)
    assert type(err) is StepFileError, repr(err)
    assert err.file == str(path) and "a FIFO" in str(err)


@pytest.mark.parametrize("thing", ["directory", "symlink", "dangling symlink"])
def test_directory_or_symlink_under_a_step_file_name_is_refused(step, thing):
    tmp, _, path = step
    good = tmp / "elsewhere" / path.name
    good.parent.mkdir()
    os.replace(path, good)
    if thing == "directory":
        path.mkdir()
    else:
        path.symlink_to(good if thing == "symlink" else tmp / "gone")
    with pytest.raises(StepFileError) as err:
        RolloutDataset.from_step_dir(tmp).lengths(0)
    assert err.value.file == str(path)
    assert ("a directory" if thing == "directory" else "symlink") in str(err.value)
    with pytest.raises(StepFileError):
        read_step_file(path)


def test_footer_claiming_an_index_beyond_the_bound_is_refused_unread(step):
    tmp, _, path = step
    _offset, _size, n, file_id, *_ = footer_fields(path)
    with open(path, "r+b") as f:
        f.truncate(1 << 36)  # sparse: 64 GiB that a whole read of the index would allocate
    import crc32c

    big = (1 << 36) - 48 - 8
    head = struct.pack("<QQQQI", 8, big, n, file_id, 0)
    write_at(path, (1 << 36) - 48, head + struct.pack("<I8s", crc32c.crc32c(head), b"RFSTEND\0"))
    with pytest.raises(StepFileError, match="more than an index may hold") as err:
        RolloutDataset.from_step_dir(tmp).lengths(0)
    assert err.value.file == str(path)


def test_same_size_rewrite_in_place_mid_pass_names_file_and_sample(step):
    tmp, samples, path = step
    loader = build_dataloader(
        RolloutDataset.from_step_dir(tmp),
        Topology(),
        LoaderConfig(plan=PlanConfig(seq_len=32)),
        root=None,
    )
    planned = loader.batch_sampler.step_micro_batches(0)
    assert len(planned) >= 3
    victim = int(planned[-1][0])  # a sample of the last micro batch: read after the rewrite
    other = Path(write_step_file(tmp / "other", 0, same_sizes_other_tokens(samples)))
    offset, size = record_span(path, victim)
    assert record_span(other, victim) == (offset, size)
    record = other.read_bytes()[offset : offset + size]
    assert record != path.read_bytes()[offset : offset + size]
    it = iter(loader)
    next(it)
    write_at(path, offset, record)  # the same inode, the same size, the same token count
    with pytest.raises(StepFileError, match="CRC-32C") as err:
        list(it)
    assert (err.value.file, err.value.sample) == (str(path), victim)


def test_file_of_another_format_version_is_refused_naming_it(step):
    tmp, _, path = step
    write_at(path, 8, struct.pack("<H", 2))
    with pytest.raises(StepFileError, match="format version 2; this reader reads version 1"):
        RolloutDataset.from_step_dir(tmp).lengths(0)


def test_step_guard_attacks_never_read_other_data_or_hang(tmp_path):
    s = run_family("step_guards", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 110 and s["correct"] >= 15 and s["refused"] >= 90, format_summary(s)
