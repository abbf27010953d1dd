"""A read's output is bounded (``max_output_bytes`` of its root, 1 GiB by default): a field whose
padded ``[n, W]`` (or fixed ``[n, *shape]``) values would take more is refused with a typed error
naming file, field, rows and width before anything that size is allocated, on the compiled read
and the planned reader alike; a read within the bound is unchanged."""

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from rollfeed.payload import (
    PayloadInputError,
    PayloadOutputBoundError,
    PayloadRoot,
    PayloadWriter,
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
def test_a_million_wide_row_over_a_micro_batch_window_is_refused_before_allocation(
    tmp_path, checked
):
    segs = wide_file(tmp_path)
    assert os.path.getsize(tmp_path / segs[0].file) < 4 << 20
    root = PayloadRoot(tmp_path, verify_checksums=checked)
    assert root.max_output_bytes == MAX_OUTPUT_BYTES == 1 << 30

    def read():
        with pytest.raises(PayloadOutputBoundError) as err:
            read_field(segs, "sampling_mask", (0, WINDOW), root=root)
        e = err.value
        assert (e.file, e.field, e.rows, e.width, e.pos) == (
            segs[0].file,
            "sampling_mask",
            WINDOW,
            WIDE,
            1,
        )
        assert "max_output_bytes" in str(e)

    assert peak(read) < 64 << 20  # the ids are read (12 MB decoded), never [16384, 10**6]


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
    cells = 12 * 7 * 4  # 12 rows of W = 7 int32 values
    at = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=cells)
    got = read_fields(segs, {"sampling_mask": (0, 12)}, root=at)["sampling_mask"]
    assert got.values.shape == (12, 7) and got.coverage.tolist() == [True] * 9 + [False] * 3
    below = PayloadRoot(tmp_path, verify_checksums=checked, max_output_bytes=cells - 1)
    with pytest.raises(PayloadOutputBoundError, match="336 bytes"):
        read_fields(segs, {"sampling_mask": (0, 12)}, root=below)


def test_object_store_reads_are_bounded_too(object_store, s3_url):
    root = PayloadRoot(s3_url, **object_store.options(max_output_bytes=1 << 20))
    segs = wide_file(root, width=300, rows=3)
    with pytest.raises(PayloadOutputBoundError) as err:
        read_field(segs, "sampling_mask", (0, 1000), root=root)  # 1.2 MB padded
    assert err.value.file == segs[0].file and err.value.width == 300


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, 1 << 63])
def test_the_bound_itself_is_checked(tmp_path, bad):
    with pytest.raises(PayloadInputError, match="max_output_bytes"):
        PayloadRoot(tmp_path, max_output_bytes=bad)


OUT_OF_MEMORY = """
import sys, numpy as np
from tests.payload.test_output_bound import WIDE, WINDOW, wide_file
from rollfeed.payload import PayloadRoot, read_field
segs = wide_file(sys.argv[1])
try:
    raised = PayloadRoot(sys.argv[1], max_output_bytes=1 << 40)
    read_field(segs, "sampling_mask", (0, WINDOW), root=raised)
except MemoryError:
    print("MemoryError")
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
    assert done.stdout.strip() == "MemoryError", done.stderr[-2000:]
    assert "SystemError" not in done.stderr and "exported buffers" not in done.stderr
