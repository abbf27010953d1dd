"""One call reads several fields over their windows: bitwise what ``read_field`` reads field by
field, with a coverage per field that says which rows came from data, and one ``preadv`` per
contiguous range of a file (region headers included)."""

import os

import numpy as np
import pytest
import torch

from rollfeed.collate.cp import field_ranges, rank_ranges
from rollfeed.payload import (
    PayloadMissingFileError,
    PayloadRoot,
    PayloadWriter,
    read_field,
    read_fields,
    shift_segments,
)
from rollfeed.payload.fields import PAYLOAD_FIELDS
from rollfeed.payload.read import compiled_read
from tests.payload.reference import kept_sets

FIELDS = ("routed_experts", "routed_expert_weights", "sampling_mask", "sampling_mask_logprobs")


def packed_micro_batch(tmp_path, rng, *, files=3, samples=7, unit=4, clip=True):
    """Samples written by ``files`` writers, packed one after another into one row (each slot a
    multiple of ``unit``, so both CP layouts split it); some fields are missing or clipped."""
    writers = [PayloadWriter(tmp_path, group="g", name=f"w{i}") for i in range(files)]
    segs, cu = [], [0]
    for k in range(samples):
        rows = int(rng.integers(1, 300))
        counts = rng.integers(1, 6, rows)
        ids, sampled = kept_sets(rng, counts, 5000)
        arrays = {
            "routed_experts": rng.integers(0, 200, (rows, 2, 3)),
            "routed_expert_weights": rng.random((rows, 2)).astype(np.float32),
            "sampling_mask": (counts, ids),
            "sampling_mask_logprobs": (counts, -rng.random(counts.sum()).astype(np.float32)),
        }
        if k % 3 == 1:
            del arrays["routed_expert_weights"]  # a field some samples lack
        mine = writers[k % files].write(arrays, pos=0, sampled=sampled)
        if clip and k % 4 == 2:  # a record clipped at its tail (truncation)
            mine = [s.model_copy(update={"rows": s.rows // 2}) for s in mine]
        slot = -(-(rows + 1) // unit) * unit
        segs += shift_segments(mine, cu[-1] + 1)
        cu.append(cu[-1] + slot)
    for w in writers:
        w.close()
    return segs, cu


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
            assert got[f].values.dtype == one.dtype and torch.equal(got[f].values, one), f
            want = reference_coverage(segs, f, per_field[f])
            assert got[f].coverage.dtype == torch.bool
            np.testing.assert_array_equal(got[f].coverage.numpy(), want)
            fill = PAYLOAD_FIELDS[f].fill
            assert (one[~got[f].coverage] == fill).all()


def test_fields_no_segment_carries_are_left_out(tmp_path):
    rng = np.random.default_rng(0)
    segs, _ = packed_micro_batch(tmp_path, rng, samples=2)
    only_mask = [s for s in segs if s.field == "sampling_mask"]
    got = read_fields(only_mask, {"sampling_mask": (0, 4), "routed_experts": (0, 4)}, root=tmp_path)
    assert list(got) == ["sampling_mask"]
    assert read_field(only_mask, "routed_experts", (0, 4), root=tmp_path) is None


def test_placeholders_only_read_as_fill_with_no_coverage(tmp_path):
    rng = np.random.default_rng(1)
    segs, _ = packed_micro_batch(tmp_path, rng, samples=2)
    empty = [s.model_copy(update={"rows": 0, "file": "g/gone.rfp"}) for s in segs]
    got = read_fields(empty, {"sampling_mask": (0, 3)}, root=tmp_path)["sampling_mask"]
    assert got.values.tolist() == [[-1]] * 3 and not got.coverage.any()


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
        assert torch.equal(got[f].values, read_field(segs, f, windows[f], root=tmp_path))


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
