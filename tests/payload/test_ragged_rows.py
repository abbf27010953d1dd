"""RaggedRows against plain Python lists of rows: padding, trimming, windows, selections, checks."""

from __future__ import annotations

import itertools
import random

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
