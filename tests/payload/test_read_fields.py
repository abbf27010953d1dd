"""One call reads several fields over their windows: bitwise what ``read_field`` reads field by
field, with a coverage per field that says which rows came from data, and one ``preadv`` per
contiguous range of a file (region headers included)."""

import os

import numpy as np
import pytest
import torch

from rollfeed.collate.cp import field_ranges, rank_ranges
from rollfeed.payload import (
    PayloadInputError,
    PayloadMissingFileError,
    PayloadRoot,
    PayloadWriter,
    RaggedRows,
    read_field,
    read_fields,
    shift_segments,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS
from rollfeed.payload.read import compiled_read
from tests.payload.common import FIELDS, fast_root, kept_sets, packed_micro_batch, same_read
from tests.payload.reference import row_lists


def reference_coverage(segs, field, ranges) -> np.ndarray:
    """From the records alone: a position is covered when a live record of the field holds it."""
    pos = np.concatenate([np.arange(lo, hi) for lo, hi in ranges] or [np.zeros(0, int)])
    out = np.zeros(len(pos), bool)
    for s in segs:
        if s.field == field and s.rows:
            out |= (pos >= s.pos) & (pos < s.pos + s.rows)
    return out


@pytest.mark.parametrize("checked", [False, True])
def test_read_fields_equals_read_field_over_cp_windows_and_random_ranges(tmp_path, checked):
    rng = np.random.default_rng(3)
    segs, cu = packed_micro_batch(tmp_path, rng)
    S = cu[-1]
    root = PayloadRoot(tmp_path, verify_checksums=checked)
    windows = []
    for layout in ("contiguous", "zigzag"):
        for cp_size in (1, 2):
            for rank in range(cp_size):
                windows.append(rank_ranges(cu, rank, cp_size, layout))
    for _ in range(12):
        lo = int(rng.integers(0, S))
        windows.append([(lo, int(rng.integers(lo, S + 3))), (int(rng.integers(0, 5)), 7)])
    for ranges in windows:
        per_field = {f: field_ranges(ranges, PAYLOAD_FIELDS[f].window, S) for f in FIELDS}
        got = read_fields(segs, per_field, root=root)
        assert set(got) == set(FIELDS)
        for f in FIELDS:
            one = read_field(segs, f, per_field[f], root=root)
            assert same_read(got[f].values, one), f
            want = reference_coverage(segs, f, per_field[f])
            assert got[f].coverage.dtype == torch.bool
            np.testing.assert_array_equal(got[f].coverage.numpy(), want)
            spec = PAYLOAD_FIELDS[f]
            covered = got[f].coverage
            if spec.ragged:  # uncovered rows empty
                assert not one.lengths()[~covered].any(), f
                if spec.label == "omitted":  # each covered row's label slot, at the fill
                    assert (one.lengths()[covered] >= 1).all(), f
                    assert (one.values[one.offsets[:-1][covered]] == spec.fill).all(), f
            else:
                assert (one[~covered] == spec.fill).all()


def test_fields_no_segment_carries_are_left_out(tmp_path):
    rng = np.random.default_rng(0)
    segs, _ = packed_micro_batch(tmp_path, rng, samples=2)
    only_mask = [s for s in segs if s.field == "sampling_mask"]
    got = read_fields(only_mask, {"sampling_mask": (0, 4), "routed_experts": (0, 4)}, root=tmp_path)
    assert list(got) == ["sampling_mask"]
    assert read_field(only_mask, "routed_experts", (0, 4), root=tmp_path) is None


def test_placeholders_only_read_as_empty_rows_with_no_coverage(tmp_path):
    rng = np.random.default_rng(1)
    segs, _ = packed_micro_batch(tmp_path, rng, samples=2)
    empty = [s.model_copy(update={"rows": 0, "file": "g/gone.rfp"}) for s in segs]
    got = read_fields(empty, {"sampling_mask": (0, 3)}, root=tmp_path)["sampling_mask"]
    assert isinstance(got.values, RaggedRows) and got.values.dtype == torch.int32
    assert got.values.offsets.tolist() == [0, 0, 0, 0] and got.values.nnz == 0
    assert got.coverage.tolist() == [False] * 3 and got.widest == 0
    padded = read_fields(empty, {"sampling_mask": (0, 3)}, root=tmp_path, width=2)
    assert padded["sampling_mask"].values.tolist() == [[-1, -1]] * 3


def test_two_fields_of_one_file_take_one_preadv_per_file(tmp_path, monkeypatch):
    # the planned reader's batching (the compiled read's: tests/payload/test_compiled_read.py)
    monkeypatch.setattr(compiled_read, "_window", None)
    rng = np.random.default_rng(2)
    segs, cu = packed_micro_batch(tmp_path, rng, files=3, samples=3, unit=1, clip=False)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: calls.append(fd) or real(fd, bufs, at))
    windows = {"routed_experts": (0, cu[-1]), "sampling_mask": (0, cu[-1])}
    got = read_fields(segs, windows, root=PayloadRoot(tmp_path))
    # per file: routing header, rows, (its checksum table), mask header, index, values: one call
    assert len(calls) == len(set(calls)) == 3
    for f in windows:
        assert same_read(got[f].values, read_field(segs, f, windows[f], root=tmp_path))


def test_an_error_names_the_field_whose_file_it_is(tmp_path):
    rng = np.random.default_rng(4)
    segs, cu = packed_micro_batch(tmp_path, rng, files=1, samples=2)
    moved = [
        s.model_copy(update={"file": "g/gone.rfp"}) if s.field == "sampling_mask" else s
        for s in segs
    ]
    windows = {"routed_experts": (0, cu[-1]), "sampling_mask": (0, cu[-1])}
    with pytest.raises(PayloadMissingFileError) as info:
        read_fields(moved, windows, root=PayloadRoot(tmp_path, retries=0))
    assert info.value.file == "g/gone.rfp" and info.value.field == "sampling_mask"


def _pair(rng, writer, T: int, uid: str):
    """(inline sample, by-handle sample) whose fields hold the same rows at the same positions:
    every position [0, T) (a sample's inline field has a row per token, holding the token)."""
    from rollfeed.collate import Sample

    counts = rng.choice([1, 2, 5], T)
    ids = rng.integers(0, 1000, T)
    kept, _ = kept_sets(rng, counts, 1000, sampled=ids)
    arrays = {
        "routed_experts": rng.integers(0, 200, (T, 2, 2)).astype(np.uint8),
        "sampling_mask": (counts, kept.astype(np.int32)),
    }
    tokens = dict(loss_mask=np.ones(T, bool), advantages=np.zeros(T, np.float32))
    tokens.update(inference_logprobs=np.zeros(T, np.float32))
    inline = Sample(ids, **tokens, fields=arrays, uid=uid)
    handle = Sample(ids, **tokens, payload=writer.write(arrays, pos=0, sampled=ids), uid=uid)
    return inline, handle


def _inline_coverage(mb, name: str, ranges, labels: bool) -> np.ndarray:
    """The rows inline samples carry, as the collate path lays them out: a sample's rows start
    at its position (one later for a ``labels`` field, whose first row is never a label)."""
    carried = np.zeros(mb.length + 1, bool)
    for sample, start in zip(mb.samples, mb.starts, strict=True):
        data = sample.fields.get(name)
        if data is not None:
            rows = len(data[0]) if isinstance(data, tuple) else len(data)
            carried[start + int(labels) : start + rows] = True
    return carried[np.concatenate([np.arange(lo, hi) for lo, hi in ranges])]


@pytest.mark.parametrize("cp_layout", ["contiguous", "zigzag"])
def test_coverage_by_handle_equals_the_rows_inline_samples_carry(tmp_path, cp_layout):
    from rollfeed.collate import PlanConfig, prepare_batch

    rng = np.random.default_rng(5)
    with PayloadWriter(tmp_path, group="g", name="w") as writer:
        pairs = [_pair(rng, writer, int(T), f"s{i}") for i, T in enumerate(rng.integers(2, 90, 12))]
    config = PlanConfig(seq_len=64, cp_size=2, cp_layout=cp_layout)  # some samples truncated
    plans = [prepare_batch([p[k] for p in pairs], config, dp_size=1) for k in (0, 1)]
    checked = 0
    for ma, mb in zip(plans[0][0], plans[1][0], strict=True):
        for rank in range(2):
            ranges = rank_ranges(mb.cu_seqlens, rank, 2, cp_layout)
            windows = {
                f: field_ranges(ranges, PAYLOAD_FIELDS[f].window, mb.length)
                for f in ("routed_experts", "sampling_mask")
            }
            every = [s for segs in mb.segments.values() for s in segs]
            got = read_fields(every, windows, root=tmp_path)
            for f, window in windows.items():
                labels = PAYLOAD_FIELDS[f].window == "labels"
                want = _inline_coverage(ma, f, window, labels)
                np.testing.assert_array_equal(got[f].coverage.numpy(), want)
                checked += int(want.sum())
    assert checked > 0


def test_coverage_of_records_side_by_side_with_gaps_and_clipped_windows(tmp_path):
    """Records whose rows touch (one request after another, as a packed micro batch places
    them) and records after a gap: coverage is exactly the rows some live record holds, over
    windows that start and end inside records and span several runs."""
    rng = np.random.default_rng(7)
    segs, at = [], 0
    with PayloadWriter(tmp_path, group="g", name="touching") as w:
        for k in range(9):
            rows = int(rng.integers(1, 20))
            written = w.write({"routed_experts": rng.integers(0, 9, (rows, 2))}, pos=0)
            segs += shift_segments(written, at)
            at += rows + (5 if k % 3 == 2 else 0)  # a gap after every third record
    windows = [[(0, at)], [(0, at + 4)]]
    for _ in range(20):
        lo = int(rng.integers(0, at))
        windows.append([(lo, int(rng.integers(lo, at + 3))), (int(rng.integers(0, at)), at)])
    for ranges in windows:
        got = read_fields(segs, {"routed_experts": ranges}, root=tmp_path)["routed_experts"]
        want = reference_coverage(segs, "routed_experts", ranges)
        np.testing.assert_array_equal(got.coverage.numpy(), want)
        assert (got.values[~got.coverage] == PAYLOAD_FIELDS["routed_experts"].fill).all()


def _mask_records(tmp_path):
    """Two mask records (kept sets of 1..4 ids, the sampled token first) at positions 1..6 and
    9..12, written by one writer; returns the records and each position's kept set."""
    rng = np.random.default_rng(8)
    kept: dict[int, list[int]] = {}
    segs = []
    with PayloadWriter(tmp_path, group="g", name="labels") as w:
        for at, rows in ((1, 5), (9, 3)):
            counts = rng.integers(1, 5, rows)
            ids, sampled = kept_sets(rng, counts, 5000)
            written = w.write({"sampling_mask": (counts, ids)}, pos=0, sampled=sampled)
            segs += shift_segments(written, at)
            starts = np.cumsum(counts) - counts
            for r in range(rows):
                kept[at + r] = ids[starts[r] : starts[r] + counts[r]].tolist()
    return segs, kept


LABEL_WINDOW = [(0, 14), (10, 12), (2, 3)]  # uncovered rows, and rows listed twice


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_labels_fill_each_covered_rows_label_slot_and_uncovered_rows_stay_empty(tmp_path, checked):
    segs, kept = _mask_records(tmp_path)
    root = fast_root(tmp_path, verify_checksums=checked)
    positions = [p for lo, hi in LABEL_WINDOW for p in range(lo, hi)]
    tokens = 100_000 + np.arange(len(positions))  # one per window row, a repeat its own
    labels = {"sampling_mask": tokens}
    fast = compiled_read.read_compiled(
        segs, {"sampling_mask": LABEL_WINDOW}, root, None, PAYLOAD_FIELDS, labels
    )
    assert (fast is None) == checked  # the path the parameter names is the one taken
    got = read_fields(segs, {"sampling_mask": LABEL_WINDOW}, root=root, labels=labels)
    got = got["sampling_mask"]
    want = [
        [int(t), *kept[p][1:]] if p in kept else [] for p, t in zip(positions, tokens, strict=True)
    ]
    assert got.values.dtype == torch.int32 and row_lists(got.values) == want
    assert got.coverage.tolist() == [p in kept for p in positions]
    assert got.widest == max(len(k) for k in kept.values())
    # a row's sampled token as its label gives back the kept set as written
    sampled = torch.tensor([kept[p][0] if p in kept else -5 for p in positions], dtype=torch.int32)
    again = read_fields(
        segs, {"sampling_mask": LABEL_WINDOW}, root=root, labels={"sampling_mask": sampled}
    )
    assert row_lists(again["sampling_mask"].values) == [kept.get(p, []) for p in positions]
    padded = read_fields(segs, {"sampling_mask": LABEL_WINDOW}, root=root, width=5, labels=labels)
    want_padded = [(row + [-1] * 5)[:5] for row in want]
    assert padded["sampling_mask"].values.tolist() == want_padded
    plain = read_fields(segs, {"sampling_mask": LABEL_WINDOW}, root=root)["sampling_mask"]
    assert row_lists(plain.values) == [[-1, *kept[p][1:]] if p in kept else [] for p in positions]


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_labels_that_do_not_fit_the_read_are_input_errors(tmp_path, checked):
    segs, _ = _mask_records(tmp_path)
    root = fast_root(tmp_path, verify_checksums=checked)
    n = sum(hi - lo for lo, hi in LABEL_WINDOW)
    windows = {"sampling_mask": LABEL_WINDOW, "sampling_mask_logprobs": (0, 4)}
    for bad in (
        {"sampling_mask": np.arange(n - 1)},  # a token short
        {"sampling_mask": np.arange(n + 1)},  # a token over
        {"sampling_mask": np.arange(n, dtype=np.float32)},
        {"sampling_mask": np.arange(n).reshape(1, n)},
        {"sampling_mask_logprobs": np.arange(4)},  # a field without a label slot
        {"routed_experts": np.arange(4)},  # a field not read here
    ):
        with pytest.raises(PayloadInputError) as err:
            read_fields(segs, windows, root=root, labels=bad)
        assert err.value.field == next(iter(bad)), bad


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "planned"])
def test_a_covered_rows_label_past_int32_is_refused_naming_its_position(tmp_path, checked):
    """Ids are int32: a covered row's label that does not fit is an input error (the compiled
    read declines, the planned reader names the position), never wrapped; an uncovered row's
    label is never used, so it is not held to that."""
    segs, kept = _mask_records(tmp_path)
    root = fast_root(tmp_path, verify_checksums=checked)
    positions = [p for lo, hi in LABEL_WINDOW for p in range(lo, hi)]
    tokens = np.arange(len(positions), dtype=np.int64)
    tokens[positions.index(0)] = 2**31 + 5  # position 0: no record covers it
    windows = {"sampling_mask": LABEL_WINDOW}
    read_fields(segs, windows, root=root, labels={"sampling_mask": tokens})
    k = positions.index(min(kept) + 1)
    tokens[k] = -(2**31) - 1
    with pytest.raises(PayloadInputError, match="does not fit") as err:
        read_fields(segs, windows, root=root, labels={"sampling_mask": tokens})
    assert (err.value.field, err.value.pos) == ("sampling_mask", positions[k])


def test_a_window_listing_a_clipped_record_many_times_costs_its_output_on_the_planned_path(
    tmp_path, monkeypatch
):
    """The planned reader reads a clipped record's values into a buffer of that piece's values
    only: 64 listings of one 100k-id row cost a few times their output (25 MiB: int64 places
    of each int32 value in the scatters), not 64 windows' worth (1.6 GB)."""
    import tracemalloc

    monkeypatch.setattr(compiled_read, "_window", None)
    counts = np.array([1, 100_000, 1, 1])
    ids = np.concatenate([np.arange(c) for c in counts]).astype(np.int32)
    with PayloadWriter(tmp_path, group="g", name="w") as w:
        segs = w.write({"sampling_mask": (counts, ids)}, pos=0, sampled=np.zeros(4, np.int64))
    window = [(1, 3)] * 64  # the wide row and the next, clipped (not the whole record), 64 times
    tracemalloc.start()
    try:
        got = read_field(segs, "sampling_mask", window, root=tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.nnz == 64 * (100_000 + 1)
    assert got.values[:100_000].tolist() == [-1, *range(1, 100_000)]  # label slot, then ids
    assert peak < 10 * got.nbytes, (peak, got.nbytes)
