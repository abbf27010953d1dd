import numpy as np
import pytest

from rollfeed.payload import PayloadInputError, canonical_rows
from rollfeed.payload.format.layout import (
    BLOCK_ROWS,
    decode_index,
    index_table,
    ragged_bytes,
    values_start,
)
from rollfeed.payload.format.values import decode_into, encode_values, spare, value_dtype


def fill_table(bodies, lo, hi, rows, values, *, count_bytes, block_rows):
    arrays = (np.asarray(x, np.int64) for x in (lo, hi, rows, values))
    table = index_table(*arrays, count_bytes=count_bytes, block_rows=block_rows)
    for body, start, size, at in zip(
        bodies, table.span_start, table.span_len, table.slot, strict=True
    ):
        table.table[at : at + size] = np.frombuffer(body[start : start + size], np.uint8)
    return decode_index(table)


def decode_rows(
    body: bytes, lo: int, hi: int, *, rows: int, values: int, count_bytes: int, block_rows: int
):
    return fill_table(
        [body], [lo], [hi], [rows], [values], count_bytes=count_bytes, block_rows=block_rows
    )


def test_worked_example_bytes():
    body, count_bytes = ragged_bytes(
        np.array([2, 0, 1]), np.array([7, 9, 4]), dtype="int32", block_rows=2
    )
    assert count_bytes == 1
    expected = (
        (0).to_bytes(8, "little")
        + bytes([2, 0])
        + (2).to_bytes(8, "little")
        + bytes([1])
        + bytes(1)  # pad values to 4 bytes
        + np.array([7, 9, 4], "<i4").tobytes()
    )
    assert body == expected


def test_wide_rows_use_wider_lengths():
    counts = np.array([1, 300, 2])
    body, count_bytes = ragged_bytes(counts, np.arange(303), dtype="int32")
    assert count_bytes == 2
    idx = decode_rows(body, 1, 3, rows=3, values=303, count_bytes=2, block_rows=128)
    assert idx.counts.tolist() == [300, 2] and idx.starts.tolist() == [1, 301]


@pytest.mark.parametrize("mean", [1.7, 8.0])
def test_bytes_per_token_target(mean):
    """Kept sets of a vocabulary below 2**24 without their sampled token: 3-byte ids, a 1-byte
    length and 8/128 bytes of block offset per row."""
    rng = np.random.default_rng(0)
    counts = rng.geometric(1 / mean, 100_000) - 1  # stored: the kept set less its sampled token
    ids = rng.integers(0, 151_936, counts.sum())
    dtype = value_dtype(ids, is_int=True)
    body, _ = ragged_bytes(counts, ids, dtype=dtype)
    per_token = len(body) / counts.size
    assert dtype == "uint24" and per_token <= 3 * counts.mean() + 1.07
    if mean == 1.7:
        assert per_token <= 3.3


@pytest.mark.parametrize(
    ("values", "dtype", "size"),
    [
        ([0, 7, 255], "uint8", 1),
        ([256, 65_535], "uint16", 2),
        ([0, 151_935, (1 << 24) - 1], "uint24", 3),
        ([1 << 24, 5], "int32", 4),
        ([-1, 3], "int32", 4),
        ([], "uint8", 1),
    ],
)
def test_ragged_values_take_the_narrowest_width_and_decode_back(values, dtype, size):
    values = np.array(values, np.int64)
    assert value_dtype(values, is_int=True) == dtype
    raw = encode_values(values, dtype)
    assert raw.size == size * values.size
    if dtype == "uint24":  # little endian, 3 bytes: 151935 = 0x02517f
        assert raw[3:6].tolist() == [0x7F, 0x51, 0x02]
    got = np.empty(values.size, np.int32)
    decode_into(got, np.concatenate([raw, np.full(spare(dtype), 0xAB, np.uint8)]), dtype)
    np.testing.assert_array_equal(got, values)  # the spare byte never leaks into a value
    floats = np.array([-0.5, np.inf], np.float32)
    assert value_dtype(floats, is_int=False) == "float32"


def test_canonical_rows_follow_the_worked_example():
    """rollfeed.payload.format.label_rows: sampled first, the others ascending, a repeat dropped."""
    rows = canonical_rows(np.array([3, 1, 0, 3]), np.array([7, 40, 3, 7, 5, 9, 5]), [40, 7, 5, 5])
    assert rows.counts.tolist() == [3, 1, 0, 2] and rows.missing.tolist() == []
    assert rows.order.tolist() == [1, 2, 0, 3, 4, 5]  # rows [40, 3, 7] [7] [] [5, 9]
    missing = canonical_rows(np.array([2, 0]), np.array([3, 4]), np.array([9, 9]))
    assert missing.missing.tolist() == [0]  # a non-empty row without its sampled token


def test_index_decodes_several_requests_at_once():
    counts = [np.array([1, 0, 2, 3]), np.array([4, 1]), np.array([0, 0, 5])]
    bodies = [ragged_bytes(c, np.arange(c.sum()), dtype="int32", block_rows=2)[0] for c in counts]
    lo, hi = [1, 0, 2], [4, 2, 3]
    rows, values = [c.size for c in counts], [int(c.sum()) for c in counts]
    idx = fill_table(bodies, lo, hi, rows, values, count_bytes=1, block_rows=2)
    assert idx.counts.tolist() == [0, 2, 3, 4, 1, 5]
    assert idx.starts.tolist() == [1, 1, 3, 0, 4, 0]
    assert idx.row_base.tolist() == [0, 3, 5, 6]


def test_index_decodes_any_window():
    rng = np.random.default_rng(1)
    for trial in range(100):
        n, block = int(rng.integers(1, 700)), int(rng.integers(1, 140))
        block = min(block, max(BLOCK_ROWS, n))  # a block larger than both is refused
        counts = rng.integers(0, 300 if trial % 4 == 0 else 5, n)
        body, cb = ragged_bytes(counts, np.arange(counts.sum()), dtype="int32", block_rows=block)
        lo = int(rng.integers(0, n))
        hi = int(rng.integers(lo + 1, n + 1))
        idx = decode_rows(
            body, lo, hi, rows=n, values=int(counts.sum()), count_bytes=cb, block_rows=block
        )
        starts = np.cumsum(counts) - counts
        np.testing.assert_array_equal(idx.counts, counts[lo:hi])
        np.testing.assert_array_equal(idx.starts, starts[lo:hi])
        vals = np.frombuffer(body[values_start(n, cb, block) :], "<i4")
        np.testing.assert_array_equal(vals, np.arange(counts.sum()))


@pytest.mark.parametrize(
    ("counts", "values", "match"),
    [
        (np.array([1, -1]), np.array([3]), "counts must be >= 0"),
        (np.array([2, 1]), np.array([3, 4]), "sum\\(counts\\)=3"),
        (np.array([1]), np.array([1 << 40]), "fit int32"),
    ],
)
def test_bad_ragged_input(counts, values, match):
    with pytest.raises(PayloadInputError, match=match):
        ragged_bytes(counts, values, dtype="int32")
