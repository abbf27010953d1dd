"""A read's output is bounded (``max_output_bytes`` of its root, 1 GiB by default): a field whose
values would take more is refused with a typed error naming file, field, rows (and a padded
read's width) before anything that size is allocated, on the compiled read and the planned reader
alike; a read within the bound is unchanged. A ragged field read as rows costs its offsets and its
values, ``8·(n + 1) + 4·nnz`` bytes; read with ``width=`` it costs ``[n, width]``, as a fixed
field costs ``[n, *shape]``."""

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from rollfeed.payload import (
    PayloadInputError,
    PayloadOutputBoundError,
    PayloadRoot,
    PayloadWriter,
    RaggedRows,
    read_field,
    read_fields,
)
from rollfeed.payload.root import MAX_OUTPUT_BYTES

WIDE = 1_000_000  # kept ids in one row: 3 MB of uint24 ids in one file
WINDOW = 16_384  # a micro batch's rows


def wide_file(root, width=WIDE, rows=4):
    """One mask region of ``rows`` rows, row 1 holding ``width`` kept ids (its sampled one too)."""
    counts = np.ones(rows, np.int64)
    counts[1] = width
    ids = np.concatenate([np.arange(c, dtype=np.int64) for c in counts.tolist()])
    with PayloadWriter(root, group="g", name="w") as w:
        return w.write({"sampling_mask": (counts, ids)}, pos=0, sampled=np.zeros(rows, np.int64))


def peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        got = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return got


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_a_million_wide_row_over_a_micro_batch_window_is_read_at_the_size_of_its_rows(
    tmp_path, checked
):
    segs = wide_file(tmp_path)
    root = PayloadRoot(tmp_path, verify_checksums=checked)
    assert root.max_output_bytes == MAX_OUTPUT_BYTES == 1 << 30
    got = {}

    def read():
        got.update(read_fields(segs, {"sampling_mask": (0, WINDOW)}, root=root))

    assert peak(read) < 64 << 20  # the ids (12 MB decoded), never [16384, 10**6] (65 GB)
    rows = got["sampling_mask"].values
    assert isinstance(rows, RaggedRows) and got["sampling_mask"].widest == WIDE
    assert rows.nbytes == 8 * (WINDOW + 1) + 4 * (WIDE + 3)
    lengths = torch.zeros(WINDOW, dtype=torch.int64)
    lengths[:4] = torch.tensor([1, WIDE, 1, 1])  # each row's label slot, then its stored ids
    assert torch.equal(rows.lengths(), lengths)
    want = torch.cat([torch.tensor([-1, -1]), torch.arange(1, WIDE), torch.tensor([-1, -1])])
    assert torch.equal(rows.values, want.to(torch.int32))


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_a_million_wide_row_padded_over_a_micro_batch_window_is_refused_before_allocation(
    tmp_path, checked
):
    segs = wide_file(tmp_path)
    root = PayloadRoot(tmp_path, verify_checksums=checked)

    def read():
        with pytest.raises(PayloadOutputBoundError) as err:
            read_field(segs, "sampling_mask", (0, WINDOW), root=root, width=WIDE)
        e = err.value
        assert (e.file, e.field, e.rows, e.width) == (segs[0].file, "sampling_mask", WINDOW, WIDE)
        assert 0 <= e.pos < 4 and "max_output_bytes" in str(e)

    assert peak(read) < 64 << 20  # never [16384, 10**6]


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_a_window_listing_a_million_wide_row_many_times_is_refused_before_allocation(
    tmp_path, checked
):
    """Ragged rows cost what they hold: a window that lists the wide row 16 times holds 16
    million ids (64 MB), past a 16 MiB bound; refused before those values (or buffers the
    size of them) are allocated."""
    segs = wide_file(tmp_path)
    bound = 16 << 20
    root = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=bound)
    window = [(1, 2)] * 16

    def read():
        with pytest.raises(PayloadOutputBoundError) as err:
            read_field(segs, "sampling_mask", window, root=root)
        e = err.value
        assert (e.file, e.field, e.rows, e.width) == (segs[0].file, "sampling_mask", 16, None)
        assert f"{8 * 17 + 4 * 16 * WIDE} bytes" in str(e) and "max_output_bytes" in str(e)

    assert peak(read) < bound
    # the same window once: within the bound, read
    once = read_field(segs, "sampling_mask", [(1, 2)], root=root)
    assert once.lengths().tolist() == [WIDE] and once.nbytes == 16 + 4 * WIDE


def test_a_static_width_past_the_bound_is_refused_before_any_read(tmp_path):
    segs = wide_file(tmp_path, width=3)
    os.unlink(tmp_path / segs[0].file)  # nothing is opened: the plan alone is past the bound
    with pytest.raises(PayloadOutputBoundError) as err:
        read_field(segs, "sampling_mask", (0, WINDOW), root=tmp_path, width=20_000)
    assert (err.value.width, err.value.rows) == (20_000, WINDOW)


def test_a_fixed_field_of_wide_rows_is_bounded_too(tmp_path):
    rows = np.zeros((2, 1 << 20), np.uint8)  # 1 MiB rows: 2 MiB of file
    with PayloadWriter(tmp_path, group="g", name="w") as w:
        segs = w.write({"routed_experts": rows}, pos=0)
    for checked in (False, True):
        root = PayloadRoot(tmp_path, verify_checksums=checked)
        with pytest.raises(PayloadOutputBoundError) as err:
            read_field(segs, "routed_experts", (0, 2048), root=root)  # 2 GiB of mostly fill
        assert (err.value.field, err.value.width, err.value.rows) == (
            "routed_experts",
            1 << 20,
            2048,
        )
        assert read_field(segs, "routed_experts", (0, 2), root=root).shape == (2, 1 << 20)


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_a_read_exactly_at_the_bound_is_read_and_one_byte_less_refuses_it(tmp_path, checked):
    segs = wide_file(tmp_path, width=7, rows=9)
    windows = {"sampling_mask": (0, 12)}
    covered = [True] * 9 + [False] * 3
    # as rows: 13 offsets, and 15 values (rows of 1, 7, then seven of 1: each a label slot
    # and its stored ids; the 3 rows past the record empty)
    rows = 8 * 13 + 4 * 15
    at = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=rows)
    got = read_fields(segs, windows, root=at)["sampling_mask"]
    assert got.values.lengths().tolist() == [1, 7] + [1] * 7 + [0] * 3
    assert got.values.nbytes == rows and got.coverage.tolist() == covered
    below = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=rows - 1)
    with pytest.raises(PayloadOutputBoundError, match=f"{rows} bytes"):
        read_fields(segs, windows, root=below)
    # padded: 12 rows of width 7 int32 values
    cells = 12 * 7 * 4
    at = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=cells)
    got = read_fields(segs, windows, root=at, width=7)["sampling_mask"]
    assert got.values.shape == (12, 7) and got.coverage.tolist() == covered
    assert got.values[1].tolist() == [-1, *range(1, 7)] and (got.values[9:] == -1).all()
    below = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=cells - 1)
    with pytest.raises(PayloadOutputBoundError, match=f"{cells} bytes"):
        read_fields(segs, windows, root=below, width=7)


def test_object_store_reads_are_bounded_too(object_store, s3_url):
    root = PayloadRoot(s3_url, **object_store.options(max_output_bytes=1 << 20))
    segs = wide_file(root, width=300, rows=3)
    rows = read_field(segs, "sampling_mask", (0, 1000), root=root)  # 9 KB as rows: read
    assert rows.lengths()[:4].tolist() == [1, 300, 1, 0] and rows.nnz == 302
    with pytest.raises(PayloadOutputBoundError) as err:
        read_field(segs, "sampling_mask", (0, 1000), root=root, width=300)  # 1.2 MB padded
    assert err.value.file == segs[0].file and err.value.width == 300
    with pytest.raises(PayloadOutputBoundError) as err:  # row 1 listed 900 times: 1.09 MB
        read_field(segs, "sampling_mask", [(1, 2)] * 900, root=root)
    assert (err.value.file, err.value.rows, err.value.width) == (segs[0].file, 900, None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, 1 << 63])
def test_the_bound_itself_is_checked(tmp_path, bad):
    with pytest.raises(PayloadInputError, match="max_output_bytes"):
        PayloadRoot(tmp_path, max_output_bytes=bad)


OUT_OF_MEMORY = """
import sys, traceback
from tests.payload.test_output_bound import wide_file
from rollfeed.payload import PayloadRoot, read_field
segs = wide_file(sys.argv[1])
try:
    raised = PayloadRoot(sys.argv[1], max_output_bytes=1 << 40)
    # the wide row listed 4096 times: 4 * 10**9 ids, 16 GB of values to allocate
    read_field(segs, "sampling_mask", [(1, 2)] * 4096, root=raised)
except MemoryError as e:
    print("MemoryError", traceback.extract_tb(e.__traceback__)[-1].name)
"""


def _small_address_space() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_an_output_the_machine_cannot_hold_past_a_raised_bound_fails_cleanly(tmp_path):
    """The compiled read's output allocation failing is a plain MemoryError (the bound was
    raised by hand); CPython's half-made bytearray once printed a SystemError here."""
    sanitized = "ASAN_OPTIONS" in os.environ  # the sanitizer's own allocation limit applies
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY, str(tmp_path)],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=None if sanitized else _small_address_space,
    )
    # raised by the compiled read itself (its output allocation), not a fallback after it
    assert done.stdout.strip() == "MemoryError read_compiled", done.stderr[-2000:]
    assert "SystemError" not in done.stderr and "exported buffers" not in done.stderr
