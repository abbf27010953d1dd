"""RaggedRows against plain Python lists of rows: padding, trimming, windows, selections, checks."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from rollfeed.collate import RaggedRows, RaggedRowsError


def _ragged(rows: list[list[int]], dtype: torch.dtype = torch.int32) -> RaggedRows:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return RaggedRows.from_lengths(lengths, torch.tensor([v for r in rows for v in r], dtype=dtype))


def _rows(ragged: RaggedRows) -> list[list[int]]:
    off = ragged.offsets.tolist()
    return [ragged.values[a:b].tolist() for a, b in itertools.pairwise(off)]


def _random_rows(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(1000) for _ in range(rng.choice([0, 1, 1, 2, 5, 40]))] for _ in range(n)]


def test_padded_puts_each_row_left_with_fill_after_it() -> None:
    rows = [[7], [3, 9, 4], []]
    padded = _ragged(rows).padded(fill=-1)
    assert padded.tolist() == [[7, -1, -1], [3, 9, 4], [-1, -1, -1]]
    assert _ragged(rows).padded(5, fill=0).tolist() == [r + [0] * (5 - len(r)) for r in rows]


def test_from_padded_trims_trailing_fill_and_keeps_an_inner_one() -> None:
    padded = torch.tensor([[-1, 3, 9, -1], [5, -1, -1, -1], [-1, -1, -1, -1]])
    assert _rows(RaggedRows.from_padded(padded, fill=-1)) == [[-1, 3, 9], [5], []]


def test_round_trip_over_random_rows() -> None:
    rng = random.Random(0)
    for _ in range(20):
        rows = [[v + 1 for v in r] for r in _random_rows(rng, rng.randrange(0, 30))]
        ragged = _ragged(rows)
        assert _rows(RaggedRows.from_padded(ragged.padded(fill=0), fill=0)) == rows
        assert ragged.nnz == sum(map(len, rows))
        assert ragged.lengths().tolist() == [len(r) for r in rows]
        assert ragged.row_index().tolist() == [i for i, r in enumerate(rows) for _ in r]


def test_aligned_values_follow_the_rows_of_another_field() -> None:
    ids = _ragged([[7], [3, 9, 4], []])
    logprobs = torch.tensor([[-0.1, -9.0, -9.0], [-0.2, -1.0, -2.0], [-9.0, -9.0, -9.0]])
    aligned = RaggedRows.from_padded(logprobs, like=ids)
    assert torch.equal(aligned.offsets, ids.offsets)
    assert aligned.values.tolist() == pytest.approx([-0.1, -0.2, -1.0, -2.0])
    with pytest.raises(RaggedRowsError, match="width 2"):
        RaggedRows.from_padded(logprobs[:, :2], like=ids)


def test_rows_and_take_rebase_offsets() -> None:
    rng = random.Random(1)
    rows = _random_rows(rng, 25)
    ragged = _ragged(rows)
    assert _rows(ragged.rows(4, 17)) == rows[4:17]
    assert _rows(ragged.rows(3, 3)) == []
    index = [20, 0, 5, 5, 24, 13]
    assert _rows(ragged.take(torch.tensor(index))) == [rows[i] for i in index]
    assert _rows(ragged.take(torch.tensor([], dtype=torch.int64))) == []


def test_apply_and_equal_keep_rows_bitwise() -> None:
    ragged = _ragged([[1, 2], [3]])
    assert ragged.apply(torch.clone).equal(ragged)
    assert not ragged.equal(ragged.with_values(ragged.values + 1))
    assert not ragged.equal(_ragged([[1, 2], [3]], dtype=torch.int64))
    assert ragged.nbytes == 3 * 8 + 3 * 4


@pytest.mark.parametrize(
    ("offsets", "nnz", "match"),
    [
        ([1, 2], 2, "start at 0"),
        ([0, 3, 2], 2, "decrease after row 1"),
        ([0, 1], 2, "end at nnz = 2"),
    ],
)
def test_offsets_that_do_not_describe_the_values_are_refused(
    offsets: list[int], nnz: int, match: str
) -> None:
    with pytest.raises(RaggedRowsError, match=match):
        RaggedRows(torch.tensor(offsets), torch.zeros(nnz, dtype=torch.int32))


def test_wrong_shapes_and_selections_are_refused() -> None:
    ragged = _ragged([[1, 2, 3], [4]])
    with pytest.raises(RaggedRowsError, match="int64"):
        RaggedRows(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1))
    with pytest.raises(RaggedRowsError, match="1-D"):
        RaggedRows(torch.tensor([0, 1]), torch.zeros(1, 1))
    with pytest.raises(RaggedRowsError, match="does not fit width 2"):
        ragged.padded(2)
    with pytest.raises(RaggedRowsError, match="outside"):
        ragged.rows(1, 3)
    with pytest.raises(RaggedRowsError, match="outside"):
        ragged.take(torch.tensor([2]))
    with pytest.raises(RaggedRowsError, match="shape"):
        ragged.with_values(torch.zeros(3))


_R = _ragged([[7], [3, 9, 4], []])
_MISUSES = {
    "float lengths": (
        lambda: RaggedRows.from_lengths(torch.tensor([1.0, 3.0]), torch.zeros(4)),
        r"from_lengths: lengths must be a 1-D integer tensor.*got torch.float32",
    ),
    "negative lengths": (
        lambda: RaggedRows.from_lengths(torch.tensor([2, -1]), torch.zeros(1)),
        r"from_lengths: lengths must be >= 0, got lengths\[1\] = -1",
    ),
    "lengths not summing to nnz": (
        lambda: RaggedRows.from_lengths(torch.tensor([2, 2]), torch.zeros(3)),
        r"from_lengths: lengths must sum to the 3 values, got a sum of 4",
    ),
    "a boolean mask to take": (
        lambda: _R.take(torch.tensor([True, False, True])),
        r"take: index must be a 1-D integer tensor.*got torch.bool.*nonzero",
    ),
    "float indices to take": (
        lambda: _R.take(torch.tensor([1.7, 0.2])),
        r"take: index must be a 1-D integer tensor.*got torch.float32",
    ),
    "a 2-D index": (
        lambda: _R.take(torch.tensor([[0, 1]])),
        r"take: index must be a 1-D integer tensor.*shape \(1, 2\)",
    ),
    "a 0-D index": (lambda: _R.take(torch.tensor(1)), r"take: index .* shape \(\)"),
    "a list index": (lambda: _R.take([0, 1]), r"take: index .*got list"),
    "a float rows() start": (lambda: _R.rows(0.5, 2), r"rows: start must be an int.*float 0.5"),
    "a bool rows() stop": (lambda: _R.rows(0, True), r"rows: stop must be an int.*bool"),
    "fill 3.5 on int rows": (lambda: _R.padded(fill=3.5), r"padded: fill .*3.5, not an integer"),
    "a NaN fill on int rows": (lambda: _R.padded(fill=math.nan), r"padded: fill .*nan"),
    "a fill out of int32": (lambda: _R.padded(fill=2**40), r"padded: fill .*outside \["),
    "a fill out of float16": (
        lambda: _ragged([[1]], torch.float16).padded(fill=1e10),
        r"padded: fill .*outside the range of torch.float16",
    ),
    "a padded form too large to make": (
        lambda: _R.padded(1 << 58),
        r"padded: \[3, 288230376151711744\] torch.int32 .* cannot be made",
    ),
    "a padded form whose size overflows": (lambda: _R.padded(1 << 62), r"padded: .*overflows"),
    "a negative width": (lambda: _ragged([[], []]).padded(-1), r"padded: width must be >= 0"),
    "a float width": (lambda: _R.padded(3.0), r"padded: width must be an int"),
    "fill 3.5 to from_padded over int rows": (
        lambda: RaggedRows.from_padded(torch.zeros(2, 2, dtype=torch.int64), fill=3.5),
        r"from_padded: fill .*3.5",
    ),
    "from_padded like a tensor": (
        lambda: RaggedRows.from_padded(torch.zeros(3, 3), like=torch.zeros(3)),
        r"from_padded: like must be RaggedRows",
    ),
    ".to(torch.float32)": (lambda: _R.to(torch.float32), r"to: moves rows between devices only"),
    ".to(dtype=...)": (lambda: _R.to("cpu", dtype=torch.int64), r"to: moves rows .*dtype"),
    ".to(a tensor)": (lambda: _R.to(torch.zeros(1)), r"to: takes a device, not a tensor"),
    ".to(a bad device)": (lambda: _R.to("float32"), r"to: device 'float32' is not a device"),
    "apply changing the offsets' dtype": (
        lambda: _R.apply(torch.Tensor.float),
        r"apply: fn must move or copy the tensors.*torch.float32",
    ),
    "offsets as a list": (
        lambda: RaggedRows([0, 1], torch.zeros(1)),
        r"RaggedRows: offsets must be a 1-D int64 tensor.*got list",
    ),
    "equal to a tensor": (lambda: _R.equal(_R.values), r"equal: other must be RaggedRows"),
    "with_values of a list": (lambda: _R.with_values([1, 2, 3, 4]), r"with_values: values must"),
}


@pytest.mark.parametrize("misuse", list(_MISUSES))
def test_each_misuse_is_a_ragged_rows_error_naming_argument_and_need(misuse: str) -> None:
    call, match = _MISUSES[misuse]
    with pytest.raises(RaggedRowsError, match=match):
        call()


def test_what_the_checks_let_through_is_exact() -> None:
    rows = [[7], [3, 9, 4], []]
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):  # any integer index dtype
        assert _rows(_R.take(torch.tensor([2, 0, 1], dtype=dtype))) == [[], [7], [3, 9, 4]]
    lengths = torch.tensor([1, 3, 0], dtype=torch.uint8)
    assert _rows(RaggedRows.from_lengths(lengths, _R.values)) == rows
    assert _rows(_R.rows(np.int64(1), torch.tensor(3))) == rows[1:]
    assert _R.padded(fill=2.0).tolist() == [[7, 2, 2], [3, 9, 4], [2, 2, 2]]  # integral: 2
    assert _R.padded(4, fill=True)[2].tolist() == [1, 1, 1, 1]
    floats = _ragged(rows, torch.float32).padded(fill=math.nan)
    assert floats[0, 1:].isnan().all() and floats[1].tolist() == [3.0, 9.0, 4.0]
    moved = _R.to("cpu", copy=True)
    assert moved.equal(_R) and moved.values.data_ptr() != _R.values.data_ptr()
    assert _R.to(device=torch.device("cpu"), non_blocking=True).equal(_R)
    half = _R.with_values(_R.values.to(torch.float16))  # the way to another value dtype
    assert half.dtype == torch.float16 and torch.equal(half.offsets, _R.offsets)
    assert _ragged([]).padded(1 << 62).shape == (0, 1 << 62)  # no rows: nothing to allocate
